"""``plan_tables``: tables + topology + settings -> a ``ShardingPlan`` and its predicted cost.

    result = plan_tables(tables, get_topology("zionex"), PlanSettings(batch_size=512))
    result.plan.save("plan.json")       # what `neorec train --plan plan.json` and shard() consume
    result.makespan, result.lower_bound, result.gap, result.rank_rows()

Preferences are relaxed step by step: first only the first tier and first precision allowed;
when that does not fit, more precisions (in the given order), then more tiers. The first level
that fits is planned (enumerate -> cost -> partition); inside it, tables then move back to the
preferred precision and tier wherever memory allows. A plan that mixes replicated and
model-parallel tables pays the fixed latency of both kinds of collectives, which the partition
(balancing the pieces' work) does not see: such a plan is compared with the partitions that use
only one kind, latency included, and the fastest kept. When none fits, the last level's
``InfeasiblePlanError`` names the table and its tightest limit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence, Tuple

from neorec.planner.cost_model import Cost, Memory, PlanSettings, TableSpec, collective_latencies
from neorec.planner.enumerate import Capacity, InfeasiblePlanError, ShardOption, enumerate_options
from neorec.planner.partition import PartitionResult, Placement, partition
from neorec.planner.topology import Topology
from neorec.sharding.plan import Shard, ShardingPlan, ShardingType, TablePlan


@dataclass
class RankSummary:
    rank: int
    cost: Cost
    memory: Memory
    num_pieces: int


@dataclass
class PlanResult:
    plan: ShardingPlan
    placements: Dict[str, Placement]
    partition: PartitionResult
    topology: Topology
    settings: PlanSettings
    tables: List[TableSpec]

    @property
    def latency(self) -> Cost:
        """The fixed latency of the plan's collectives, paid once per step by every rank."""
        return collective_latencies((p.option.sharding_type for p in self.placements.values()), self.topology)

    @property
    def makespan(self) -> float:
        """Seconds of the slowest rank: its pieces' work (what the partition balances) plus the
        collectives' fixed latency."""
        return self.partition.makespan + self.latency.total

    @property
    def lower_bound(self) -> float:
        """The partition's bound on the slowest rank's work, plus this plan's fixed latency (to be
        read beside ``makespan``)."""
        return self.partition.lower_bound + self.latency.total

    @property
    def greedy_makespan(self) -> float:
        """The slowest rank of the partition's greedy start, with this plan's fixed latency (as
        ``makespan``, to be compared with it)."""
        return self.partition.greedy_makespan + self.latency.total

    @property
    def gap(self) -> float:
        """How far the slowest rank's work is from its bound (work / bound - 1): the balance the
        partition reached, the fixed latency left out (it is the same on every rank)."""
        return self.partition.gap

    @property
    def tiers(self) -> Dict[str, str]:
        return {name: p.option.tier for name, p in self.placements.items()}

    def ranks(self) -> List[RankSummary]:
        """Per rank: its pieces' costs and memory plus the collectives' fixed latency."""
        latency = self.latency
        out = [RankSummary(r, Cost(), Memory(), 0) for r in range(self.topology.world_size)]
        for summary in out:
            summary.cost.add(latency)
        for p in self.placements.values():
            for r in p.ranks:
                out[r].cost.add(p.option.cost)
                out[r].memory.add(p.option.memory)
                out[r].num_pieces += 1
        return out

    def to_report(self) -> dict:
        return {
            "topology": self.topology.to_dict(),
            "settings": dataclasses.asdict(self.settings),
            "makespan_seconds": self.makespan, "lower_bound_seconds": self.lower_bound, "gap": self.gap,
            "greedy_makespan_seconds": self.greedy_makespan, "search_rounds": self.partition.rounds,
            "tables": {n: {"option": p.option.describe(), "sharding_type": p.option.sharding_type.value,
                           "tier": p.option.tier, "precision": p.option.precision, "ranks": list(p.ranks)}
                       for n, p in self.placements.items()},
            "ranks": [{"rank": s.rank, "num_pieces": s.num_pieces, "device_bytes": s.memory.device,
                       "host_bytes": s.memory.host, "ssd_bytes": s.memory.ssd, "total_seconds": s.cost.total,
                       **{f"{k}_seconds": v for k, v in s.cost.as_dict().items()}} for s in self.ranks()],
        }


