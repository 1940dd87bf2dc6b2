"""Shared pieces of the distributed tests: tiny tables, plans of every sharding type, global batches
(with empty bags, a feature with no ids on some ranks, uneven last batches), the models and the
single-process references."""

from __future__ import annotations

from typing import Dict, List

import torch
from torch import nn

from neorec.data.batch import Batch
from neorec.embedding import EmbeddingBagCollection, SparseOptimizerConfig, TableConfig
from neorec.model import DLRM
from neorec.sharding import ShardingPlan, ShardingType, column_wise, data_parallel, row_wise, table_wise
from neorec.sparse import KeyedJaggedTensor, KeyedTensor

NUM_DENSE = 3
LOCAL_BATCH = 4
KINDS = ["table_wise", "row_wise", "column_wise", "data_parallel", "table_row_wise", "table_column_wise", "mixed"]


def make_tables() -> List[TableConfig]:
    """Mixed dims (4, 8, 12), sum and mean pooling, one table serving two features."""
    return [
        TableConfig("t_a", 40, 8, ["f_a1", "f_a2"], pooling="sum"),
        TableConfig("t_b", 30, 4, ["f_b"], pooling="mean"),
        TableConfig("t_c", 50, 12, ["f_c"], pooling="sum"),
        TableConfig("t_d", 13, 8, ["f_d"], pooling="mean"),
    ]


def make_plan(kind: str, world: int) -> ShardingPlan:
    tables = make_tables()
    per_node = 2 if world >= 2 else 1
    nodes = world // per_node
    plans = {}
    for i, table in enumerate(tables):
        node_ranks = list(range((i % nodes) * per_node, (i % nodes + 1) * per_node))
        if kind == "table_wise":
            plans[table.name] = table_wise(table, i % 2 % world)  # ranks >= 2 hold nothing
        elif kind == "row_wise":
            plans[table.name] = row_wise(table, list(range(world)))
        elif kind == "column_wise":
            plans[table.name] = column_wise(table, list(reversed(range(world))))
        elif kind == "data_parallel":
            plans[table.name] = data_parallel()
        elif kind == "table_row_wise":
            plans[table.name] = row_wise(table, node_ranks, node_local=True)
        elif kind == "table_column_wise":
            plans[table.name] = column_wise(table, node_ranks, node_local=True)
        elif kind == "mixed":
            plans[table.name] = [
                row_wise(table, node_ranks, node_local=True) if world > 2 else row_wise(table, list(range(world))),
                column_wise(table, list(range(world))),
                table_wise(table, world - 1),
                data_parallel(),
            ][i]
        else:
            raise ValueError(kind)
    return ShardingPlan(plans, world, per_node)


