"""Placement of the received pooled columns into the output layout (``output_dist.py``).

    python -m pytest tests/unit/sharding/test_output_placement.py -q
"""

from __future__ import annotations

import torch

from neorec.sharding.output_dist import _PermuteColumnBlocks, column_runs


def test_column_runs_merge_consecutive_targets():
    assert column_runs([0, 1, 4, 5, 2, 3, 6]) == [(0, 0, 2), (2, 4, 2), (4, 2, 2), (6, 6, 1)]
    assert column_runs(list(range(5))) == [(0, 0, 5)]
    assert column_runs([]) == []


def test_block_permutation_equals_index_select_forward_and_backward():
    columns = [4, 5, 6, 0, 1, 7, 2, 3]  # received column i -> output column columns[i]
    inverse = torch.empty(len(columns), dtype=torch.int64)
    inverse[torch.tensor(columns)] = torch.arange(len(columns))
    received = torch.randn(5, len(columns), requires_grad=True)
    placed = _PermuteColumnBlocks.apply(received, column_runs(columns))
    expected = received.index_select(1, inverse)
    assert torch.equal(placed, expected)
    grad = torch.randn(5, len(columns))
    (mine,) = torch.autograd.grad(placed, received, grad)
    (reference,) = torch.autograd.grad(expected, received, grad)
    assert torch.equal(mine, reference)
