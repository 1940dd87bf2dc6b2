"""Placement of the received pooled columns into the output layout (``output_dist.py``).

    python -m pytest tests/unit/sharding/test_output_placement.py -q
"""

from __future__ import annotations

import torch

from neorec.sharding.output_dist import column_runs, part_runs, place_parts


def test_column_runs_merge_consecutive_targets():
    assert column_runs([0, 1, 4, 5, 2, 3, 6]) == [(0, 0, 2), (2, 4, 2), (4, 2, 2), (6, 6, 1)]
    assert column_runs(list(range(5))) == [(0, 0, 5)]
    assert column_runs([]) == []


def test_part_runs_cut_runs_at_part_boundaries():
    # parts of widths 3 and 2; received columns 2 and 3 are adjacent in the output but in two parts
    assert part_runs([0, 1, 2, 3, 4], [3, 2]) == [(0, 0, 0, 3), (1, 0, 3, 2)]
    assert part_runs([3, 4, 0, 1, 2], [2, 3]) == [(0, 0, 3, 2), (1, 0, 0, 3)]


def test_placing_parts_equals_concatenation_and_index_select_forward_and_backward():
    columns = [4, 5, 6, 0, 1, 7, 2, 3]  # received column i -> output column columns[i]
    widths = [3, 3, 2]  # e.g. rank 0's block, rank 1's block, the replica columns
    inverse = torch.empty(len(columns), dtype=torch.int64)
    inverse[torch.tensor(columns)] = torch.arange(len(columns))
    flat = torch.randn(5 * 6, requires_grad=True)  # the two ranks' blocks as one received buffer
    replica = torch.randn(5, 4, requires_grad=True)[:, 1:3]  # a strided column slice
    parts = [flat[:15].view(5, 3), flat[15:].view(5, 3), replica]
    placed = place_parts(flat, 5, widths[:2], [replica], part_runs(columns, widths))
    expected = torch.cat(parts, dim=1).index_select(1, inverse)
    assert torch.equal(placed, expected)
    grad = torch.randn(5, len(columns))
    mine = torch.autograd.grad(placed, (flat, replica), grad)
    reference = torch.autograd.grad(expected, (flat, replica), grad)
    assert all(torch.equal(a, b) for a, b in zip(mine, reference))
