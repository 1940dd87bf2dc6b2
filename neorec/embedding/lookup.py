"""Per-batch preparation of a table-batched lookup: the ids of one dim group, validated, shifted to
rows of the group's [num_rows, dim] view, with bag offsets and per-value weights; and the stable
sort by row that the fused backward (and the fp16/bf16 forward) needs.

Bag order. Key-major bags (feature, sample), as in the KeyedJaggedTensor, visit one table at a
time (good cache locality when bags are long) but the pooled [F_g * B, dim] output must then be
transposed into the [B, F_g * dim] result. Batch-major bags (sample, feature) produce the result
directly; they cost a gather of the ids and lose some locality. Batch-major is used when the mean
bag length is at most ``BATCH_MAJOR_MAX_POOLING`` (the copy then dominates).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np
import torch

from neorec.embedding.layout import DimGroup, TableLayout
from neorec.embedding.path_common import check_lookup_input
from neorec.sparse.jagged import KeyedJaggedTensor

BATCH_MAJOR_MAX_POOLING = 2.0


def stable_sort_rows(rows: torch.Tensor, num_rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Stable sort of ``rows`` [N] (values in [0, num_rows)) -> (sorted rows [N] int64,
    permutation [N] int64).

    On CPU the key ``row << bits | position`` is unique, so any sort of it is the stable order;
    NumPy's (vectorised, single-threaded) sort of int64 keys is several times faster than
    ``torch.sort(stable=True)`` here and does not degrade when another process holds a core.
    """
    count = rows.numel()
    position_bits = max(1, (count - 1).bit_length())
    if rows.device.type != "cpu" or count == 0 or max(1, num_rows - 1).bit_length() + position_bits > 62:
        sorted_rows, permutation = torch.sort(rows, stable=True)
        return sorted_rows.long(), permutation
    keys = rows.numpy().astype(np.int64)
    np.left_shift(keys, position_bits, out=keys)
    keys |= np.arange(count, dtype=np.int64)
    keys.sort()
    keys = torch.from_numpy(keys)
    return keys >> position_bits, keys.bitwise_and_((1 << position_bits) - 1)


class GroupLookup:
    """One dim group's share of a batch, ready for ``F.embedding_bag`` over the group view.

    rows: [N] group-local row ids, bag by bag (int32 when the group has < 2^31 rows, else int64).
    offsets: [num_bags + 1] bag starts (dtype of rows); num_bags = F_g * B.
    lengths: [num_bags] ids per bag.
    weights: [N] fp32 per-value weights (KJT weights times 1/len for mean pooling) or None.
    batch_major: bag ``b * F_g + f`` is (sample b, feature f); otherwise bag ``f * B + b``.
    key_major_index: with ``batch_major``, [N] each value's position in the key-major order (the
    KeyedJaggedTensor's).
    After ``sort()``: permutation [N] int64 (by row; within a row in key-major order, whatever the
    layout, so that a row's gradient parts add up in one order: the layout is chosen per dim group,
    and moving tables between modules, "dram" tables to the host one, changed it), unique [U] int64 rows,
    counts [U], segment_starts [U] (start of each unique row's run in sorted order;
    ``position_dtype``: int32 unless there are 2^31 values or bags).
    """

    def __init__(self, group: DimGroup, group_index: int, batch_size: int, batch_major: bool,
                 rows: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor,
                 weights: Optional[torch.Tensor], key_major_index: Optional[torch.Tensor] = None) -> None:
        self.group, self.group_index = group, group_index
        self.key_major_index = key_major_index
        self.batch_size, self.batch_major = batch_size, batch_major
        self.rows, self.offsets, self.lengths, self.weights = rows, offsets, lengths, weights
        self.num_values = rows.numel()
        # dtype of value positions and bag ids in the backward (int32 is the fast embedding_bag path)
        self.position_dtype = torch.int32 if max(self.num_values, lengths.numel()) < 2**31 else torch.int64
        self.permutation: Optional[torch.Tensor] = None

    def sort(self) -> None:
        if self.permutation is not None:
            return
        if self.key_major_index is None:
            sorted_rows, self.permutation = stable_sort_rows(self.rows, self.group.num_rows)
        else:  # sort the key-major rows, then name each value by its position here (batch-major)
            key_major_rows = torch.empty_like(self.rows).index_put_((self.key_major_index,), self.rows)
            sorted_rows, by_key = stable_sort_rows(key_major_rows, self.group.num_rows)
            position = torch.empty_like(self.key_major_index).index_put_(
                (self.key_major_index,), torch.arange(self.num_values, device=self.rows.device,
                                                      dtype=self.key_major_index.dtype))
            self.permutation = position.index_select(0, by_key).long()
        self.unique, self.counts = torch.unique_consecutive(sorted_rows, return_counts=True)
        self.segment_starts = self.counts.cumsum(0).sub_(self.counts).to(self.position_dtype)

    def inverse(self) -> torch.Tensor:
        """[N] position of each value's row in ``unique`` (dtype of ``rows``)."""
        self.sort()
        segment = torch.repeat_interleave(
            torch.arange(self.unique.numel(), device=self.rows.device, dtype=self.rows.dtype),
            self.counts, output_size=self.num_values,
        )
        return torch.empty_like(segment).index_put_((self.permutation,), segment)

    def bags(self) -> torch.Tensor:
        """[N] row of the [B * F_g, dim] output gradient (row ``b * F_g + f``) that each value's
        bag feeds (``position_dtype``)."""
        count, device, dtype = self.group.num_features, self.rows.device, self.position_dtype
        if self.batch_major:
            bag_rows = torch.arange(count * self.batch_size, device=device, dtype=dtype)
        else:
            samples = torch.arange(self.batch_size, device=device, dtype=dtype).mul_(count)
            bag_rows = (samples.unsqueeze(0) + torch.arange(count, device=device, dtype=dtype).unsqueeze(1)).view(-1)
        return torch.repeat_interleave(bag_rows, self.lengths, output_size=self.num_values)


