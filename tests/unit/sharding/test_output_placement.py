"""Placement of the received pooled columns into the output layout (``output_dist.py``).

    python -m pytest tests/unit/sharding/test_output_placement.py -q
"""

from __future__ import annotations

import torch

from neorec.sharding.output_dist import column_runs, part_runs
from neorec.sparse.column_blocks import ColumnBlocks


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
    placed = ColumnBlocks(flat, 5, tuple(widths[:2]), (replica,), tuple(part_runs(columns, widths))).materialize()
    expected = torch.cat(parts, dim=1).index_select(1, inverse)
    assert torch.equal(placed, expected)
    grad = torch.randn(5, len(columns))
    mine = torch.autograd.grad(placed, (flat, replica), grad)
    reference = torch.autograd.grad(expected, (flat, replica), grad)
    assert all(torch.equal(a, b) for a, b in zip(mine, reference))


def _block_pairs(rows: int, widths, dtype, generator):
    """A column-block permutation of a [rows, sum(widths)] source (rows padded: a row stride wider
    than the blocks) into a fresh destination: (pairs, source, destination, permutation)."""
    total = sum(widths)
    source = (torch.randn(rows, total + 3, generator=generator) * 100).to(dtype)[:, 1 : total + 1]
    destination = torch.zeros(rows, total, dtype=dtype)
    order = torch.randperm(len(widths), generator=generator).tolist()
    starts = [sum(widths[:k]) for k in range(len(widths))]
    pairs, target = [], 0
    for k in order:
        pairs.append((destination[:, target : target + widths[k]], source[:, starts[k] : starts[k] + widths[k]]))
        target += widths[k]
    return pairs, source, destination, order


def test_copy_blocks_equals_copy_per_block(monkeypatch):
    """The native row-by-row copy (large enough for two threads) gives exactly what copy_ per
    block gives, for several dtypes, odd widths and a padded source row stride."""
    from neorec.native.blocks import copy_blocks

    generator = torch.Generator().manual_seed(3)
    for dtype, rows in ((torch.float32, 5000), (torch.float16, 300), (torch.int64, 7)):
        widths = [64, 1, 3, 64, 17, 64, 64, 128]
        pairs, source, destination, order = _block_pairs(rows, widths, dtype, generator)
        copy_blocks(pairs)
        expected = torch.cat([pairs[i][1] for i in range(len(order))], dim=1)
        assert torch.equal(destination, expected)
        monkeypatch.setenv("NEOREC_NATIVE", "0")  # the plain path agrees
        fallback = [(torch.empty_like(d), s) for d, s in pairs]
        copy_blocks(fallback)
        assert torch.equal(torch.cat([d for d, _ in fallback], dim=1), expected)
        monkeypatch.delenv("NEOREC_NATIVE")


def test_copy_blocks_falls_back_for_other_layouts():
    """Blocks the native copy does not take (a column stride, rows that differ between pairs) are
    copied with copy_, and empty blocks are skipped."""
    from neorec.native.blocks import copy_blocks

    source = torch.randn(6, 8)
    strided = torch.empty(8, 6).t()  # [6, 8] with column stride 6
    other_rows = torch.empty(3, 2)
    copy_blocks([(strided, source), (other_rows, source[:3, :2]), (torch.empty(6, 0), source[:, :0])])
    assert torch.equal(strided, source) and torch.equal(other_rows, source[:3, :2])


def test_copy_blocks_takes_pairs_of_different_dtypes():
    """Every pair's byte strides and widths were computed with the first pair's element size: an
    fp64 pair after an fp32 one was copied short, an fp16 one past its rows' ends (heap corruption)."""
    from neorec.native.blocks import copy_blocks

    rows = 4
    a_src, a_dst = torch.randn(rows, 2), torch.zeros(rows, 2)
    b_src, b_dst = torch.randn(rows, 3, dtype=torch.float64), torch.zeros(rows, 3, dtype=torch.float64)
    c_src = torch.arange(rows * 8, dtype=torch.float16).view(rows, 8)
    c_dst = torch.full((rows, 8), -1.0, dtype=torch.float16)
    copy_blocks([(a_dst, a_src), (b_dst, b_src), (c_dst[:, :3], c_src[:, :3])])
    assert torch.equal(a_dst, a_src) and torch.equal(b_dst, b_src)
    assert torch.equal(c_dst[:, :3], c_src[:, :3]) and bool((c_dst[:, 3:] == -1).all())  # nothing past the block
