"""Checks of a ``ShardingPlan`` against the tables and the world (see ``plan.py`` for the rules)."""

from __future__ import annotations

from typing import List, Sequence, Tuple

from neorec.embedding.config import PRECISIONS, TableConfig
from neorec.sharding.plan import Shard, ShardingPlan, ShardingType, TablePlan


def _fail(table: str, kind: ShardingType, problem: str) -> None:
    raise ValueError(f"sharding plan: table {table!r} ({kind.value}): {problem}")


def validate_plan(plan: ShardingPlan, tables: Sequence[TableConfig], world_size: int) -> None:
    if not isinstance(plan, ShardingPlan):
        raise TypeError(f"expected a ShardingPlan, got {type(plan).__name__}")
    if world_size < 1:
        raise ValueError(f"sharding plan: world_size must be >= 1, got {world_size}")
    if plan.world_size != world_size:
        raise ValueError(f"sharding plan: written for world_size {plan.world_size}, but the world has "
                         f"{world_size} ranks; make a plan for {world_size} ranks")
    per_node = plan.ranks_per_node
    if per_node < 1 or world_size % per_node != 0:
        raise ValueError(f"sharding plan: ranks_per_node must be >= 1 and divide world_size {world_size}, "
                         f"got {per_node}")
    by_name = {t.name: t for t in tables}
    unknown = sorted(set(plan.tables) - set(by_name))
    if unknown:
        raise ValueError(f"sharding plan: unknown tables {unknown}; the model's tables are {sorted(by_name)}")
    uncovered = [t.name for t in tables if t.name not in plan.tables]
    if uncovered:
        raise ValueError(f"sharding plan: tables {uncovered} are not covered; every table needs an entry")
    for table in tables:
        _validate_table(table, plan.tables[table.name], plan, world_size)


def _validate_table(table: TableConfig, entry: TablePlan, plan: ShardingPlan, world_size: int) -> None:
    name, kind = table.name, entry.sharding_type
    rows, cols = table.num_embeddings, table.embedding_dim
    if entry.precision is not None and entry.precision not in PRECISIONS:
        _fail(name, kind, f"precision must be one of {PRECISIONS} or null, got {entry.precision!r}")
    for shard in entry.shards:
        if not isinstance(shard, Shard):
            _fail(name, kind, f"shards must be Shard objects, got {shard!r}")
        if not 0 <= shard.rank < world_size:
            _fail(name, kind, f"shard {shard.to_dict()} is on rank {shard.rank}, outside the world 0..{world_size - 1}")
        if not (0 <= shard.row_start < shard.row_end <= rows and 0 <= shard.col_start < shard.col_end <= cols):
            _fail(name, kind, f"shard {shard.to_dict()} is empty or outside the table's {rows} rows x {cols} "
                              f"columns (ranges are [start, end) with start < end)")
    full_rows = all(s.row_start == 0 and s.row_end == rows for s in entry.shards)
    full_cols = all(s.col_start == 0 and s.col_end == cols for s in entry.shards)

    if kind == ShardingType.DATA_PARALLEL:
        if entry.shards and (sorted(s.rank for s in entry.shards) != list(range(world_size))
                             or not (full_rows and full_cols)):
            _fail(name, kind, "a replicated table lists no shards, or one full-table shard on every rank")
        return
    if not entry.shards:
        _fail(name, kind, "has no shards")
    if kind == ShardingType.TABLE_WISE:
        if len(entry.shards) != 1 or not (full_rows and full_cols):
            _fail(name, kind, f"needs exactly one shard with all {rows} rows and {cols} columns, got "
                              f"{[s.to_dict() for s in entry.shards]}")
        return
    if kind.splits_rows:
        if not full_cols:
            _fail(name, kind, f"every shard must span all {cols} columns")
        _check_tiling(name, kind, "row", [(s.row_start, s.row_end) for s in entry.shards], rows)
    else:
        if not full_rows:
            _fail(name, kind, f"every shard must span all {rows} rows")
        _check_tiling(name, kind, "column", [(s.col_start, s.col_end) for s in entry.shards], cols)
    if kind in (ShardingType.TABLE_ROW_WISE, ShardingType.TABLE_COLUMN_WISE):
        nodes = sorted({plan.node_of(s.rank) for s in entry.shards})
        if len(nodes) != 1:
            _fail(name, kind, f"shards span nodes {nodes} (ranks_per_node = {plan.ranks_per_node}); all pieces of "
                              f"a table-{'row' if kind.splits_rows else 'column'}-wise table stay on one node")


def _check_tiling(name: str, kind: ShardingType, what: str, ranges: List[Tuple[int, int]], size: int) -> None:
    position = 0
    for start, end in sorted(ranges):
        if start < position:
            _fail(name, kind, f"{what} ranges overlap at {what} {start} (ranges {sorted(ranges)})")
        if start > position:
            _fail(name, kind, f"{what}s [{position}, {start}) are in no shard (ranges {sorted(ranges)})")
        position = end
    if position != size:
        _fail(name, kind, f"{what}s [{position}, {size}) are in no shard (ranges {sorted(ranges)})")
