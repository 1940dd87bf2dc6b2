"""Baseline placements the planner is compared with (``benchmarks/bench_planner.py``), scored
by the same cost model: every table TABLE_WISE on the first allowed tier and precision (ROW_WISE
over all ranks when it fits no single rank), placed by

- "size-greedy": largest table first, onto the rank holding the fewest bytes;
- "lookup-greedy": most bytes looked up per sample first, onto the rank with the fewest;
- "random": a seeded random rank with room.

    loads = baseline_loads("size-greedy", tables, topology, settings)    # seconds per rank

Each rank's seconds include the collectives' fixed latency, once per step (``PlanResult.makespan``).
"""

from __future__ import annotations

import random
from typing import List, Sequence

from neorec.planner.cost_model import PlanSettings, TableSpec, collective_latencies
from neorec.planner.enumerate import Capacity, InfeasiblePlanError, ShardOption, enumerate_options
from neorec.planner.topology import Topology
from neorec.sharding.plan import ShardingType

BASELINES = ("size-greedy", "lookup-greedy", "random")


def _simple_option(table: TableSpec, topo: Topology, settings: PlanSettings, capacity: Capacity) -> List[ShardOption]:
    options = enumerate_options(table, topo, settings, capacity)
    first = [o for o in options if o.tier == settings.tiers[0] and o.precision == settings.precisions[0]] or options
    return sorted((o for o in first if o.sharding_type in (ShardingType.TABLE_WISE, ShardingType.ROW_WISE)),
                  key=lambda o: o.sharding_type != ShardingType.TABLE_WISE)


def baseline_loads(name: str, tables: Sequence[TableSpec], topo: Topology, settings: PlanSettings,
                   seed: int = 0) -> List[float]:
    """Seconds per rank of baseline ``name`` (see the module docstring)."""
    if name not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}; allowed: {BASELINES}")
    capacity = Capacity.of(topo, settings)
    world = topo.world_size
    load, used, key_load = [0.0] * world, [0.0] * world, [0.0] * world
    rng = random.Random(seed)
    kinds = set()
    size = {t.name: t.num_rows * t.dim for t in tables}
    lookups = {t.name: t.pooling * t.dim for t in tables}
    order = sorted(tables, key=lambda t: -(size if name == "size-greedy" else lookups)[t.name])
    if name == "random":
        order = list(tables)
    for table in order:
        options = _simple_option(table, topo, settings, capacity)
        placed = False
        for option in options:
            if option.sharding_type == ShardingType.ROW_WISE:
                if all(used[r] + option.memory.device <= capacity.device for r in range(world)):
                    for r in range(world):
                        load[r] += option.piece_seconds
                        used[r] += option.memory.device
                    placed = True
                    break
                continue
            room = [r for r in range(world) if used[r] + option.memory.device <= capacity.device]
            if not room:
                continue
            if name == "random":
                rank = rng.choice(room)
            else:
                measure = used if name == "size-greedy" else key_load
                rank = min(room, key=lambda r: (measure[r], r))
            load[rank] += option.piece_seconds
            used[rank] += option.memory.device
            key_load[rank] += lookups[table.name]
            placed = True
            break
        if not placed:
            raise InfeasiblePlanError(f"baseline {name}: table {table.name!r} fits no rank")
        kinds.add(option.sharding_type)
    latency = collective_latencies(kinds, topo).total  # paid once per step by every rank, as in PlanResult
    return [seconds + latency for seconds in load]
