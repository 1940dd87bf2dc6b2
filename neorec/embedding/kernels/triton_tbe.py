"""Triton kernels for the table-batched embedding op: pooled forward over all tables in one
launch, and the backward fused with the sparse optimizer (SGD, row-wise AdaGrad, AdaGrad).

Importing this module imports triton; use ``neorec.embedding.kernels.triton_available()`` first.
On a machine without CUDA the kernels run on CPU tensors under ``TRITON_INTERPRET=1`` (set before
triton is imported), which is how the tests check them:

    TRITON_INTERPRET=1 python -m pytest tests/gpu -m triton -q

Semantics (pooling, mean with weights, optimizer formulas, rounding) are spelled out in
``reference.py``; the storage layout in ``layout.py``.

Forward: grid (F * B bags, column blocks of the widest table). A program loads its bag's id range,
gathers ``BLOCK_L`` rows x ``BLOCK_D`` columns at a time (masked to the table's dim and to ids
inside the table), accumulates in fp32 and writes its slice of the output row.

Backward: ``segments.build_row_segments`` (torch ops on the device) sorts the values by global
row so that each unique row's values form one segment. One program per unique row sums its
segment's scaled grad_output slices in a fixed order, then updates the row and its state in
place: no dense gradient, no atomics, and the same inputs give the same bits. Hot rows (segments
longer than ``max_segment_values``) are first summed in chunks by a second kernel, one program
per chunk, into a small [chunks, BLOCK_D] buffer that the row's program adds in chunk order.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from neorec.embedding.kernels.layout import TableBatchedLayout, check_batch, check_optimizer_kind, launch_device
from neorec.embedding.kernels.segments import RowSegments, build_row_segments

_OPTIMIZER_CODES = {"sgd": 0, "rowwise_adagrad": 1, "adagrad": 2}


@triton.jit
def _pooled_forward_kernel(
    weights_ptr, indices_ptr, bag_offsets_ptr, per_value_weights_ptr,
    table_offsets_ptr, table_dims_ptr, table_rows_ptr,
    feature_table_ptr, feature_pooling_mean_ptr, output_col_offsets_ptr,
    output_ptr, batch_size, total_cols,
    HAS_WEIGHTS: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
):
    bag = tl.program_id(0)
    col_start = tl.program_id(1) * BLOCK_D
    feature = bag // batch_size
    sample = bag - feature * batch_size
    table = tl.load(feature_table_ptr + feature)
    dim = tl.load(table_dims_ptr + table)
    if col_start < dim:
        cols = col_start + tl.arange(0, BLOCK_D)
        col_mask = cols < dim
        table_offset = tl.load(table_offsets_ptr + table)
        num_rows = tl.load(table_rows_ptr + table)
        start = tl.load(bag_offsets_ptr + bag).to(tl.int64)
        end = tl.load(bag_offsets_ptr + bag + 1).to(tl.int64)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for chunk in range(start, end, BLOCK_L):
            positions = chunk + tl.arange(0, BLOCK_L)
            in_bag = positions < end
            ids = tl.load(indices_ptr + positions, mask=in_bag, other=0).to(tl.int64)
            # ids outside the table read nothing (the host check reports them as errors)
            valid = in_bag & (ids >= 0) & (ids < num_rows)
            row_starts = table_offset + ids * dim
            rows = tl.load(
                weights_ptr + row_starts[:, None] + cols[None, :],
                mask=valid[:, None] & col_mask[None, :],
                other=0.0,
            ).to(tl.float32)
            if HAS_WEIGHTS:
                scales = tl.load(per_value_weights_ptr + positions, mask=in_bag, other=0.0)
                rows = rows * scales.to(tl.float32)[:, None]
            acc += tl.sum(rows, axis=0)
        is_mean = tl.load(feature_pooling_mean_ptr + feature)
        count = end - start
        divisor = tl.where((is_mean != 0) & (count > 0), count, 1).to(tl.float32)
        acc = acc / divisor
        out_start = sample.to(tl.int64) * total_cols + tl.load(output_col_offsets_ptr + feature)
        tl.store(output_ptr + out_start + cols, acc, mask=col_mask)


@triton.jit
def _bf16_nearest_even(value):
    """fp32 -> bf16 rounded to nearest, ties to even, by integer ops (the same on GPUs and in the
    CPU interpreter, whose own bf16 cast truncates)."""
    bits = value.to(tl.int32, bitcast=True)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    rounded = tl.where(value != value, bits | 0x400000, rounded)
    return (rounded >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _round_for_storage(
    value, offsets, seed, STORAGE: tl.constexpr, BF16: tl.constexpr, STOCHASTIC: tl.constexpr
):
    """fp32 -> STORAGE dtype, to nearest; with STOCHASTIC, to ``up`` (the neighbour away from zero)
    with probability (x - down) / (up - down), else ``down`` (toward zero): unbiased. Past the
    largest finite value ``up`` is inf, one top-binade step away (fp16 2^5, bf16 2^120), as the
    torch path's bit trick rounds (it saturated to the largest value: the CPU run gave inf). The
    uniform draw is Philox at (seed, offsets)."""
    if BF16:
        nearest = _bf16_nearest_even(value)
    else:
        nearest = value.to(STORAGE)
    if STOCHASTIC:
        bits = nearest.to(tl.int16, bitcast=True)
        overshoot = tl.abs(nearest.to(tl.float32)) > tl.abs(value)
        down_bits = tl.where(overshoot, bits - 1, bits)
        down = down_bits.to(STORAGE, bitcast=True)
        up = (down_bits + 1).to(STORAGE, bitcast=True)
        down_value = down.to(tl.float32)
        up_value = up.to(tl.float32)
        top_step = 1.329227995784916e36 if BF16 else 32.0  # from the largest finite value to inf
        gap = tl.where(tl.abs(up_value) == float("inf"), top_step, tl.abs(up_value - down_value))
        # (gap is 0 only where the CPU interpreter flushes subnormals)
        probability_up = tl.where(gap != 0, tl.abs(value - down_value) / tl.where(gap != 0, gap, 1.0), 0.0)
        draw = tl.rand(seed, offsets)
        nearest = tl.where(draw < probability_up, up, down)
    return nearest


@triton.jit
def _sum_scaled_gradients(
    grad_output_ptr, sorted_grad_offsets_ptr, sorted_scales_ptr, start, end, cols, col_mask,
    BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """sum over sorted positions [start, end) of scale * grad_output slice, in a fixed order."""
    total = tl.zeros([BLOCK_D], dtype=tl.float32)
    for chunk in range(start, end, BLOCK_L):
        positions = chunk + tl.arange(0, BLOCK_L)
        in_range = positions < end
        sources = tl.load(sorted_grad_offsets_ptr + positions, mask=in_range, other=0)
        scales = tl.load(sorted_scales_ptr + positions, mask=in_range, other=0.0)
        tile = tl.load(
            grad_output_ptr + sources[:, None] + cols[None, :],
            mask=in_range[:, None] & col_mask[None, :],
            other=0.0,
        )
        total += tl.sum(tile * scales[:, None], axis=0)
    return total


@triton.jit
def _chunk_partial_kernel(
    grad_output_ptr, sorted_grad_offsets_ptr, sorted_scales_ptr,
    chunk_value_starts_ptr, chunk_value_ends_ptr, chunk_dims_ptr, partials_ptr, partial_stride,
    BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program per chunk of a long (hot) row: its partial gradient sum."""
    chunk = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < tl.load(chunk_dims_ptr + chunk)
    partial = _sum_scaled_gradients(
        grad_output_ptr, sorted_grad_offsets_ptr, sorted_scales_ptr,
        tl.load(chunk_value_starts_ptr + chunk), tl.load(chunk_value_ends_ptr + chunk),
        cols, col_mask, BLOCK_L, BLOCK_D,
    )
    tl.store(partials_ptr + chunk.to(tl.int64) * partial_stride + cols, partial, mask=col_mask)


