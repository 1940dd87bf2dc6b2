"""The DLRM dot interaction on neorec's native CPU kernels (``neorec/native/interaction.c``).

``dot_interaction(dense [B, D], sparse [B, F, D], self_interaction)`` -> [B, D + P]: the dense
vector, then the pairwise dot products, exactly what ``DotInteraction`` returns, differentiable in
both inputs. It computes only the P pairs per sample (no [B, F+1, D] concatenation, no [B, F+1, F+1]
Gram matrix) and splits the samples over ``torch.get_num_threads()`` (OpenMP) threads. fp32 CPU tensors only;
``DotInteraction`` keeps its batched-matmul path everywhere else.
"""

from __future__ import annotations

import torch

from neorec.native import load
from neorec.native.threads import threads_for

MIN_SAMPLES_PER_THREAD = 128


def native_interaction_supported(dense: torch.Tensor, sparse: torch.Tensor) -> bool:
    return (dense.device.type == "cpu" and sparse.device.type == "cpu"
            and dense.dtype == torch.float32 and sparse.dtype == torch.float32)


def _operands(dense: torch.Tensor, sparse: torch.Tensor):
    """(dense contiguous, sparse with unit-stride vectors, its row stride in floats)."""
    dense = dense.contiguous()
    if sparse.stride(2) != 1 or sparse.stride(1) != sparse.shape[2]:
        sparse = sparse.contiguous()
    return dense, sparse, sparse.stride(0)


class _DotInteraction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dense, sparse, self_interaction):  # type: ignore[override]
        library = load()
        dense, sparse, stride = _operands(dense, sparse)
        batch, num_features, dim = sparse.shape
        n = num_features + 1
        pairs = n * (n + 1) // 2 if self_interaction else n * (n - 1) // 2
        out = torch.empty(batch, dim + pairs, dtype=torch.float32)
        library.neorec_dot_interaction_forward(dense.data_ptr(), sparse.data_ptr(), num_features, dim, stride,
                                               int(self_interaction), batch,
                                               threads_for(batch, MIN_SAMPLES_PER_THREAD), out.data_ptr())
        ctx.save_for_backward(dense, sparse)
        ctx.self_interaction = bool(self_interaction)
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        library = load()
        dense, sparse = ctx.saved_tensors
        if grad_out.dtype != torch.float32 or grad_out.stride(1) != 1:  # rows may be padded (AlignedLinear)
            grad_out = grad_out.to(torch.float32).contiguous()
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
