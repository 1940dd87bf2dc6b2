"""Copies of many column blocks at once (``neorec/native/blocks.c``): ``dst.copy_(src)`` for every
pair, done row by row across all the blocks instead of block after block.

A permutation of narrow column blocks of a wide matrix (the sharded embedding output: one 64-wide
block per table) done block after block walks every row of the matrix once per block, each row on
another 4 KiB page; measured in a 2-rank training step, 26 such [2048, 64] copies each way took
~18 ms per step. Row by row, one row's pages serve all its blocks.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from neorec.native import build, threads

MIN_BYTES_PER_THREAD = 1 << 20  # a thread is worth starting for about a MiB of copying


def int64_table(rows: Sequence[Sequence[int]], columns: int) -> Tuple[torch.Tensor, List[int]]:
    """``rows`` (each of ``columns`` integers) as the C kernels take them: one int64 array per column
    ([columns, len(rows)], contiguous), and each array's address. Keep the tensor alive while C reads it."""
    table = torch.tensor(rows, dtype=torch.int64).reshape(-1, columns).t().contiguous()
    return table, [table[k].data_ptr() for k in range(columns)]


def _native_ok(pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> bool:
    rows = pairs[0][0].shape[0]
    for dst, src in pairs:
        if (dst.device.type != "cpu" or src.device.type != "cpu" or dst.dtype != src.dtype or dst.dim() != 2
                or dst.shape != src.shape or dst.shape[0] != rows or (dst.shape[1] > 1 and
                                                                     (dst.stride(1) != 1 or src.stride(1) != 1))):
            return False
    return build.native_available() is None


def copy_blocks(pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``dst.copy_(src)`` for every ``(dst, src)`` pair. The fast path takes 2-D CPU tensors with
    the same number of rows, the same dtype and shape within each pair (pairs may differ in dtype)
    and unit column stride (any row
    stride); anything else is copied pair by pair with ``copy_``. Destinations must not overlap
    each other or the sources."""
    pairs = [(d, s) for d, s in pairs if d.numel()]
    if not pairs:
        return
    if not _native_ok(pairs):
        for dst, src in pairs:
            dst.copy_(src)
        return
    rows = pairs[0][0].shape[0]
    table, pointers = int64_table([[s.data_ptr(), s.stride(0) * s.element_size(), d.data_ptr(),
                                    d.stride(0) * d.element_size(), d.shape[1] * d.element_size()]
                                   for d, s in pairs], 5)  # bytes, each pair in its own dtype
    total = int(table[4].sum()) * rows
    build.load().neorec_copy_blocks(rows, len(pairs), *pointers, threads.threads_for(total, MIN_BYTES_PER_THREAD))
