"""Plain-torch reference of the table-batched kernels (loops; small sizes; the tests' yardstick).

Same arguments and semantics as ``neorec.embedding.kernels.triton_tbe``:

* forward: ``out[b, cols of f] = sum_i w_i * row(id_i)`` over the ids of bag (f, b); "mean"
  pooling divides by the number of ids in the bag (not by the sum of weights); empty bags give 0.
* backward fused with the optimizer: the gradient of row r is
  ``g_r = sum over values i with id r (in r's table) of scale_i * grad_output[b_i, cols of f_i]``
  with ``scale_i = w_i`` (sum) or ``w_i / len(bag_i)`` (mean), plus ``weight_decay * row`` when
  weight decay is on; then, for every touched row only:
    sgd:              row -= lr * g
    rowwise_adagrad:  s_r += mean(g * g);  row -= lr * g / (sqrt(s_r) + eps)
    adagrad:          s   += g * g;        row -= lr * g / (sqrt(s) + eps)   (element-wise)
  the update is computed in fp32 and stored in the weights' dtype, rounded to nearest or
  stochastically (``stochastic_round``).

The reference's stochastic rounding draws from ``torch.Generator(seed)``, the kernel's from
Philox; both round up with probability (x - down) / (up - down), so they agree in distribution,
not bit for bit.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from neorec.embedding.kernels.layout import TableBatchedLayout, check_batch, check_optimizer_kind


def reference_forward(
    weights: torch.Tensor,
    layout: TableBatchedLayout,
    indices: torch.Tensor,
    bag_offsets: torch.Tensor,
    batch_size: int,
    per_value_weights: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Pooled lookup of every bag; returns [batch_size, layout.total_cols] fp32."""
    check_batch(layout, weights, indices, bag_offsets, batch_size, per_value_weights)
    out = torch.zeros(batch_size, layout.total_cols, dtype=torch.float32, device=weights.device)
    offsets = bag_offsets.tolist()
    for feature in range(layout.num_features):
        table = int(layout.feature_table[feature])
        col = int(layout.output_col_offsets[feature])
        mean = bool(layout.feature_pooling_mean[feature])
        for sample in range(batch_size):
            bag = feature * batch_size + sample
            start, end = offsets[bag], offsets[bag + 1]
            total = torch.zeros(int(layout.table_dims[table]), dtype=torch.float32, device=weights.device)
            for position in range(start, end):
                weight = 1.0 if per_value_weights is None else float(per_value_weights[position])
                total += weight * _row(weights, layout, table, int(indices[position])).float()
            if mean and end > start:
                total /= end - start
            out[sample, col : col + total.numel()] = total
    return out


def reference_backward_update(
    kind: str,
    weights: torch.Tensor,
    state: Optional[torch.Tensor],
    layout: TableBatchedLayout,
    indices: torch.Tensor,
    bag_offsets: torch.Tensor,
    batch_size: int,
    grad_output: torch.Tensor,
    per_value_weights: Optional[torch.Tensor] = None,
    *,
    learning_rate: float,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    seed: int = 0,
    stochastic_rounding: bool = False,
) -> None:
    """Applies one fused optimizer step to the rows touched by the batch, in place."""
    check_optimizer_kind(kind)
    check_batch(layout, weights, indices, bag_offsets, batch_size, per_value_weights)
    grads: Dict[int, torch.Tensor] = {}  # global row -> gradient
    places: Dict[int, Tuple[int, int]] = {}  # global row -> (table, row in table)
    offsets = bag_offsets.tolist()
    for feature in range(layout.num_features):
        table = int(layout.feature_table[feature])
        dim = int(layout.table_dims[table])
        col = int(layout.output_col_offsets[feature])
        mean = bool(layout.feature_pooling_mean[feature])
        for sample in range(batch_size):
            bag = feature * batch_size + sample
            start, end = offsets[bag], offsets[bag + 1]
            for position in range(start, end):
                scale = 1.0 if per_value_weights is None else float(per_value_weights[position])
                if mean:
                    scale /= end - start
                row = int(layout.table_row_offsets[table]) + int(indices[position])
                places[row] = (table, int(indices[position]))
                contribution = scale * grad_output[sample, col : col + dim].float()
                grads[row] = grads[row] + contribution if row in grads else contribution
    generator = torch.Generator(device="cpu").manual_seed(seed)
    for global_row in sorted(grads):
        table, local_row = places[global_row]
        dim = int(layout.table_dims[table])
        start = int(layout.table_offsets[table]) + local_row * dim
        old = weights[start : start + dim].float()
        grad = grads[global_row] + weight_decay * old
        if kind == "sgd":
            new = old - learning_rate * grad
        elif kind == "rowwise_adagrad":
            state[global_row] += (grad * grad).mean()
            new = old - learning_rate * grad / (state[global_row].sqrt() + eps)
        else:
            state[start : start + dim] += grad * grad
            new = old - learning_rate * grad / (state[start : start + dim].sqrt() + eps)
        if stochastic_rounding and weights.dtype != torch.float32:
            weights[start : start + dim] = stochastic_round(new, weights.dtype, generator)
        else:
            weights[start : start + dim] = new.to(weights.dtype)


def stochastic_round(values: torch.Tensor, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """fp32 ``values`` -> ``dtype`` (fp16/bf16), rounding to one of the two neighbours ``down``
    (toward zero) and ``up`` (away from zero) with P(up) = (x - down) / (up - down): unbiased.
    Past the largest finite number ``up`` is inf, one top-binade step away (fp16 2^5, bf16 2^120):
    a value of that much more always becomes inf, as in the torch path."""
    down, up = rounding_bracket(values, dtype)
    top_step = 2.0**120 if dtype == torch.bfloat16 else 32.0
    gap = torch.where(up.float().isinf(), torch.full_like(values, top_step), (up.float() - down.float()).abs())
    probability_up = torch.where(gap != 0, (values - down.float()).abs() / gap, torch.zeros_like(values))
    probability_up = torch.nan_to_num(probability_up, nan=0.0)
    draw = torch.rand(values.shape, generator=generator).to(values.device)
    return torch.where(draw < probability_up, up, down)


def rounding_bracket(values: torch.Tensor, dtype: torch.dtype) -> List[torch.Tensor]:
    """The two ``dtype`` numbers around fp32 ``values``: [toward zero, next one away from zero]
    (equal-magnitude inputs give down == x). Same construction as the kernel: round to nearest,
    step the bit pattern back by one where that overshot."""
    nearest = values.to(dtype)
    bits = nearest.view(torch.int16).to(torch.int32)
    overshoot = nearest.float().abs() > values.abs()
    down_bits = torch.where(overshoot, bits - 1, bits)
    down = down_bits.to(torch.int16).view(dtype)
    up = (down_bits + 1).to(torch.int16).view(dtype)
    return [down, up]


def _row(weights: torch.Tensor, layout: TableBatchedLayout, table: int, row: int) -> torch.Tensor:
    dim = int(layout.table_dims[table])
    start = int(layout.table_offsets[table]) + row * dim
    return weights[start : start + dim]
