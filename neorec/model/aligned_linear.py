"""``AlignedLinear``: an ``nn.Linear`` whose backward products run on an input width rounded up
to a multiple of 8.

The backward of ``y = x W^T + b`` forms ``grad_x = g W`` and ``grad_W = g^T x``; both have the
layer's input width K as their output width. CPU GEMM libraries run much slower when that width is
not a multiple of the SIMD width: on the 2-core AVX2 test machine (MKL, torch 2.13) all the GEMMs
of a pool1 DLRM step (top layer K = 64 + 351 = 415, bottom layer K = 13) take 37.0 ms at 2 threads,
35.4 ms with K padded to a multiple of 8 (``benchmarks/bench_floor.py``; the dense part end to
end: ``benchmarks/bench_aligned_linear.py``). So for CPU fp32 inputs whose K is not a multiple of 8, the backward pads
W and x with zero columns (a copy of a few MB, ~0.1 ms), multiplies, and returns the first K
columns: the same products (the zero columns add nothing to any sum that is kept), at the
faster shape. Parameters, ``state_dict`` and the forward (whose K is the reduction, where the
width does not matter) are those of ``nn.Linear``; other devices, dtypes, shapes and aligned
widths, and CPU autocast, run ``nn.Linear``'s own path. Its backward is differentiable again
(torch ops), so double backward (a gradient penalty) works.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ALIGN = 8


def _padded(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """[rows, width] copy of 2-D ``tensor`` with zero columns after its own."""
    out = tensor.new_empty(tensor.shape[0], width)
    out[:, : tensor.shape[1]].copy_(tensor)
    out[:, tensor.shape[1] :].zero_()
    return out


class _AlignedLinearFunction(torch.autograd.Function):
    """In the form torch.func's transforms (grad, vmap, jacrev) and forward-mode AD take, as they
    take ``nn.Linear`` (they refused the old form: "must override the setup_context staticmethod")."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, weight, bias):  # type: ignore[override]
        return torch.addmm(bias, x, weight.t()) if bias is not None else x.mm(weight.t())

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias = inputs
        ctx.save_for_backward(x, weight)
        ctx.save_for_forward(x, weight)
        ctx.has_bias = bias is not None

    @staticmethod
    def jvp(ctx, x_tangent, weight_tangent, bias_tangent):
        x, weight = ctx.saved_tensors
        out = torch.zeros(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
        if x_tangent is not None:
            out = out + x_tangent.mm(weight.t())
        if weight_tangent is not None:
            out = out + x.mm(weight_tangent.t())
        if bias_tangent is not None:
            out = out + bias_tangent
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        width = weight.shape[1]
        padded = -(-width // ALIGN) * ALIGN
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = grad.mm(_padded(weight, padded))[:, :width]
        if ctx.needs_input_grad[1]:
            grad_weight = grad.t().mm(_padded(x, padded))[:, :width]
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.sum(0)
        return grad_x, grad_weight, grad_bias


def _cpu_autocast() -> bool:
    """Whether CPU autocast is on (its matmuls run in a lower precision: ``nn.Linear``'s own path,
    which autocast knows, takes them; the aligned backward multiplied a bf16 gradient with fp32
    weights and failed)."""
    try:
        return torch.is_autocast_enabled("cpu")
    except TypeError:  # torch < 2.4
        return torch.is_autocast_cpu_enabled()


class AlignedLinear(nn.Linear):
    """``nn.Linear`` with the backward products on an input width aligned to 8 (module docstring)."""

    def _aligned_path(self, x: torch.Tensor) -> bool:
        return (self.in_features % ALIGN != 0 and x.dim() == 2 and x.device.type == "cpu"
                and x.dtype == torch.float32 and self.weight.dtype == torch.float32 and torch.is_grad_enabled()
                and (x.requires_grad or self.weight.requires_grad) and not _cpu_autocast())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._aligned_path(x):
            return _AlignedLinearFunction.apply(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)