def select_features(layout: TableLayout, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """``features`` with exactly ``layout.internal_keys``, in that order (no copy when already so)."""
    if not isinstance(features, KeyedJaggedTensor):
        raise TypeError(f"expected a KeyedJaggedTensor, got {type(features).__name__}")
    keys = features.keys()
    if keys == layout.internal_keys:
        return features
    position = {k: i for i, k in enumerate(keys)}
    missing = [k for k in layout.internal_keys if k not in position]
    if missing:
        raise ValueError(
            f"KeyedJaggedTensor lacks features {missing}; expected all of {layout.feature_names} (got keys {keys})"
        )
    return features.permute([position[k] for k in layout.internal_keys])


def prepare_lookups(layout: TableLayout, features: KeyedJaggedTensor, device: torch.device) -> List[GroupLookup]:
    """Split ``features`` by dim group; validate the ids; shift them to group rows."""
    if isinstance(features, KeyedJaggedTensor) and features.keys() != layout.internal_keys:
        check_lookup_input(features)  # before dropping keys: their bad lengths would shift the kept ids
    features = select_features(layout, features)
    if features.values.device != device:
        raise ValueError(f"KeyedJaggedTensor is on {features.values.device}, the embedding tables on {device}")
    check_lookup_input(features, check_sum=False)
    value_starts = features.offset_per_key()
    if value_starts[-1] != features.values.numel():  # (on a GPU too: the offsets are at hand)
        raise ValueError(f"KeyedJaggedTensor: its lengths sum to {value_starts[-1]} but it holds "
                         f"{features.values.numel()} values")
    return [_prepare_group(layout, g, i, features, value_starts) for i, g in enumerate(layout.groups)]


def index_dtype_for(num_rows: int, num_values: int) -> torch.dtype:
    """int32 row indices and bag offsets where both fit (half the bytes), else int64: the offsets
    count values, so a batch of 2^31 ids or more needs int64 even for a small table."""
    return torch.int32 if max(num_rows, num_values) < 2**31 else torch.int64


def _prepare_group(layout: TableLayout, group: DimGroup, group_index: int, features: KeyedJaggedTensor,
                   value_starts: List[int]) -> GroupLookup:
    batch_size, first, count = features.batch_size, group.feature_begin, group.num_features
    lo, hi = value_starts[first], value_starts[first + count]
    num_values, num_bags = hi - lo, count * batch_size
    device = features.values.device
    consts = group.tensors(device)
    index_dtype = index_dtype_for(group.num_rows, num_values)
    values = features.values[lo:hi]
    lengths = features.lengths[first * batch_size : (first + count) * batch_size]

    # validate and shift, feature by feature (key-major: each feature's ids are contiguous)
    if count == 1:
        limit, shift = group.feature_num_rows[0], group.feature_row_offsets[0]
    else:
        per_feature = torch.tensor([value_starts[first + i + 1] - value_starts[first + i] for i in range(count)],
                                   dtype=torch.int32, device=device)
        feature_of_value = torch.repeat_interleave(consts["arange"], per_feature, output_size=num_values)
        uniform = len(set(group.feature_num_rows)) == 1
        limit = group.feature_num_rows[0] if uniform else consts["num_rows"].index_select(0, feature_of_value)
        shift = consts["row_offsets"].index_select(0, feature_of_value)
    if num_values:
        if isinstance(limit, int):  # one bound for the whole group: one pass, per-value test on failure
            low, high = values.aminmax()
            suspect = bool(low < 0) or bool(high >= limit)
        else:
            suspect = True
        if suspect:
            bad = values.lt(0).logical_or_(values.ge(limit))
            if bool(bad.any()):
                _raise_bad_id(layout, first, values, value_starts, bad)
    rows = (values + shift).to(index_dtype)

    # the backward uses them: copies, not views of the caller's tensors (an in-place change of the
    # batch's weights between forward and backward changed the update; the other paths refused it)
    weights = None if features.weights is None else features.weights[lo:hi].to(torch.float32, copy=True)
    batch_major = num_values <= BATCH_MAJOR_MAX_POOLING * num_bags
    bag_lengths = lengths.clone()
    source = None
    if batch_major:
        # gather ids bag by bag in (sample, feature) order
        by_feature = bag_lengths.view(count, batch_size)
        key_major_starts = torch.cumsum(bag_lengths, 0).sub_(bag_lengths).view(count, batch_size).t()
        bag_lengths = by_feature.t().reshape(-1)
        batch_major_starts = torch.cumsum(bag_lengths, 0).sub_(bag_lengths)
        source = torch.repeat_interleave(key_major_starts.reshape(-1) - batch_major_starts, bag_lengths,
                                         output_size=num_values)
        source += torch.arange(num_values, device=device)
        rows = rows.index_select(0, source)
        weights = None if weights is None else weights.index_select(0, source)
    offsets = torch.zeros(num_bags + 1, dtype=index_dtype, device=device)
    torch.cumsum(bag_lengths, 0, out=offsets[1:])
    if any(group.feature_is_mean):
        mean = consts["mean"].repeat(batch_size) if batch_major else consts["mean"].repeat_interleave(batch_size)
        bag_scale = torch.where(mean, bag_lengths.clamp(min=1).to(torch.float32).reciprocal_(), 1.0)
        value_scale = torch.repeat_interleave(bag_scale, bag_lengths, output_size=num_values)
        weights = value_scale if weights is None else weights * value_scale
    return GroupLookup(group, group_index, batch_size, batch_major, rows, offsets, bag_lengths, weights,
                       key_major_index=source if batch_major and count > 1 else None)  # one feature: same order


def _raise_bad_id(layout: TableLayout, first: int, values: torch.Tensor, value_starts: List[int], bad) -> None:
    position = int(bad.nonzero()[0, 0])
    index = first
    while value_starts[index + 1] - value_starts[first] <= position:
        index += 1
    feature = layout.internal_keys[index]
    table = layout.tables[layout.feature_tables[layout.feature_names.index(feature)]]
    raise ValueError(
        f"feature {feature!r} (table {table.name!r}): id {int(values[position])} is outside "
        f"the table's rows [0, {table.num_embeddings})"
    )