def _cuts(size: int, parts: int) -> List[int]:
    return [size * i // parts for i in range(parts + 1)]


def table_plan(table: TableSpec, placement: Placement) -> TablePlan:
    """The ``TablePlan`` of one placed option (even row / column cuts over its sorted ranks)."""
    o, ranks = placement.option, sorted(placement.ranks)
    kind = o.sharding_type
    if kind == ShardingType.DATA_PARALLEL:
        shards: List[Shard] = []
    elif kind.splits_rows:
        c = _cuts(table.num_rows, len(ranks))
        shards = [Shard(r, c[i], c[i + 1], 0, table.dim) for i, r in enumerate(ranks)]
    elif kind.splits_columns:
        c = _cuts(table.dim, len(ranks))
        shards = [Shard(r, 0, table.num_rows, c[i], c[i + 1]) for i, r in enumerate(ranks)]
    else:
        shards = [Shard(ranks[0], 0, table.num_rows, 0, table.dim)]
    return TablePlan(kind, shards, o.precision, o.tier)


def _preference(settings: PlanSettings):
    """Sort key of an option: earlier tier in the user's list first, then earlier precision: the
    order ``_levels`` relaxes them in (every precision on a tier before the next tier). With the
    precision first, a table planned alone took fp16 on the device while fp32 in a cache was
    "preferred", and next to a table that needed the cache it moved there."""
    precisions, tiers = list(settings.precisions), list(settings.tiers)
    return lambda o: (tiers.index(o.tier), precisions.index(o.precision))


def _levels(settings: PlanSettings) -> List[Tuple[PlanSettings, Callable[[ShardOption], bool]]]:
    """The relaxation steps, each (settings to enumerate options with, which of them it allows):
    the options of the first k (tier, precision) pairs in ``_preference``'s order, so that every
    level holds all options more preferred than any it allows (a level of two tiers at fp32 only
    left out fp16 on the device, more preferred than fp32 in a cache)."""
    levels = []
    tiers, precisions = list(settings.tiers), list(settings.precisions)
    for t in range(1, len(tiers) + 1):
        for p in range(1, len(precisions) + 1):
            level = dataclasses.replace(settings, tiers=tuple(tiers[:t]),
                                        precisions=tuple(precisions[: len(precisions) if t > 1 else p]))
            levels.append((level, lambda o, t=t, p=p: tiers.index(o.tier) < t - 1 or precisions.index(o.precision) < p))
    return levels


def plan_tables(tables: Sequence[TableSpec], topology: Topology, settings: PlanSettings,
                time_limit: float = 10.0, max_rounds: int = 10_000) -> PlanResult:
    """Plan ``tables`` on ``topology``; see the module docstring. ``time_limit`` (seconds) bounds
    the search (bound-guided packing and improvement), shared by the partitions of the plan (each
    gets what the earlier ones left; the preference pass may take as long again); enumerating the
    options and the greedy starts are not counted (they used to be, and left a large model's search
    no time at all); with ``time_limit=inf`` the result depends on the inputs only."""
    if not tables:
        raise ValueError("planner: no tables to plan")
    other = next((t for t in tables if not isinstance(t, TableSpec)), None)
    if other is not None:  # (an embedding TableConfig failed deep in the enumeration)
        raise TypeError(f"planner: tables must be TableSpec(name, num_rows, dim, pooling=ids per sample), got a "
                        f"{type(other).__name__}; for an embedding TableConfig t: TableSpec(t.name, t.num_embeddings, "
                        f"t.embedding_dim, pooling) with pooling the ids per sample of its features")
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise ValueError(f"planner: duplicate table names {sorted({n for n in names if names.count(n) > 1})}")
    error: InfeasiblePlanError | None = None
    budget = [time_limit]  # search seconds left, spent by each partition
    for level, allows in _levels(settings):
        capacity = Capacity.of(topology, level)
        try:
            options: Dict[str, List[ShardOption]] = {t.name: _allowed(t, enumerate_options(t, topology, level, capacity),
                                                                      allows) for t in tables}
            result = _partition(options, topology, capacity, budget, max_rounds, _preference(settings))
        except InfeasiblePlanError as exc:
            error = exc
            continue
        result = _fewer_collectives_if_faster(result, options, topology, capacity, budget, max_rounds,
                                              _preference(settings))
        plan = ShardingPlan({t.name: table_plan(t, result.placements[t.name]) for t in tables},
                            topology.world_size, int(topology.ranks_per_node))
        return PlanResult(plan, result.placements, result, topology, level, list(tables))
    assert error is not None
    raise error


def _allowed(table: TableSpec, options: List[ShardOption], allows: Callable[[ShardOption], bool]) -> List[ShardOption]:
    kept = [o for o in options if allows(o)]
    if not kept:  # (options of the level's last tier at a precision it does not allow yet)
        raise InfeasiblePlanError(f"table {table.name!r}: no option at this level of tiers and precisions")
    return kept


def _partition(options: Dict[str, List[ShardOption]], topology: Topology, capacity: Capacity, budget: List[float],
               max_rounds: int, preference) -> PartitionResult:
    """``partition`` with the search seconds left in ``budget[0]``, less what it spent."""
    result = partition(options, topology, capacity, time_limit=max(0.0, budget[0]), max_rounds=max_rounds,
                       preference=preference)
    budget[0] -= result.search_seconds
    return result


def _with_latency(result: PartitionResult, topology: Topology) -> float:
    kinds = {p.option.sharding_type for p in result.placements.values()}
    return result.makespan + collective_latencies(kinds, topology).total


def _fewer_collectives_if_faster(result: PartitionResult, options: Dict[str, List[ShardOption]], topology: Topology,
                                 capacity: Capacity, budget: List[float], max_rounds: int, preference) -> PartitionResult:
    """The partition balances the pieces' work; the collectives' fixed latency is paid once per step
    for all tables (three all-to-alls when any table is model-parallel, one all-reduce when any is
    replicated), so a plan mixing both pays both. When it does, partition again with replicas only
    and without them, each table limited to options at least as preferred as its own in the mixed
    plan (a lower precision or a further tier is a fallback for memory, not a way to save a
    collective's latency), and keep whichever is fastest with its latency (the first on ties)."""
    kinds = {p.option.sharding_type for p in result.placements.values()}
    if ShardingType.DATA_PARALLEL not in kinds or kinds == {ShardingType.DATA_PARALLEL} or topology.world_size == 1:
        return result
    best, best_seconds = result, _with_latency(result, topology)
    own = {name: preference(p.option) for name, p in result.placements.items()}
    for replicated in (False, True):
        allowed = {name: [o for o in opts if (o.sharding_type == ShardingType.DATA_PARALLEL) == replicated
                          and preference(o) <= own[name]]
                   for name, opts in options.items()}
        if not all(allowed.values()):
            continue
        try:
            other = _partition(allowed, topology, capacity, budget, max_rounds, preference)
        except InfeasiblePlanError:
            continue
        seconds = _with_latency(other, topology)
        if seconds < best_seconds * (1 - 1e-9):
            best, best_seconds = other, seconds
    return best


def evaluate_plan(plan: ShardingPlan, tables: Sequence[TableSpec], topology: Topology, settings: PlanSettings,
                  tiers: Dict[str, str] | None = None) -> PlanResult:
    """The cost model applied to a given ``plan`` (any plan, e.g. hand-written or a baseline):
    a ``PlanResult`` whose per-rank costs and memory can be compared and simulated. Pieces are
    costed as even pieces of their type; ``tiers`` per table default to the plan's own."""
    from neorec.planner.cost_model import piece_cost
    from neorec.planner.names import TIERS

    specs = {t.name: t for t in tables}
    plan.validate([_table_config(t) for t in tables], topology.world_size, tiers=TIERS)
    placements: Dict[str, Placement] = {}
    loads = [0.0] * topology.world_size
    for name, entry in plan.tables.items():
        kind = entry.sharding_type
        tier = (tiers or {}).get(name, entry.tier)
        precision = entry.precision or settings.precisions[0]
        if kind == ShardingType.DATA_PARALLEL:
            ranks, placement = tuple(range(topology.world_size)), "all"
        else:
            ranks = tuple(s.rank for s in entry.shards)
            placement = "any" if kind in (ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE) else "node"
            placement = "all" if kind == ShardingType.ROW_WISE else placement
        cost, memory = piece_cost(specs[name], kind, len(ranks), tier, precision, topology, settings)
        option = ShardOption(name, kind, len(ranks), placement, tier, precision, cost, memory)
        placements[name] = Placement(option, ranks)
        for r in ranks:
            loads[r] += cost.total
    makespan = max(loads)
    partition_result = PartitionResult(placements, loads, makespan, 0.0, 0, makespan)
    return PlanResult(plan, placements, partition_result, topology, settings, list(tables))


def _table_config(spec: TableSpec):
    from neorec.embedding.config import TableConfig

    return TableConfig(spec.name, spec.num_rows, spec.dim)
