"""The DLRM dot interaction on neorec's native CPU kernels (``neorec/native/interaction.c``).

``dot_interaction(dense [B, D], sparse [B, F, D], self_interaction)`` -> [B, D + P]: the dense
vector, then the pairwise dot products, exactly what ``DotInteraction`` returns, differentiable in
both inputs. It computes only the P pairs per sample (no [B, F+1, D] concatenation, no [B, F+1, F+1]
Gram matrix) and splits the samples over ``torch.get_num_threads()`` (OpenMP) threads. fp32 CPU tensors only;
``DotInteraction`` keeps its batched-matmul path everywhere else.

``dot_interaction_blocks(dense, blocks, self_interaction)``: the same with the sparse vectors given
as ``ColumnBlocks`` ([B, F * D] as column blocks of other tensors, what a sharded collection
received): the kernels read every vector where it lies and write its gradient to the same place in
a gradient of the same blocks (when a vector is split between two blocks, a column-wise sharded
table, each sample's vectors are gathered into a small buffer instead and their gradients
scattered back), so the [B, F * D] matrix is never built. Same bits as
``dot_interaction(dense, blocks.materialize().view(B, F, D), ...)``.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch.autograd.function import once_differentiable

from neorec.native import MAX_NATIVE_DIM, load
from neorec.native.blocks import int64_table
from neorec.native.threads import threads_for
from neorec.sparse.column_blocks import ColumnBlocks

MIN_SAMPLES_PER_THREAD = 128


def native_interaction_supported(dense: torch.Tensor, sparse: Union[torch.Tensor, ColumnBlocks]) -> bool:
    """CPU fp32 operands of a dim from 1 up to ``MAX_NATIVE_DIM`` (the backward keeps a [dim] row on
    the stack: a wider one overflowed it; a dim of 0 handed the kernel empty tensors' NULL data to
    memcpy, undefined behaviour in C even for 0 bytes)."""
    tensors = [dense] + ([sparse.flat, *sparse.extras] if isinstance(sparse, ColumnBlocks) else [sparse])
    return 0 < dense.shape[-1] <= MAX_NATIVE_DIM and all(t.device.type == "cpu" and t.dtype == torch.float32
                                                      for t in tensors)


def _operands(dense: torch.Tensor, sparse: torch.Tensor):
    """(dense contiguous, sparse with unit-stride vectors, its row stride in floats)."""
    dense = dense.contiguous()
    if sparse.stride(2) != 1 or sparse.stride(1) != sparse.shape[2]:
        sparse = sparse.contiguous()
    return dense, sparse, sparse.stride(0)


def _num_pairs(num_features: int, self_interaction: bool) -> int:
    n = num_features + 1
    return n * (n + 1) // 2 if self_interaction else n * (n - 1) // 2


def _rows_of_floats(grad_out: torch.Tensor) -> torch.Tensor:
    """``grad_out`` as fp32 rows with unit column stride (rows may be padded, as AlignedLinear's are)."""
    if grad_out.dtype != torch.float32 or grad_out.stride(1) != 1:
        grad_out = grad_out.to(torch.float32).contiguous()
    return grad_out


class _DotInteraction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dense, sparse, self_interaction):  # type: ignore[override]
        library = load()
        dense, sparse, stride = _operands(dense, sparse)
        batch, num_features, dim = sparse.shape
        pairs = _num_pairs(num_features, self_interaction)
        out = torch.empty(batch, dim + pairs, dtype=torch.float32)
        library.neorec_dot_interaction_forward(dense.data_ptr(), sparse.data_ptr(), num_features, dim, stride,
                                               int(self_interaction), batch,
                                               threads_for(batch, MIN_SAMPLES_PER_THREAD), out.data_ptr())
        ctx.save_for_backward(dense, sparse)
        ctx.self_interaction = bool(self_interaction)
        return out

    @staticmethod
    @once_differentiable  # (C code outside autograd: a double backward is refused, not silently zero)
    def backward(ctx, grad_out):  # type: ignore[override]
        library = load()
        dense, sparse = ctx.saved_tensors
        grad_out = _rows_of_floats(grad_out)
        batch, num_features, dim = sparse.shape
        grad_dense = torch.empty(batch, dim, dtype=torch.float32)
        grad_sparse = torch.empty(batch, num_features, dim, dtype=torch.float32)
        library.neorec_dot_interaction_backward(grad_out.data_ptr(), grad_out.stride(0), dense.data_ptr(),
                                                sparse.data_ptr(),
                                                num_features, dim, sparse.stride(0), int(ctx.self_interaction),
                                                batch, threads_for(batch, MIN_SAMPLES_PER_THREAD),
                                                grad_dense.data_ptr(), grad_sparse.data_ptr())
        return grad_dense, grad_sparse, None


def dot_interaction(dense: torch.Tensor, sparse: torch.Tensor, self_interaction: bool) -> torch.Tensor:
    """dense [B, D], sparse [B, F, D] fp32 CPU -> [B, D + P] (see the module docstring)."""
    return _DotInteraction.apply(dense, sparse, self_interaction)