def global_batch(step: int, size: int, weighted: bool = False) -> Batch:
    """A global batch of ``size`` samples; keys in an order different from the tables'. Bags may
    be empty; feature f_c has no id at all in the first half of the batch."""
    tables = make_tables()
    generator = torch.Generator().manual_seed(1000 + step)
    rows = {f: t.num_embeddings for t in tables for f in t.feature_names}
    keys = list(reversed(list(rows)))
    lengths = torch.randint(0, 4, (len(keys), size), generator=generator)
    lengths[keys.index("f_c"), : size // 2] = 0
    values = torch.cat([torch.randint(0, rows[k], (int(lengths[i].sum()),), generator=generator)
                        for i, k in enumerate(keys)])
    weights = torch.rand(values.numel(), generator=generator) + 0.5 if weighted else None
    sparse = KeyedJaggedTensor(keys, values, lengths.reshape(-1), weights, batch_size=size)
    dense = torch.randn(size, NUM_DENSE, generator=generator)
    labels = torch.randint(0, 2, (size,), generator=generator).float()
    return Batch(dense, sparse, labels)


def batch_sizes(world: int) -> List[int]:
    """Global batch sizes of the steps: full, full, uneven, and one smaller than the world."""
    return [world * LOCAL_BATCH, world * LOCAL_BATCH, world * LOCAL_BATCH - 3, 1]


class PieceSplitCollection(nn.Module):
    """Single-process reference for column pieces under row-wise AdaGrad: every column-split table
    is cut into per-piece tables (so the row statistic is per piece), outputs put back in order."""

    def __init__(self, tables: List[TableConfig], plan: ShardingPlan, optimizer: SparseOptimizerConfig,
                 source: EmbeddingBagCollection) -> None:
        super().__init__()
        self.tables = tables
        self.pieces: Dict[str, List] = {}
        inner, key_map, column_map = [], [], []
        offset = {}
        column = 0
        for t in tables:
            for f in t.feature_names:
                offset[f] = column
                column += t.embedding_dim
        for t in tables:
            entry = plan.tables[t.name]
            shards = sorted(entry.shards, key=lambda s: s.col_start) if entry.sharding_type.splits_columns else []
            if not shards:
                inner.append(t)
                self.pieces[t.name] = [(t.name, 0, t.embedding_dim)]
                for f in t.feature_names:
                    key_map.append((f, f))
                    column_map += list(range(offset[f], offset[f] + t.embedding_dim))
                continue
            self.pieces[t.name] = []
            for j, s in enumerate(shards):
                name = f"{t.name}#{j}"
                inner.append(TableConfig(name, t.num_embeddings, s.num_cols, [f"{f}#{j}" for f in t.feature_names],
                                         pooling=t.pooling))
                self.pieces[t.name].append((name, s.col_start, s.col_end))
            for j, s in enumerate(shards):
                for f in t.feature_names:
                    key_map.append((f"{f}#{j}", f))
                    column_map += list(range(offset[f] + s.col_start, offset[f] + s.col_end))
        self.inner = EmbeddingBagCollection(inner, optimizer)
        order = [k for t in inner for k in t.feature_names]
        source_of = dict(key_map)
        self.keys = order
        self.sources = [source_of[k] for k in order]
        inverse = torch.empty(len(column_map), dtype=torch.int64)
        inverse[torch.tensor(column_map)] = torch.arange(len(column_map))
        self.inverse = inverse
        self.feature_names = [f for t in tables for f in t.feature_names]
        self.dims = [t.embedding_dim for t in tables for _ in t.feature_names]
        for t in tables:
            self.set_full(t.name, source.tbe.get_table_weight(t.name))

    def set_full(self, name: str, weight: torch.Tensor) -> None:
        for piece, lo, hi in self.pieces[name]:
            self.inner.tbe.set_table_weight(piece, weight[:, lo:hi])

    def full(self, name: str) -> torch.Tensor:
        return torch.cat([self.inner.tbe.get_table_weight(p) for p, _, _ in self.pieces[name]], dim=1)

    def forward(self, kjt: KeyedJaggedTensor) -> KeyedTensor:
        renamed = KeyedJaggedTensor.from_dict({key: kjt[source] for key, source in zip(self.keys, self.sources)},
                                              batch_size=kjt.batch_size)
        values = self.inner(renamed).values.index_select(1, self.inverse)
        return KeyedTensor(self.feature_names, self.dims, values)


def build_model(sparse_kind: str, seed: int = 0) -> DLRM:
    torch.manual_seed(seed)
    tables = make_tables()
    collection = EmbeddingBagCollection(tables, SparseOptimizerConfig(sparse_kind, learning_rate=0.1), init_seed=seed)
    return DLRM(collection, NUM_DENSE, {f: t.embedding_dim for t in tables for f in t.feature_names},
                dense_layers=[8], over_layers=[8], interaction="dcn", dcn_num_layers=1)


def reference_table(model: DLRM, name: str) -> torch.Tensor:
    arch = model.sparse_arch
    if isinstance(arch, PieceSplitCollection):
        return arch.full(name)
    return arch.tbe.get_table_weight(name)


def needs_piece_reference(plan: ShardingPlan, sparse_kind: str) -> bool:
    return sparse_kind == "rowwise_adagrad" and any(
        e.sharding_type in (ShardingType.COLUMN_WISE, ShardingType.TABLE_COLUMN_WISE) for e in plan.tables.values())
