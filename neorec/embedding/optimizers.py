"""Sparse optimizers fused into the embedding backward: SGD, AdaGrad, row-wise AdaGrad, lazy Adam.

Each update touches only the rows that received a gradient in this step. ``rows`` are unique, so
every scatter below writes each row once: the result does not depend on thread scheduling and the
same inputs give the same bits.

Update rules (``g`` is the aggregated gradient of one row, ``w`` the row, all fp32; with
``weight_decay`` > 0, ``g += weight_decay * w`` first):

- ``sgd``:             ``w -= lr * g``
- ``adagrad``:         ``s += g * g`` (per element);           ``w -= lr * g / (sqrt(s) + eps)``
- ``rowwise_adagrad``: ``s += mean(g * g)`` (one value per row); ``w -= lr * g / (sqrt(s) + eps)``
- ``adam`` (lazy, like ``torch.optim.SparseAdam``): ``m = b1 m + (1 - b1) g``,
  ``v = b2 v + (1 - b2) g^2``, ``w -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)``
  with ``t`` the module's global step count (1 at the first update).

State lives in flat fp32 buffers laid out like the weights: ``momentum1`` (and ``momentum2`` for
Adam) with one value per row (row-wise AdaGrad) or one per element (AdaGrad, Adam).
"""

from __future__ import annotations

import math
from typing import Dict, Tuple

import torch

from neorec.embedding.config import SPARSE_OPTIMIZERS, SparseOptimizerConfig
from neorec.embedding.memory import empty_huge
from neorec.embedding.precision import Rounder

# state name -> "row" (one fp32 value per row) or "element" (one per weight element)
STATE_LAYOUT: Dict[str, Tuple[Tuple[str, str], ...]] = {
    "sgd": (),
    "adagrad": (("momentum1", "element"),),
    "rowwise_adagrad": (("momentum1", "row"),),
    "adam": (("momentum1", "element"), ("momentum2", "element")),
}
assert set(STATE_LAYOUT) == set(SPARSE_OPTIMIZERS)


def create_state(
    config: SparseOptimizerConfig, num_rows: int, num_elements: int, device=None
) -> Dict[str, torch.Tensor]:
    """Flat fp32 state buffers: name -> [num_rows] or [num_elements]."""
    initial = config.initial_accumulator_value if config.kind in ("adagrad", "rowwise_adagrad") else 0.0
    out = {}
    for name, layout in STATE_LAYOUT[config.kind]:
        size = num_rows if layout == "row" else num_elements
        out[name] = empty_huge(size, torch.float32, device).fill_(float(initial))
    return out


def state_views(
    kind: str,
    buffers: Dict[str, torch.Tensor],
    row_start: int,
    num_rows: int,
    element_start: int,
    dim: int,
) -> Dict[str, torch.Tensor]:
    """Views of the flat state for a block of ``num_rows`` consecutive rows of width ``dim``:
    [num_rows] for row-wise state, [num_rows, dim] for per-element state."""
    views = {}
    for name, layout in STATE_LAYOUT[kind]:
        flat = buffers[name]
        if layout == "row":
            views[name] = flat[row_start : row_start + num_rows]
        else:
            views[name] = flat[element_start : element_start + num_rows * dim].view(num_rows, dim)
    return views


def update_rows(
    config: SparseOptimizerConfig,
    weights: torch.Tensor,
    states: Dict[str, torch.Tensor],
    rows: torch.Tensor,
    grad: torch.Tensor,
    step: int,
    rounder: Rounder,
) -> None:
    """Apply one optimizer step to ``rows`` in place.

    Args:
        config: optimizer kind and hyper-parameters (``learning_rate`` is read on every call).
        weights: [R, D] weights of one dim group (fp32, fp16 or bf16), updated in place.
        states: from ``state_views`` for the same rows ([R] or [R, D] fp32), updated in place.
        rows: [C] unique row indices into ``weights`` (int32 or int64).
        grad: [C, D] fp32 aggregated gradient of those rows; consumed (overwritten).
        step: global step count after this update (>= 1), used by Adam's bias correction.
        rounder: rounds the updated fp32 rows to the storage dtype (fp16/bf16 only).
    """
    lr = float(config.learning_rate)
    full_precision = weights.dtype == torch.float32
    old = None
    if config.weight_decay != 0.0 or not full_precision:
        old = weights.index_select(0, rows)
        if not full_precision:
            old = old.float()
        if config.weight_decay != 0.0:
            grad.add_(old, alpha=float(config.weight_decay))

    kind = config.kind
    if kind == "sgd":
        delta = grad.mul_(-lr)
    elif kind == "rowwise_adagrad":
        accumulator = states["momentum1"]
        squares = torch.linalg.vector_norm(grad, dim=1).square_()  # one pass, no [C, D] temporary
        row_sum = accumulator.index_select(0, rows).add_(squares, alpha=1.0 / grad.shape[1])
        accumulator.index_copy_(0, rows, row_sum)
        scale = row_sum.sqrt_().add_(config.eps).reciprocal_().mul_(-lr)
        delta = grad.mul_(scale.unsqueeze(1))
    elif kind == "adagrad":
        accumulator = states["momentum1"]
        element_sum = accumulator.index_select(0, rows).addcmul_(grad, grad)
        accumulator.index_copy_(0, rows, element_sum)
        delta = grad.div_(element_sum.sqrt_().add_(config.eps)).mul_(-lr)
    elif kind == "adam":
        beta1, beta2 = float(config.beta1), float(config.beta2)
        first = states["momentum1"].index_select(0, rows).mul_(beta1).add_(grad, alpha=1.0 - beta1)
        second = states["momentum2"].index_select(0, rows).mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        states["momentum1"].index_copy_(0, rows, first)
        states["momentum2"].index_copy_(0, rows, second)
        step_size = lr * math.sqrt(1.0 - beta2**step) / (1.0 - beta1**step)
        delta = torch.div(first, second.sqrt_().add_(config.eps), out=grad).mul_(-step_size)
    else:  # pragma: no cover - SparseOptimizerConfig validates the kind
        raise ValueError(f"unknown sparse optimizer {kind!r}")

    if full_precision:
        weights.index_add_(0, rows, delta)
    else:
        weights.index_copy_(0, rows, rounder.round(old.add_(delta)))