def _block_table(parts: Sequence[torch.Tensor], runs) -> Tuple[torch.Tensor, List[int]]:
    """Per run (the kernels' four arrays): the address of its first element in sample 0, the row
    stride in bytes, the byte offset in a sample's [F * dim] vectors, the bytes per sample."""
    size = 4  # fp32
    return int64_table([[parts[p].data_ptr() + s * size, parts[p].stride(0) * size, t * size, w * size]
                        for p, s, t, w in runs], 4)


def _vector_table(parts: Sequence[torch.Tensor], runs, dim: int) -> Optional[Tuple[torch.Tensor, List[int]]]:
    """Per sparse vector, in feature order (the ``_vectors`` kernels' two arrays): the address of its
    first element in sample 0 and the row stride in bytes; None when a vector is split over two runs
    (a column-wise sharded table), which the ``_blocks`` kernels gather instead."""
    size = 4  # fp32
    vectors = []  # (column in the [B, F * D] matrix, address, stride)
    for p, s, t, w in runs:
        if t % dim or w % dim:
            return None
        vectors += [(t + c, parts[p].data_ptr() + (s + c) * size, parts[p].stride(0) * size) for c in range(0, w, dim)]
    vectors.sort()
    return int64_table([v[1:] for v in vectors], 2)


class _DotInteractionBlocks(torch.autograd.Function):
    """``dot_interaction`` reading the sparse vectors from column blocks (``ColumnBlocks``): in place
    when every vector lies whole in one run, else gathered per sample."""

    @staticmethod
    def forward(ctx, dense, self_interaction, num_features, rows, flat_widths, runs, flat, *extras):  # type: ignore[override]
        library = load()
        dense = dense.contiguous()
        extras = tuple(e if e.stride(1) == 1 else e.contiguous() for e in extras)
        blocks = ColumnBlocks(flat.contiguous(), rows, flat_widths, extras, runs)
        batch, dim = dense.shape
        pairs = _num_pairs(num_features, self_interaction)
        out = torch.empty(batch, dim + pairs, dtype=torch.float32)
        threads = threads_for(batch, MIN_SAMPLES_PER_THREAD)
        vectors = _vector_table(blocks.parts(), runs, dim)
        if vectors is not None:
            library.neorec_dot_interaction_forward_vectors(dense.data_ptr(), num_features, dim, int(self_interaction),
                                                           batch, threads, *vectors[1], out.data_ptr())
        else:
            _table, pointers = _block_table(blocks.parts(), runs)
            library.neorec_dot_interaction_forward_blocks(dense.data_ptr(), num_features, dim, int(self_interaction),
                                                          batch, threads, len(runs), *pointers, out.data_ptr())
        ctx.save_for_backward(dense, blocks.flat, *extras)
        ctx.meta = (bool(self_interaction), num_features, rows, flat_widths, runs)
        return out

    @staticmethod
    @once_differentiable  # (C code outside autograd: a double backward is refused, not silently zero)
    def backward(ctx, grad_out):  # type: ignore[override]
        library = load()
        dense, flat, *extras = ctx.saved_tensors
        self_interaction, num_features, rows, flat_widths, runs = ctx.meta
        grad_out = _rows_of_floats(grad_out)
        batch, dim = dense.shape
        threads = threads_for(batch, MIN_SAMPLES_PER_THREAD)
        blocks = ColumnBlocks(flat, rows, flat_widths, tuple(extras), runs)
        extra_grads = tuple(torch.empty(e.shape, dtype=torch.float32) for e in extras)  # fp32 whatever the default
        grads = ColumnBlocks(torch.empty_like(flat), rows, flat_widths, extra_grads, runs)  # every column written
        grad_dense = torch.empty(batch, dim, dtype=torch.float32)
        vectors = _vector_table(blocks.parts(), runs, dim)
        if vectors is not None:
            _grad_table, grad_pointers = _vector_table(grads.parts(), runs, dim)
            library.neorec_dot_interaction_backward_vectors(grad_out.data_ptr(), grad_out.stride(0), dense.data_ptr(),
                                                            num_features, dim, int(self_interaction), batch, threads,
                                                            *vectors[1], *grad_pointers, grad_dense.data_ptr())
        else:
            _table, pointers = _block_table(blocks.parts(), runs)
            _grad_table, grad_pointers = _block_table(grads.parts(), runs)
            library.neorec_dot_interaction_backward_blocks(grad_out.data_ptr(), grad_out.stride(0), dense.data_ptr(),
                                                           num_features, dim, int(self_interaction), batch, threads,
                                                           len(runs), *pointers, grad_pointers[0], grad_pointers[1],
                                                           grad_dense.data_ptr())
        return (grad_dense, None, None, None, None, None, grads.flat, *grads.extras)


def dot_interaction_blocks(dense: torch.Tensor, blocks: ColumnBlocks, self_interaction: bool) -> torch.Tensor:
    """dense [B, D], blocks: [B, F * D] as ColumnBlocks (fp32 CPU) -> [B, D + P]."""
    batch, dim = dense.shape
    if blocks.rows != batch or blocks.width % dim:
        raise ValueError(f"dot_interaction_blocks: blocks of {blocks.rows} x {blocks.width} do not hold "
                         f"[{batch}, F * {dim}] vectors")
    return _DotInteractionBlocks.apply(dense, bool(self_interaction), blocks.width // dim, blocks.rows,
                                       blocks.flat_widths, blocks.runs, blocks.flat, *blocks.extras)
