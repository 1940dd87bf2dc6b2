"""Where each table lives in the flat buffer of a ``TableBatchedEmbeddingBags``.

Layout: tables sorted by embedding_dim (stable), row-major, back to back. The tables of one dim
form a ``DimGroup``: a [num_rows, dim] view starting at ``element_start``. Rows are numbered in the
same order (``row_start`` is the group's first row among all rows, used by row-wise state).

Inside a forward, features are visited group by group ("internal order": feature_names sorted by
their group, stable), so one group's ids are one contiguous slice of the (permuted) KJT values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

import torch

from neorec.embedding.config import TableConfig


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
        """Per-feature constants on ``device`` (cached): row_offsets, num_rows (int64), mean (bool),
        arange (int32)."""
        key = str(device)
        if key not in self._device_tensors:
            self._device_tensors[key] = {
                "row_offsets": torch.tensor(self.feature_row_offsets, dtype=torch.int64, device=device),
                "num_rows": torch.tensor(self.feature_num_rows, dtype=torch.int64, device=device),
                "mean": torch.tensor(self.feature_is_mean, dtype=torch.bool, device=device),
                "arange": torch.arange(self.num_features, dtype=torch.int32, device=device),
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