@triton.jit
def _fused_backward_update_kernel(
    weights_ptr, state_ptr, grad_output_ptr,
    value_starts_ptr, value_ends_ptr, partial_starts_ptr, partial_ends_ptr, partials_ptr, partial_stride,
    row_weight_offsets_ptr, row_dims_ptr, row_state_index_ptr,
    sorted_grad_offsets_ptr, sorted_scales_ptr,
    learning_rate, eps, weight_decay, seed,
    OPTIMIZER: tl.constexpr, BF16: tl.constexpr, STOCHASTIC: tl.constexpr, HAS_PARTIALS: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program per unique row: gradient (own values, then long-row partials), then the
    optimizer update of the row and its state."""
    row = tl.program_id(0)
    dim = tl.load(row_dims_ptr + row)
    weight_offset = tl.load(row_weight_offsets_ptr + row)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < dim
    grad = _sum_scaled_gradients(
        grad_output_ptr, sorted_grad_offsets_ptr, sorted_scales_ptr,
        tl.load(value_starts_ptr + row), tl.load(value_ends_ptr + row),
        cols, col_mask, BLOCK_L, BLOCK_D,
    )
    if HAS_PARTIALS:
        for partial in range(tl.load(partial_starts_ptr + row), tl.load(partial_ends_ptr + row)):
            grad += tl.load(partials_ptr + partial * partial_stride + cols, mask=col_mask, other=0.0)
    weight_ptrs = weights_ptr + weight_offset + cols
    old = tl.load(weight_ptrs, mask=col_mask, other=0.0).to(tl.float32)
    grad = grad + weight_decay * old
    if OPTIMIZER == 0:
        new = old - learning_rate * grad
    elif OPTIMIZER == 1:
        state_ptr_row = state_ptr + tl.load(row_state_index_ptr + row)
        accumulated = tl.load(state_ptr_row) + tl.sum(grad * grad, axis=0) / dim.to(tl.float32)
        tl.store(state_ptr_row, accumulated)
        new = old - learning_rate * grad / (tl.sqrt(accumulated) + eps)
    else:
        state_ptrs = state_ptr + weight_offset + cols
        accumulated = tl.load(state_ptrs, mask=col_mask, other=0.0) + grad * grad
        tl.store(state_ptrs, accumulated, mask=col_mask)
        new = old - learning_rate * grad / (tl.sqrt(accumulated) + eps)
    stored = _round_for_storage(
        new, weight_offset + cols, seed, weights_ptr.dtype.element_ty, BF16, STOCHASTIC
    )
    tl.store(weight_ptrs, stored, mask=col_mask)


def _next_power_of_2(value: int) -> int:
    return 1 << max(0, int(value) - 1).bit_length()


def _block_shape(max_dim: int, max_block_d: int, tile_elements: int) -> tuple:
    block_d = min(_next_power_of_2(max(max_dim, 1)), max_block_d)
    block_l = max(1, min(32, tile_elements // block_d))
    return block_l, block_d


def tbe_forward(
    weights: torch.Tensor,
    layout: TableBatchedLayout,
    indices: torch.Tensor,
    bag_offsets: torch.Tensor,
    batch_size: int,
    per_value_weights: Optional[torch.Tensor] = None,
    *,
    check_ids: bool = True,
) -> torch.Tensor:
    """Pooled lookup of all features' bags in one launch.

    weights: [>= layout.total_elements] fp32/fp16/bf16, the flat table buffer.
    indices: [N] int32/int64 ids, key-major (KeyedJaggedTensor values).
    bag_offsets: [F * batch_size + 1] int32/int64 start of each bag in ``indices``.
    per_value_weights: [N] float or None.
    check_ids: verify offsets and that every id is inside its table (one device sync).
    Returns [batch_size, layout.total_cols] fp32.
    """
    check_batch(layout, weights, indices, bag_offsets, batch_size, per_value_weights, check_ids)
    output = torch.empty(batch_size, layout.total_cols, dtype=torch.float32, device=weights.device)
    num_bags = layout.num_features * batch_size
    if num_bags == 0 or layout.total_cols == 0:
        return output
    block_l, block_d = _block_shape(layout.max_dim, 128, 2048)
    grid = (num_bags, triton.cdiv(layout.max_dim, block_d))
    has_weights = per_value_weights is not None
    with launch_device(weights):
        _pooled_forward_kernel[grid](
            weights, indices.contiguous(), bag_offsets.contiguous(),
            per_value_weights.contiguous() if has_weights else indices,
            layout.table_offsets, layout.table_dims, layout.table_rows,
            layout.feature_table, layout.feature_pooling_mean, layout.output_col_offsets,
            output, batch_size, layout.total_cols,
            HAS_WEIGHTS=has_weights, BLOCK_L=block_l, BLOCK_D=block_d,
            num_warps=4 if block_d >= 64 else 2,
        )
    return output


def tbe_backward_update(
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
    stochastic_rounding: bool = True,
    check_ids: bool = True,
    segments: Optional[RowSegments] = None,
    max_segment_values: int = 2048,
) -> RowSegments:
    """Backward of ``tbe_forward`` fused with the optimizer step; updates ``weights`` (and
    ``state``) in place for the rows the batch touched and returns the row segments used.

    kind: "sgd", "rowwise_adagrad" or "adagrad".
    state: fp32 contiguous, [layout.total_rows] (row-wise AdaGrad), [>= layout.total_elements]
        (AdaGrad), None (SGD).
    grad_output: [batch_size, layout.total_cols], gradient of the forward output (made fp32).
    seed: Philox seed of stochastic rounding; pass a new one every step (e.g. base + step).
    stochastic_rounding: for fp16/bf16 weights; fp32 weights are always stored exactly.
    segments: a ``build_row_segments`` result for this batch to reuse (else built here).
    max_segment_values: rows with more values than this get their gradient summed in chunks by
        extra programs first (hot ids); any value gives the same result up to fp32 rounding.
    """
    check_optimizer_kind(kind)
    check_batch(layout, weights, indices, bag_offsets, batch_size, per_value_weights, check_ids)
    if grad_output.shape != (batch_size, layout.total_cols):
        raise ValueError(
            f"grad_output must be [{batch_size}, {layout.total_cols}], got {tuple(grad_output.shape)}"
        )
    if kind != "sgd":
        needed = layout.state_size(kind)
        if state is None or state.dtype != torch.float32 or state.dim() != 1 or state.numel() < needed:
            raise ValueError(f"{kind} needs a 1-D fp32 state of >= {needed} elements, got "
                             f"{None if state is None else (tuple(state.shape), state.dtype)}")
        if not state.is_contiguous() or state.device != weights.device:
            raise ValueError(f"{kind} state must be contiguous and on {weights.device}")
    if not learning_rate > 0:
        raise ValueError(f"learning_rate must be > 0, got {learning_rate}")
    if segments is None:
        segments = build_row_segments(
            layout, indices, bag_offsets, batch_size, per_value_weights, max_segment_values
        )
    if segments.num_rows == 0:
        return segments
    grad_output = grad_output.to(torch.float32).contiguous()
    block_l, block_d = _block_shape(layout.max_dim, 1 << 30, 4096)
    num_warps = 4 if block_d <= 256 else 8
    partials = grad_output  # placeholder pointer when no row is long
    if segments.num_chunks:
        partials = torch.empty(segments.num_chunks, block_d, dtype=torch.float32, device=weights.device)
        with launch_device(weights):
            _chunk_partial_kernel[(segments.num_chunks,)](
                grad_output, segments.sorted_grad_offsets, segments.sorted_scales,
                segments.chunk_value_starts, segments.chunk_value_ends, segments.chunk_dims,
                partials, block_d, BLOCK_L=block_l, BLOCK_D=block_d, num_warps=num_warps,
            )
    stochastic = bool(stochastic_rounding) and weights.dtype != torch.float32
    with launch_device(weights):
        _fused_backward_update_kernel[(segments.num_rows,)](
            weights, state if state is not None else grad_output, grad_output,
            segments.value_starts, segments.value_ends,
            segments.partial_starts if segments.num_chunks else segments.value_starts,
            segments.partial_ends if segments.num_chunks else segments.value_ends,
            partials, block_d,
            segments.row_weight_offsets, segments.row_dims, segments.row_state_index,
            segments.sorted_grad_offsets, segments.sorted_scales,
            float(learning_rate), float(eps), float(weight_decay), int(seed) & 0x7FFFFFFFFFFFFFFF,
            OPTIMIZER=_OPTIMIZER_CODES[kind], BF16=weights.dtype == torch.bfloat16,
            STOCHASTIC=stochastic, HAS_PARTIALS=segments.num_chunks > 0,
            BLOCK_L=block_l, BLOCK_D=block_d, num_warps=num_warps,
        )
    return segments
