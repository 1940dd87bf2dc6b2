"""Static routing of a sharding plan: which shard tables each rank holds and which output columns
each of them fills. Built once per collection; plain data, the same on every rank.

Every model-parallel piece (a TABLE_WISE table, a ROW_WISE row block, a COLUMN_WISE column block,
and the TABLE_ROW_WISE / TABLE_COLUMN_WISE pieces) becomes a "shard table": a ``TableConfig``
named ``<table>@<shard index>`` with the shard's rows and columns and one "shard feature"
``<feature>@<shard index>`` per feature of the table. A rank looks up all its shard tables, and
its replicas of the DATA_PARALLEL tables, in one fused ``TableBatchedEmbeddingBags``.

Shard tables pool with "sum": mean pooling is turned into per-value weights 1 / len(bag) on the
sending rank, before row-wise bucketizing, so that row-wise partial sums add up to the mean.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence

from neorec.embedding.config import TableConfig
from neorec.embedding.layout import validate_tables
from neorec.planner.names import TIERS
from neorec.sharding.plan import Shard, ShardingPlan, ShardingType

SEPARATOR = "@"


@dataclass
class ShardTable:
    """One model-parallel piece of ``table``, held by ``shard.rank``."""

    table: TableConfig
    kind: ShardingType
    index: int  # position among the table's shards in the plan
    shard: Shard
    config: TableConfig  # the piece as a table of its own

    @property
    def keys(self) -> List[str]:
        """Shard features, in the table's feature order."""
        return self.config.feature_names


@dataclass
class FeatureRoute:
    """How one input feature of a model-parallel table is sent: to every piece of its table;
    ``row_cuts`` are the row starts of the pieces (plus the end) when the table is split by rows,
    else None (every piece gets all ids)."""

    feature: str
    table: TableConfig
    pieces: List[ShardTable]
    row_cuts: List[int] | None


class Routing:
    """Everything the sharded collection needs to know about the plan, for ``world_size`` ranks.

    Attributes:
        feature_names / feature_dims: output keys and widths (table order, then feature order),
            as ``EmbeddingBagCollection``.
        shards_on[r]: the shard tables of rank r, in plan order (tables order, then shard index).
        keys_on[r]: rank r's shard features in that order (its part of the received batch).
        dims_on[r]: width of rank r's pooled model-parallel output (sum of its shard-feature widths).
        routes: one FeatureRoute per model-parallel feature, in output order.
        replicas: the DATA_PARALLEL tables (features keep their names and the table's pooling).
        columns: [total of dims_on + replica feature widths] output column of every received
            column, in (rank 0 .. W-1, then replicas) order.
        additive: some columns receive several partial sums (row-wise pieces).
    """

    def __init__(self, tables: Sequence[TableConfig], plan: ShardingPlan, world_size: int) -> None:
        self.tables = validate_tables(list(tables))
        plan.validate(self.tables, world_size, tiers=TIERS)  # the collection places the tiers (its locations)
        self.world_size = world_size
        self.feature_names = [f for t in self.tables for f in t.feature_names]
        self.feature_dims = [t.embedding_dim for t in self.tables for _ in t.feature_names]
        offsets: Dict[str, int] = {}
        column = 0
        for name, dim in zip(self.feature_names, self.feature_dims):
            offsets[name] = column
            column += dim
        self.total_dim = column

        self.shards_on: List[List[ShardTable]] = [[] for _ in range(world_size)]
        self.routes: List[FeatureRoute] = []
        self.replicas: List[TableConfig] = []
        self.additive = False
        for table in self.tables:
            entry = plan.tables[table.name]
            if entry.sharding_type == ShardingType.DATA_PARALLEL:
                self.replicas.append(table)
                continue
            pieces = [self._piece(table, entry.sharding_type, i, s) for i, s in enumerate(entry.shards)]
            for piece in pieces:
                self.shards_on[piece.shard.rank].append(piece)
            row_cuts = None
            if entry.sharding_type.splits_rows:
                pieces = sorted(pieces, key=lambda p: p.shard.row_start)
                row_cuts = [p.shard.row_start for p in pieces] + [table.num_embeddings]
                self.additive = self.additive or len(pieces) > 1
            for feature in table.feature_names:
                self.routes.append(FeatureRoute(feature, table, pieces, row_cuts))
        self.keys_on = [[k for piece in shards for k in piece.keys] for shards in self.shards_on]
        self.dims_on = [sum(p.shard.num_cols * len(p.keys) for p in shards) for shards in self.shards_on]
        self.replica_features = [f for t in self.replicas for f in t.feature_names]
        self.replica_dim = sum(t.embedding_dim * len(t.feature_names) for t in self.replicas)
        columns: List[int] = []
        for shards in self.shards_on:
            for piece in shards:
                for feature in piece.table.feature_names:
                    start = offsets[feature] + piece.shard.col_start
                    columns.extend(range(start, start + piece.shard.num_cols))
        for table in self.replicas:
            for feature in table.feature_names:
                columns.extend(range(offsets[feature], offsets[feature] + table.embedding_dim))
        self.columns = columns
        assert self.additive or sorted(columns) == list(range(self.total_dim))

    @staticmethod
    def _piece(table: TableConfig, kind: ShardingType, index: int, shard: Shard) -> ShardTable:
        suffix = f"{SEPARATOR}{index}"
        config = TableConfig(name=table.name + suffix, num_embeddings=shard.num_rows, embedding_dim=shard.num_cols,
                             feature_names=[f + suffix for f in table.feature_names], pooling="sum")
        return ShardTable(table, kind, index, shard, config)

    def local_tables(self, rank: int) -> List[TableConfig]:
        """The tables of rank ``rank``'s fused module: its shard tables, then the replicas."""
        return [p.config for p in self.shards_on[rank]] + list(self.replicas)

    @property
    def has_mean(self) -> bool:
        """Some model-parallel table pools with "mean" (its ids then travel with weights)."""
        return any(r.table.pooling == "mean" for r in self.routes)
