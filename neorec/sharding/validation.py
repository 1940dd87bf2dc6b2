"""Checks of a ``ShardingPlan`` against the tables and the world (see ``plan.py`` for the rules)."""

from __future__ import annotations

from typing import List, Sequence, Tuple

from neorec.embedding.config import PRECISIONS, TableConfig
from neorec.embedding.storage import ROW_PRECISIONS
from neorec.sharding.plan import CACHED_TIERS, Shard, ShardingPlan, ShardingType, TablePlan


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
    check_plan_tables(plan, [t.name for t in tables])
    for table in tables:
        _validate_table(table, plan.tables[table.name], plan, world_size)


def check_plan_tables(plan: ShardingPlan, names: Sequence[str]) -> None:
    """The plan has one entry per table of ``names`` and no other (``validate_plan`` checks the
    rest; this part needs the table names only, known from the config before any data is read)."""
    unknown = sorted(set(plan.tables) - set(names))
    if unknown:
        raise ValueError(f"sharding plan: unknown tables {unknown}; the model's tables are {sorted(names)}")
    uncovered = [name for name in names if name not in plan.tables]
    if uncovered:
        raise ValueError(f"sharding plan: tables {uncovered} are not covered; every table needs an entry")


def check_plan_pieces(plan: ShardingPlan, world_size: int) -> None:
    """What needs no table sizes (``neorec train --nproc`` checks it before any rank starts): every
    shard on a rank of the world, no empty range, and the pieces of a row- or column-split table
    not overlapping. ``validate_plan`` checks the rest."""
    for name, entry in plan.tables.items():
        kind = entry.sharding_type
        for shard in entry.shards:
            _check_rank(name, kind, shard, world_size)
            if not (0 <= shard.row_start < shard.row_end and 0 <= shard.col_start < shard.col_end):
                _fail(name, kind, f"shard {shard.to_dict()} is empty (ranges are [start, end) with start < end)")
        if kind not in (ShardingType.DATA_PARALLEL, ShardingType.TABLE_WISE):
            what = "row" if kind.splits_rows else "column"
            ranges = [(s.row_start, s.row_end) if kind.splits_rows else (s.col_start, s.col_end) for s in entry.shards]
            _check_overlaps(name, kind, what, ranges)


def _check_rank(name: str, kind: ShardingType, shard: Shard, world_size: int) -> None:
    if not 0 <= shard.rank < world_size:
        _fail(name, kind, f"shard {shard.to_dict()} is on rank {shard.rank}, outside the world 0..{world_size - 1}")


def _check_overlaps(name: str, kind: ShardingType, what: str, ranges: List[Tuple[int, int]]) -> None:
    position = None
    for start, end in sorted(ranges):
        if position is not None and start < position:
            _fail(name, kind, f"{what} ranges overlap at {what} {start} (ranges {sorted(ranges)})")
        position = end


def check_plan_nodes(plan: ShardingPlan, ranks_per_node: int) -> None:
    """The pieces of each node-local table (table-row-wise, table-column-wise) stay on one node of
    the live world, ``ranks_per_node`` ranks per node (a plan made for larger nodes would spread
    them over several)."""
    spread = sorted(name for name, entry in plan.tables.items()
                    if entry.sharding_type in (ShardingType.TABLE_ROW_WISE, ShardingType.TABLE_COLUMN_WISE)
                    and len({s.rank // ranks_per_node for s in entry.shards}) > 1)
    if spread:
        more = f" and {len(spread) - 5} more" if len(spread) > 5 else ""
        raise ValueError(f"sharding plan: written for {plan.ranks_per_node} ranks per node, but this world has "
                         f"{ranks_per_node}: the pieces of its node-local tables {spread[:5]}{more} would be on "
                         f"several nodes; make a plan for {ranks_per_node} ranks per node")


def _validate_table(table: TableConfig, entry: TablePlan, plan: ShardingPlan, world_size: int) -> None:
    name, kind = table.name, entry.sharding_type
    rows, cols = table.num_embeddings, table.embedding_dim
    if entry.precision is not None and entry.precision not in PRECISIONS:
        if entry.precision not in ROW_PRECISIONS:
            _fail(name, kind, f"precision must be one of {ROW_PRECISIONS} or null, got {entry.precision!r}")
        if entry.tier not in CACHED_TIERS:  # (a row store's precision: int8)
            _fail(name, kind, f"precision {entry.precision!r} is a row store's, for a table on a cached tier "
                              f"{CACHED_TIERS}; on {entry.tier!r} use one of {PRECISIONS}")
    for shard in entry.shards:
        if not isinstance(shard, Shard):
            _fail(name, kind, f"shards must be Shard objects, got {shard!r}")
        _check_rank(name, kind, shard, world_size)
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
    _check_overlaps(name, kind, what, ranges)
    position = 0
    for start, end in sorted(ranges):
        if start > position:
            _fail(name, kind, f"{what}s [{position}, {start}) are in no shard (ranges {sorted(ranges)})")
        position = end
    if position != size:
        _fail(name, kind, f"{what}s [{position}, {size}) are in no shard (ranges {sorted(ranges)})")
