"""Where each table lives in the flat buffer of a ``TableBatchedEmbeddingBags``, and the per-batch
preparation of a lookup (features of one dim group -> shifted row ids, offsets, sample weights).

Layout: tables sorted by embedding_dim (stable), row-major, back to back. The tables of one dim
form a ``DimGroup``: a [num_rows, dim] view starting at ``element_start``. Rows are numbered in the
same order (``row_start`` is the group's first row among all rows, used by row-wise state).

Inside a forward, features are visited group by group ("internal order": feature_names sorted by
their group, stable), so one group's ids are one contiguous slice of the (permuted) KJT values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from neorec.embedding.config import TableConfig
from neorec.sparse.jagged import KeyedJaggedTensor


@dataclass
class DimGroup:
    """The tables of one embedding dim. Local features are this group's features in internal
    order; ``runs`` are maximal spans of them whose output columns are adjacent:
    (first local feature, end local feature, first output column)."""

    dim: int
    table_indices: List[int]
    row_start: int
    num_rows: int
    element_start: int
    feature_begin: int  # position of the group's first feature in internal order
    feature_row_offsets: List[int]
    feature_num_rows: List[int]
    feature_is_mean: List[bool]
    runs: List[Tuple[int, int, int]]
    _device_tensors: Dict[str, Dict[str, torch.Tensor]] = field(default_factory=dict, repr=False)

    @property
    def num_tables(self) -> int:
        return len(self.table_indices)

    @property
    def num_features(self) -> int:
        return len(self.feature_row_offsets)

    @property
    def element_end(self) -> int:
        return self.element_start + self.num_rows * self.dim

    def covers_output(self, total_dim: int) -> bool:
        """True when this group alone makes up the whole output, features in output order."""
        return self.runs == [(0, self.num_features, 0)] and self.num_features * self.dim == total_dim

    def tensors(self, device: torch.device) -> Dict[str, torch.Tensor]:
        """Per-feature constants on ``device`` (cached): row_offsets, num_rows, mean, arange."""
        key = str(device)
        if key not in self._device_tensors:
            self._device_tensors[key] = {
                "row_offsets": torch.tensor(self.feature_row_offsets, dtype=torch.int64, device=device),
                "num_rows": torch.tensor(self.feature_num_rows, dtype=torch.int64, device=device),
                "mean": torch.tensor(self.feature_is_mean, dtype=torch.bool, device=device),
                "arange": torch.arange(self.num_features, dtype=torch.int64, device=device),
            }
        return self._device_tensors[key]


@dataclass
class TableLayout:
    tables: List[TableConfig]
    feature_names: List[str]  # output order: table order, then feature order within a table
    feature_dims: List[int]
    feature_tables: List[int]
    internal_keys: List[str]  # feature_names reordered group by group
    table_offsets: List[int]
    table_row_offset_in_group: List[int]
    table_group: List[int]
    groups: List[DimGroup]
    num_rows: int
    num_elements: int
    total_dim: int


def validate_tables(tables: Sequence[TableConfig]) -> List[TableConfig]:
    """Check a table list: TableConfig items, unique names, each feature in exactly one table."""
    if isinstance(tables, TableConfig) or not isinstance(tables, (list, tuple)):
        raise TypeError(f"tables must be a list of TableConfig, got {type(tables).__name__}")
    if not tables:
        raise ValueError("tables must not be empty")
    owner: Dict[str, str] = {}
    names = set()
    for table in tables:
        if not isinstance(table, TableConfig):
            raise TypeError(f"tables must hold TableConfig, got {type(table).__name__}")
        if table.name in names:
            raise ValueError(f"table name {table.name!r} appears more than once")
        names.add(table.name)
        for feature in table.feature_names:
            if feature in owner:
                where = "twice in that table" if owner[feature] == table.name else f"also in table {owner[feature]!r}"
                raise ValueError(f"feature {feature!r} of table {table.name!r} is {where}; a feature maps to one table")
            owner[feature] = table.name
    return list(tables)


def build_layout(tables: Sequence[TableConfig]) -> TableLayout:
    tables = validate_tables(tables)
    num_tables = len(tables)
    table_offsets = [0] * num_tables
    row_in_group = [0] * num_tables
    table_group = [0] * num_tables
    feature_names = [f for t in tables for f in t.feature_names]
    feature_tables = [i for i, t in enumerate(tables) for _ in t.feature_names]
    feature_dims = [tables[i].embedding_dim for i in feature_tables]
    columns = [0]
    for dim in feature_dims:
        columns.append(columns[-1] + dim)

    groups: List[DimGroup] = []
    internal: List[int] = []
    element, row = 0, 0
    for group_index, dim in enumerate(sorted({t.embedding_dim for t in tables})):
        members = [i for i in range(num_tables) if tables[i].embedding_dim == dim]
        local = 0
        for i in members:
            table_offsets[i], row_in_group[i], table_group[i] = element + local * dim, local, group_index
            local += tables[i].num_embeddings
        features = [f for f in range(len(feature_names)) if feature_dims[f] == dim]
        runs: List[Tuple[int, int, int]] = []
        for position, f in enumerate(features):
            if runs and features[position - 1] == f - 1:
                runs[-1] = (runs[-1][0], position + 1, runs[-1][2])
            else:
                runs.append((position, position + 1, columns[f]))
        groups.append(
            DimGroup(
                dim=dim,
                table_indices=members,
                row_start=row,
                num_rows=local,
                element_start=element,
                feature_begin=len(internal),
                feature_row_offsets=[row_in_group[feature_tables[f]] for f in features],
                feature_num_rows=[tables[feature_tables[f]].num_embeddings for f in features],
                feature_is_mean=[tables[feature_tables[f]].pooling == "mean" for f in features],
                runs=runs,
            )
        )
        internal.extend(features)
        element += local * dim
        row += local
    return TableLayout(
        tables=list(tables),
        feature_names=feature_names,
        feature_dims=feature_dims,
        feature_tables=feature_tables,
        internal_keys=[feature_names[f] for f in internal],
        table_offsets=table_offsets,
        table_row_offset_in_group=row_in_group,
        table_group=table_group,
        groups=groups,
        num_rows=row,
        num_elements=element,
        total_dim=columns[-1],
    )


class GroupLookup:
    """One dim group's share of a batch, ready for ``F.embedding_bag`` over the group view.

    rows: [N] group-local row ids (int32 when the group has < 2^31 rows, else int64).
    offsets: [F_g * B + 1] bag starts (same dtype as rows), bags key-major (feature, sample).
    lengths: [F_g * B] ids per bag.
    weights: [N] fp32 per-value weights (KJT weights times 1/len for mean pooling) or None.
    After ``sort()``: permutation [N] (stable order by row), unique [U] rows, segment_starts [U]
    int64 (start of each unique row's run in sorted order), counts [U]; unique is int64.
    """

    def __init__(self, group: int, num_features: int, rows, offsets, lengths, weights) -> None:
        self.group = group
        self.num_features = num_features
        self.rows: torch.Tensor = rows
        self.offsets: torch.Tensor = offsets
        self.lengths: torch.Tensor = lengths
        self.weights: Optional[torch.Tensor] = weights
        self.num_values = rows.numel()
        self.permutation: Optional[torch.Tensor] = None

    def sort(self) -> None:
        if self.permutation is not None:
            return
        sorted_rows, self.permutation = torch.sort(self.rows, stable=True)
        unique, self.counts = torch.unique_consecutive(sorted_rows, return_counts=True)
        self.unique = unique.long()  # index_copy_ wants int64 indices
        self.segment_starts = self.counts.cumsum(0).sub_(self.counts)

    def inverse(self) -> torch.Tensor:
        """[N] position of each value's row in ``unique`` (dtype of ``rows``)."""
        self.sort()
        segment = torch.repeat_interleave(
            torch.arange(self.unique.numel(), device=self.rows.device, dtype=self.rows.dtype),
            self.counts, output_size=self.num_values,
        )
        return torch.empty_like(segment).index_put_((self.permutation,), segment)

    def batch_major_bags(self, batch_size: int) -> torch.Tensor:
        """[N] for each value (key-major order) the row ``b * F_g + f`` of its bag in the
        [B * F_g, dim] view of the output gradient."""
        samples = torch.arange(batch_size, device=self.rows.device).mul_(self.num_features)
        features = torch.arange(self.num_features, device=self.rows.device)
        bag_rows = (samples.unsqueeze(0) + features.unsqueeze(1)).reshape(-1)  # key-major bags
        return torch.repeat_interleave(bag_rows, self.lengths, output_size=self.num_values)


def prepare_lookups(layout: TableLayout, features: KeyedJaggedTensor, device: torch.device) -> List[GroupLookup]:
    """Split ``features`` by dim group, validate ids and shift them to group rows."""
    if not isinstance(features, KeyedJaggedTensor):
        raise TypeError(f"expected a KeyedJaggedTensor, got {type(features).__name__}")
    keys = features.keys()
    if keys != layout.internal_keys:
        position = {k: i for i, k in enumerate(keys)}
        missing = [k for k in layout.internal_keys if k not in position]
        if missing:
            raise ValueError(
                f"KeyedJaggedTensor lacks features {missing}; expected all of {layout.feature_names} "
                f"(got keys {keys})"
            )
        features = features.permute([position[k] for k in layout.internal_keys])
    batch_size = features.batch_size
    values, lengths, sample_weights = features.values, features.lengths, features.weights
    if values.device != device:
        raise ValueError(f"KeyedJaggedTensor is on {values.device}, the embedding tables on {device}")
    value_starts = features.offset_per_key()
    lookups = []
    for group_index, group in enumerate(layout.groups):
        first, count = group.feature_begin, group.num_features
        lo, hi = value_starts[first], value_starts[first + count]
        group_values = values[lo:hi]
        group_lengths = lengths[first * batch_size : (first + count) * batch_size]
        consts = group.tensors(device)
        index_dtype = torch.int32 if group.num_rows < 2**31 else torch.int64
        per_feature = torch.tensor(
            [value_starts[first + i + 1] - value_starts[first + i] for i in range(count)], device=device
        )
        feature_of_value = torch.repeat_interleave(consts["arange"], per_feature, output_size=hi - lo)
        limit = consts["num_rows"][feature_of_value]
        bad = group_values.lt(0).logical_or_(group_values.ge(limit))
        if bool(bad.any()):
            _raise_bad_id(layout, first, group_values, feature_of_value, bad)
        rows = group_values.add(consts["row_offsets"][feature_of_value]).to(index_dtype)
        offsets = torch.zeros(count * batch_size + 1, dtype=index_dtype, device=device)
        torch.cumsum(group_lengths, 0, out=offsets[1:])
        weights = None
        if sample_weights is not None:
            weights = sample_weights[lo:hi].to(torch.float32)
        if any(group.feature_is_mean):
            bag_scale = group_lengths.clamp(min=1).to(torch.float32).reciprocal_()
            bag_scale = torch.where(consts["mean"].repeat_interleave(batch_size), bag_scale, 1.0)
            value_scale = torch.repeat_interleave(bag_scale, group_lengths, output_size=hi - lo)
            weights = value_scale if weights is None else weights * value_scale
        lookups.append(GroupLookup(group_index, count, rows, offsets, group_lengths, weights))
    return lookups


def _raise_bad_id(layout: TableLayout, first: int, values, feature_of_value, bad) -> None:
    position = int(bad.nonzero()[0, 0])
    feature = layout.internal_keys[first + int(feature_of_value[position])]
    table = layout.tables[layout.feature_tables[layout.feature_names.index(feature)]]
    raise ValueError(
        f"feature {feature!r} (table {table.name!r}): id {int(values[position])} is outside "
        f"the table's rows [0, {table.num_embeddings})"
    )
