"""Enumeration: every allowed way to hold one table, each with its per-piece cost and memory.

    options = enumerate_options(table, topology, settings)     # List[ShardOption]

Per tier and precision allowed (by the settings and the table's own constraints):
TABLE_WISE (one piece, any rank), ROW_WISE over all ranks, TABLE_ROW_WISE (row pieces on the
ranks of one node; only with several nodes), COLUMN_WISE into k = 2, 4, ... pieces (any distinct
ranks), TABLE_COLUMN_WISE (k column pieces inside one node), DATA_PARALLEL (a replica per rank;
device tier only: training refuses a replica in a store of every rank).
Options whose piece cannot fit an empty rank are dropped; a table left with none is an
``InfeasiblePlanError`` naming the table and the tightest limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

from neorec.planner.cost_model import STORE_ONLY_PRECISIONS, Cost, Memory, PlanSettings, TableSpec, piece_cost
from neorec.planner.topology import Topology
from neorec.sharding.plan import ShardingType

GIB = 2 ** 30
MIN_COLUMN_WIDTH = 4


class InfeasiblePlanError(ValueError):
    """No plan satisfies the limits; the message names the table and the tightest limit."""


def format_bytes(num_bytes: float) -> str:
    """Bytes for people, in the largest binary unit that keeps the number >= 1: 512 B, 1.50 MiB."""
    for unit, scale in (("TiB", 2 ** 40), ("GiB", GIB), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:,.2f} {unit}"
    return f"{num_bytes:,.0f} B"


def memory_limit(what: str, need: float, cap: float) -> str:
    """Why ``need`` bytes of a tier exceed ``cap``: "<what>: needs 1.50 GiB per rank, a rank has
    1.00 GiB", or "... the topology has none (0 bytes)" for a tier it lacks."""
    if cap <= 0:
        return f"{what}: needs {format_bytes(need)} per rank, the topology has none (0 bytes)"
    return f"{what}: needs {format_bytes(need)} per rank, a rank has {format_bytes(cap)}"


@dataclass(frozen=True)
class Capacity:
    """Bytes one rank may use per tier."""

    device: float
    host: float
    ssd: float

    @classmethod
    def of(cls, topo: Topology, settings: PlanSettings) -> "Capacity":
        per_node = topo.ranks_per_node
        host = 0.0 if topo.unified_memory else topo.host_dram_bytes / per_node  # (piece_cost counts it as device)
        return cls(topo.device_memory_bytes * (1 - settings.device_reserve_fraction), host, topo.ssd_bytes / per_node)

    def shortfall(self, memory: Memory) -> Tuple[float, str]:
        """(need / capacity of the fullest tier, that tier's description)."""
        worst = (0.0, "")
        for need, cap, what in ((memory.device, self.device, "device memory"),
                                (memory.host, self.host, "host DRAM share"), (memory.ssd, self.ssd, "SSD share")):
            ratio = need / cap if cap > 0 else (float("inf") if need > 0 else 0.0)
            if ratio > worst[0]:
                worst = (ratio, memory_limit(what, need, cap) + (step_buffers_note(memory.step_buffers, need)
                                                                 if what == "device memory" else ""))
        return worst


STEP_BUFFERS = "a step's ids and pooled outputs"


def step_buffers_note(buffers: float, need: float) -> str:
    """When most of a device need is a step's buffers, say so and what shrinks them (more ranks
    make them larger; other tiers and precisions leave them as they are)."""
    if buffers <= need / 2:
        return ""
    return (f" ({format_bytes(buffers)} of it {STEP_BUFFERS}, which grow with the batch size per rank and the "
            "number of ranks: lower the batch size)")


@dataclass(frozen=True)
class ShardOption:
    """One way to hold a table: ``num_pieces`` equal pieces, placed ``placement``:
    "any" (distinct ranks of the partitioner's choice), "node" (distinct ranks of one node) or
    "all" (one per rank)."""

    table: str
    sharding_type: ShardingType
    num_pieces: int
    placement: str
    tier: str
    precision: str
    cost: Cost
    memory: Memory

    @property
    def piece_seconds(self) -> float:
        return self.cost.total

    @property
    def work(self) -> float:
        """Seconds summed over all pieces."""
        return self.cost.total * self.num_pieces

    def describe(self) -> str:
        k = f" x{self.num_pieces}" if self.num_pieces > 1 and self.placement != "all" else ""
        return f"{self.sharding_type.value}{k} {self.tier} {self.precision}"


def _layouts(table: TableSpec, topo: Topology, allowed: Tuple[str, ...]) -> List[Tuple[ShardingType, int, str]]:
    world, per_node, nodes = topo.world_size, int(topo.ranks_per_node), int(topo.num_nodes)
    out: List[Tuple[ShardingType, int, str]] = []
    types = {ShardingType(t) for t in allowed}
    if ShardingType.TABLE_WISE in types:
        out.append((ShardingType.TABLE_WISE, 1, "any"))
    if ShardingType.ROW_WISE in types and world > 1 and table.num_rows >= world:
        out.append((ShardingType.ROW_WISE, world, "all"))
    if ShardingType.TABLE_ROW_WISE in types and nodes > 1 and per_node > 1 and table.num_rows >= per_node:
        out.append((ShardingType.TABLE_ROW_WISE, per_node, "node"))
    k = 2
    while k <= world and table.dim // k >= MIN_COLUMN_WIDTH and table.dim % k == 0:
        if ShardingType.COLUMN_WISE in types:  # at most settings.max_column_pieces: filtered by the caller
            out.append((ShardingType.COLUMN_WISE, k, "any"))
        if ShardingType.TABLE_COLUMN_WISE in types and nodes > 1 and k <= per_node:
            out.append((ShardingType.TABLE_COLUMN_WISE, k, "node"))
        k *= 2
    if ShardingType.DATA_PARALLEL in types and world > 1:
        out.append((ShardingType.DATA_PARALLEL, world, "all"))
    return out


