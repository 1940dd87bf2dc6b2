"""Building table plans: one helper per sharding type, and ``default_plan``, a simple balanced plan
(table-wise, row-wise for tables larger than one rank's share): what training uses when no
``--plan`` is given (``--plan auto`` runs the cost-model planner of ``neorec/planner``).

    plan = default_plan(tables, world_size=4)
    plan = ShardingPlan({"t_a": row_wise(table_a, ranks=[0, 1]), "t_b": table_wise(table_b, rank=3),
                         "t_c": data_parallel()}, world_size=4)
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from neorec.embedding.config import TableConfig
from neorec.sharding.plan import Shard, ShardingPlan, ShardingType, TablePlan


def _even_cuts(size: int, parts: int) -> List[int]:
    """parts + 1 boundaries splitting [0, size) into near-equal non-empty ranges."""
    if not 1 <= parts <= size:
        raise ValueError(f"cannot split {size} into {parts} non-empty ranges")
    return [size * i // parts for i in range(parts + 1)]


def table_wise(table: TableConfig, rank: int) -> TablePlan:
    return TablePlan(ShardingType.TABLE_WISE, [Shard(rank, 0, table.num_embeddings, 0, table.embedding_dim)])


def row_wise(table: TableConfig, ranks: Sequence[int], node_local: bool = False) -> TablePlan:
    """Rows split evenly over ``ranks`` (in that order); TABLE_ROW_WISE with ``node_local``."""
    cuts = _even_cuts(table.num_embeddings, len(ranks))
    kind = ShardingType.TABLE_ROW_WISE if node_local else ShardingType.ROW_WISE
    return TablePlan(kind, [Shard(r, cuts[i], cuts[i + 1], 0, table.embedding_dim) for i, r in enumerate(ranks)])


def column_wise(table: TableConfig, ranks: Sequence[int], node_local: bool = False,
                widths: Optional[Sequence[int]] = None) -> TablePlan:
    """Columns split over ``ranks`` (evenly, or in the given ``widths``); TABLE_COLUMN_WISE with
    ``node_local``."""
    if widths is None:
        cuts = _even_cuts(table.embedding_dim, len(ranks))
    else:
        if len(widths) != len(ranks) or sum(widths) != table.embedding_dim or min(widths) < 1:
            raise ValueError(f"column_wise({table.name!r}): widths {list(widths)} must be positive, one per rank, "
                             f"summing to {table.embedding_dim}")
        cuts = [0]
        for w in widths:
            cuts.append(cuts[-1] + w)
    kind = ShardingType.TABLE_COLUMN_WISE if node_local else ShardingType.COLUMN_WISE
    return TablePlan(kind, [Shard(r, 0, table.num_embeddings, cuts[i], cuts[i + 1]) for i, r in enumerate(ranks)])


def data_parallel() -> TablePlan:
    return TablePlan(ShardingType.DATA_PARALLEL, [])


def default_plan(tables: Sequence[TableConfig], world_size: int, ranks_per_node: Optional[int] = None,
                 row_wise_factor: float = 1.0) -> ShardingPlan:
    """A simple balanced plan by parameter count.

    A table bigger than ``row_wise_factor`` times an even share of all parameters (total /
    world_size) is split ROW_WISE over all ranks (over fewer when it has fewer rows than ranks);
    every other table goes TABLE_WISE, largest first, to the rank with the fewest parameters so
    far (lowest rank on ties). Deterministic: every rank computes the same plan.
    """
    if world_size < 1:
        raise ValueError(f"default_plan: world_size must be >= 1, got {world_size}")
    sizes = {t.name: t.num_embeddings * t.embedding_dim for t in tables}
    share = sum(sizes.values()) / world_size
    load = [0.0] * world_size
    plans: Dict[str, TablePlan] = {}
    small: List[TableConfig] = []
    for table in tables:
        if world_size > 1 and sizes[table.name] > row_wise_factor * share:
            ranks = list(range(min(world_size, table.num_embeddings)))
            plans[table.name] = row_wise(table, ranks)
            for shard in plans[table.name].shards:
                load[shard.rank] += shard.num_rows * shard.num_cols
        else:
            small.append(table)
    for table in sorted(small, key=lambda t: -sizes[t.name]):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        plans[table.name] = table_wise(table, rank)
        load[rank] += sizes[table.name]
    return ShardingPlan({t.name: plans[t.name] for t in tables}, world_size, ranks_per_node)
