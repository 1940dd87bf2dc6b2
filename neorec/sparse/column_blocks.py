"""``ColumnBlocks``: a [rows, width] matrix given as column blocks of other matrices, not yet copied
into one tensor.

A sharded embedding collection receives each rank's pooled columns as one block of a buffer
(``neorec/sharding/output_dist.py``); its output matrix is a permutation of those blocks' columns.
``materialize()`` copies them into the [rows, width] matrix (differentiably, row by row across all
blocks, ``neorec.native.blocks.copy_blocks``); a consumer that can read the blocks where they are
(the native dot interaction, ``neorec/model/native_interaction.py``) skips that copy and its
backward (13.6 MB each way per step in the pool1 2-rank benchmark).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch

from neorec.native.blocks import copy_blocks

Run = Tuple[int, int, int, int]  # (part, first column in the part, first column of the matrix, width)


@dataclass(frozen=True, eq=False)
class ColumnBlocks:
    """``matrix[:, t : t + w] = part_p[:, s : s + w]`` for every run (p, s, t, w) of ``runs``, which
    cover every column of the matrix once. Parts: ``flat`` (1-D) holds the blocks
    [rows, flat_widths[k]] one after the other (parts 0 .. len(flat_widths) - 1), then ``extras``
    ([rows, w] each, unit column stride). Every column of the flat parts is read by exactly one
    run (its gradient is written, never accumulated)."""

    flat: torch.Tensor
    rows: int
    flat_widths: Tuple[int, ...]
    extras: Tuple[torch.Tensor, ...]
    runs: Tuple[Run, ...]

    @property
    def width(self) -> int:
        return sum(w for _, _, _, w in self.runs)

    def parts(self) -> List[torch.Tensor]:
        """The parts as [rows, w] tensors (views of ``flat``, then the extras)."""
        return flat_views(self.flat, self.rows, self.flat_widths) + list(self.extras)

    def materialize(self) -> torch.Tensor:
        """The [rows, width] matrix, differentiable in ``flat`` and the extras."""
        return _PlaceParts.apply(self.runs, self.rows, self.flat_widths, self.flat, *self.extras)


def flat_views(flat: torch.Tensor, rows: int, widths: Sequence[int]) -> List[torch.Tensor]:
    """``flat``'s consecutive blocks [rows, widths[k]] as views."""
    views, start = [], 0
    for width in widths:
        views.append(flat[start : start + rows * width].view(rows, width))
        start += rows * width
    return views


class _PlaceParts(torch.autograd.Function):
    """The runs' block copies, forward and backward (where a per-column ``index_select`` and its
    scatter-add backward touch every element through an index, and concatenating the parts costs
    a full extra copy each way), all blocks of a row before the next row on CPU
    (``neorec.native.blocks.copy_blocks``)."""

    @staticmethod
    def forward(ctx, runs, rows, flat_widths, flat, *extras):  # type: ignore[override]
        ctx.runs, ctx.rows, ctx.flat_widths = runs, rows, flat_widths
        ctx.flat_numel, ctx.extra_shapes = flat.numel(), [e.shape for e in extras]
        parts = flat_views(flat, rows, flat_widths) + list(extras)
        out = flat.new_empty(rows, sum(w for _, _, _, w in runs))
        copy_blocks([(out[:, target : target + width], parts[part][:, source : source + width])
                     for part, source, target, width in runs])
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        grad_flat = grad_out.new_empty(ctx.flat_numel)
        grad_extras = [grad_out.new_empty(shape) for shape in ctx.extra_shapes]
        parts = flat_views(grad_flat, ctx.rows, ctx.flat_widths) + grad_extras
        copy_blocks([(parts[part][:, source : source + width], grad_out[:, target : target + width])
                     for part, source, target, width in ctx.runs])
        return (None, None, None, grad_flat, *grad_extras)