def _why_unusable(table: TableSpec, topo: Topology, sharding_type: str) -> str:
    """Why ``_layouts`` gives ``table`` no layout of that type on ``topo`` (for error messages)."""
    world, per_node, nodes = topo.world_size, int(topo.ranks_per_node), int(topo.num_nodes)
    kind = ShardingType(sharding_type)
    if kind in (ShardingType.ROW_WISE, ShardingType.DATA_PARALLEL) and world < 2:
        return "needs 2 or more ranks"
    if kind is ShardingType.ROW_WISE:
        return f"needs at least one row per rank ({table.num_rows} rows, {world} ranks)"
    if kind in (ShardingType.TABLE_ROW_WISE, ShardingType.TABLE_COLUMN_WISE) and (nodes < 2 or per_node < 2):
        return "needs 2 or more nodes of 2 or more ranks"
    if kind is ShardingType.TABLE_ROW_WISE:
        return f"needs at least one row per rank of a node ({table.num_rows} rows, {per_node} ranks)"
    if kind.splits_columns:
        return (f"needs dim {table.dim} to split evenly into pieces at least {MIN_COLUMN_WIDTH} wide "
                f"(and at most max_column_pieces of them)")
    return "not usable"


def _why_no_option(replicas_skipped: bool, store_only_skipped: bool) -> str:
    reasons = (["data_parallel is offered on the device tier only"] if replicas_skipped else []) + (
        [f"{'/'.join(STORE_ONLY_PRECISIONS)} rows are held in the row stores of cached tiers only (cached_dram, "
         f"cached_ssd)"] if store_only_skipped else [])
    return "; ".join(reasons) or "none"


def enumerate_options(table: TableSpec, topo: Topology, settings: PlanSettings,
                      capacity: Capacity | None = None) -> List[ShardOption]:
    """All options of ``table`` whose piece fits an empty rank; raises ``InfeasiblePlanError``
    (naming the table and its tightest limit) when none does."""
    capacity = capacity or Capacity.of(topo, settings)
    types = tuple(t for t in settings.sharding_types if table.sharding_types is None or t in table.sharding_types)
    tiers = tuple(t for t in settings.tiers if table.tiers is None or t in table.tiers)
    precisions = tuple(p for p in settings.precisions if table.precisions is None or p in table.precisions)
    layouts = _layouts(table, topo, tuple(t for t in types if t in settings.sharding_types))
    layouts = [lay for lay in layouts if lay[1] <= settings.max_column_pieces or not lay[0].splits_columns]
    for key, kept in (("sharding_types", types), ("tiers", tiers), ("precisions", precisions)):
        if not kept:
            own, allowed = list(getattr(table, key)), list(getattr(settings, key))
            raise InfeasiblePlanError(f"table {table.name!r}: the constraints exclude every option: its own {key} "
                                      f"{own} share none with the {key} allowed by the settings, {allowed}")
    if not layouts:
        usable = list(dict.fromkeys(lay[0].value for lay in layouts))
        reasons = "; ".join(f"{t} {_why_unusable(table, topo, t)}" for t in types if t not in usable)
        raise InfeasiblePlanError(
            f"table {table.name!r}: the constraints exclude every option (sharding types {list(types)} usable on "
            f"{topo.world_size} ranks: {usable}{' (' + reasons + ')' if reasons else ''}; tiers {list(tiers)}; "
            f"precisions {list(precisions)}); allowed by the settings: {list(settings.sharding_types)}, "
            f"{list(settings.tiers)}, {list(settings.precisions)}")
    options: List[ShardOption] = []
    tightest: Tuple[float, str] | None = None
    replicas_skipped = store_only_skipped = False
    for tier in tiers:
        for precision in precisions:
            for kind, pieces, placement in layouts:
                if kind == ShardingType.DATA_PARALLEL and tier != "device":
                    replicas_skipped = True  # a whole replica in every rank's store: training refuses it
                    continue
                if precision in STORE_ONLY_PRECISIONS and tier not in ("cached_dram", "cached_ssd"):
                    store_only_skipped = True  # int8 rows live in a cached tier's row store only
                    continue
                cost, memory = piece_cost(table, kind, pieces, tier, precision, topo, settings)
                ratio, why = capacity.shortfall(memory)
                if ratio <= 1.0:
                    options.append(ShardOption(table.name, kind, pieces, placement, tier, precision, cost, memory))
                elif tightest is None or ratio < tightest[0]:
                    tightest = (ratio, f"{kind.value} x{pieces} in {tier} at {precision}: {why}")
    if not options:
        total = table.num_rows * table.dim
        raise InfeasiblePlanError(
            f"table {table.name!r} ({table.num_rows:,} rows x {table.dim} = {total:,} parameters) fits no rank of "
            f"topology {topo.name!r} ({topo.world_size} ranks) with tiers {list(tiers)} and precisions "
            f"{list(precisions)}; tightest limit: "
            f"{tightest[1] if tightest else _why_no_option(replicas_skipped, store_only_skipped)}")
    return options
