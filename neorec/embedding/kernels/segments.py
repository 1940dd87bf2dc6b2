"""Host side of the fused backward: group a batch's values by the embedding row they touch.

Torch ops only, on the ids' device (two or three small device-to-host reads: the value count, the
number of unique rows and of long-row chunks). Every value gets

* a global row: its table's first row in row-wise state + its id (the sort key),
* a gradient source: flat offset of its bag's slice in grad_output ``[B, total_cols]``,
* a scale: its per-value weight (1 without), divided by its bag's length under mean pooling;

a stable sort by global row makes each unique row's values one contiguous segment, in input
order. Rows with more than ``max_segment_values`` values (hot ids) are cut into chunks of that
many values whose partial sums are computed by separate programs, so one hot row does not leave a
single program summing for the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from neorec.embedding.kernels.layout import TableBatchedLayout


@dataclass
class RowSegments:
    """The batch's values grouped by row: U unique rows, N values, C chunks of long rows.

    value_starts, value_ends: [U] int64 range of sorted positions that row u's program sums itself
        (empty for long rows).
    partial_starts, partial_ends: [U] int64 range of chunk partial sums that row u adds (empty for
        short rows); None when no row is long.
    chunk_value_starts, chunk_value_ends: [C] int64 sorted positions of each chunk; None when C = 0.
    chunk_dims: [C] int32 dim of each chunk's row; None when C = 0.
    row_weight_offsets: [U] int64 first element of the row in the weight buffer.
    row_dims: [U] int32 the row's dim.
    row_state_index: [U] int64 global row (table row offset + id): its row-wise state slot.
    sorted_grad_offsets: [N] int64 flat offset into grad_output of each value's bag slice.
    sorted_scales: [N] fp32 scale of each value's gradient.
    """

    value_starts: torch.Tensor
    value_ends: torch.Tensor
    partial_starts: Optional[torch.Tensor]
    partial_ends: Optional[torch.Tensor]
    chunk_value_starts: Optional[torch.Tensor]
    chunk_value_ends: Optional[torch.Tensor]
    chunk_dims: Optional[torch.Tensor]
    row_weight_offsets: torch.Tensor
    row_dims: torch.Tensor
    row_state_index: torch.Tensor
    sorted_grad_offsets: torch.Tensor
    sorted_scales: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.row_dims.numel()

    @property
    def num_chunks(self) -> int:
        return 0 if self.chunk_dims is None else self.chunk_dims.numel()


def build_row_segments(
    layout: TableBatchedLayout,
    indices: torch.Tensor,
    bag_offsets: torch.Tensor,
    batch_size: int,
    per_value_weights: Optional[torch.Tensor] = None,
    max_segment_values: int = 2048,
) -> RowSegments:
    """Segments of the batch (``tbe_backward_update`` argument shapes); see the module doc."""
    if max_segment_values < 1:
        raise ValueError(f"max_segment_values must be >= 1, got {max_segment_values}")
    device = indices.device
    num_bags = layout.num_features * batch_size
    first, last = bag_offsets[[0, -1]].tolist()
    num_values = last - first if num_bags else 0
    ids = indices[first : first + num_values].long()
    lengths = (bag_offsets[1:] - bag_offsets[:-1]).long()
    value_bag = torch.repeat_interleave(torch.arange(num_bags, device=device), lengths, output_size=num_values)
    value_feature = value_bag // batch_size
    value_sample = value_bag - value_feature * batch_size
    value_table = layout.feature_table[value_feature].long()
    global_rows = layout.table_row_offsets[value_table] + ids
    weight_offsets = layout.table_offsets[value_table] + ids * layout.table_dims[value_table]
    grad_offsets = value_sample * layout.total_cols + layout.output_col_offsets[value_feature]
    if per_value_weights is None:
        scales = torch.ones(num_values, dtype=torch.float32, device=device)
    else:
        scales = per_value_weights[first : first + num_values].float()
    mean = layout.feature_pooling_mean[value_feature] != 0
    scales = torch.where(mean, scales / lengths[value_bag].clamp(min=1).float(), scales)

    sort_keys = global_rows.int() if layout.total_rows < 2**31 else global_rows  # 32-bit radix sort
    sorted_rows, order = torch.sort(sort_keys, stable=True)
    unique_rows, counts = torch.unique_consecutive(sorted_rows, return_counts=True)
    value_ends = torch.cumsum(counts, dim=0)
    value_starts = value_ends - counts
    first_values = order[value_starts]  # any value of the row gives its table
    row_dims = layout.table_dims[value_table[first_values]]
    segments = RowSegments(
        value_starts=value_starts,
        value_ends=value_ends,
        partial_starts=None,
        partial_ends=None,
        chunk_value_starts=None,
        chunk_value_ends=None,
        chunk_dims=None,
        row_weight_offsets=weight_offsets[first_values],
        row_dims=row_dims,
        row_state_index=unique_rows.long(),
        sorted_grad_offsets=grad_offsets[order].contiguous(),
        sorted_scales=scales[order].contiguous(),
    )
    _split_long_rows(segments, counts, max_segment_values)
    return segments


def _split_long_rows(segments: RowSegments, counts: torch.Tensor, max_values: int) -> None:
    long_rows = (counts > max_values).nonzero().squeeze(1)
    if long_rows.numel() == 0:
        return
    device = counts.device
    chunks_per_row = (counts[long_rows] + max_values - 1) // max_values
    num_chunks = int(chunks_per_row.sum())
    chunk_ends = torch.cumsum(chunks_per_row, 0)
    chunk_firsts = chunk_ends - chunks_per_row
    owner = torch.repeat_interleave(long_rows, chunks_per_row, output_size=num_chunks)
    within = torch.arange(num_chunks, device=device) - torch.repeat_interleave(
        chunk_firsts, chunks_per_row, output_size=num_chunks
    )
    starts = segments.value_starts[owner] + within * max_values
    segments.chunk_value_starts = starts
    segments.chunk_value_ends = torch.minimum(starts + max_values, segments.value_ends[owner])
    segments.chunk_dims = segments.row_dims[owner]
    segments.partial_starts = torch.zeros_like(segments.value_starts).index_copy_(0, long_rows, chunk_firsts)
    segments.partial_ends = torch.zeros_like(segments.value_starts).index_copy_(0, long_rows, chunk_ends)
    segments.value_starts = segments.value_starts.index_copy(0, long_rows, segments.value_ends[long_rows])
