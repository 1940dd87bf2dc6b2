"""Cluster simulator: iteration time and QPS of a plan on a topology, with and without pipelining.

    sim = simulate(plan_result, DenseModel(mflops_per_sample=638, num_parameters=228e6))
    sim.iteration_seconds, sim.pipelined_iteration_seconds, sim.qps, sim.pipelined_qps
    rows = scaling(tables, get_topology("zionex"), settings, dense, nodes=(1, 2, 4, 8, 16))

One iteration is a chain of phases, each as slow as its slowest rank (collectives synchronise):
input all-to-all (ids) -> embedding lookups -> output all-to-all (pooled rows) -> dense forward
and backward (3 x MFLOPS per sample x local batch / compute rate) -> gradient all-to-all ->
embedding backward + optimizer -> all-reduce of the dense parameters and replicated tables.
The lookup phase adds the topology's fixed ``lookup_call_seconds`` on ranks that hold
pieces. A rank's all-to-all time is the larger of what its pieces send (the cost model) and what it
receives as a sample owner (its local batch's pooled rows of every model-parallel table).
Pipelined (Neo): the ids of batch i+1 travel while batch i computes and the all-reduce runs
during the dense backward, so only what exceeds them is exposed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import Dict, List, Sequence

from neorec.planner.cost_model import ID_BYTES, PlanSettings, TableSpec, allreduce_seconds, alltoall_seconds
from neorec.planner.enumerate import InfeasiblePlanError
from neorec.planner.planner import PlanResult, plan_tables
from neorec.planner.presets import DenseModel
from neorec.planner.topology import Topology
from neorec.sharding.plan import ShardingType


@dataclass
class Simulation:
    world_size: int
    batch_size: int
    phases: Dict[str, float]              # seconds, slowest rank per phase
    iteration_seconds: float              # no overlap
    pipelined_iteration_seconds: float    # input all-to-all and all-reduce overlapped
    exposed_comm_seconds: float
    pipelined_exposed_comm_seconds: float

    @property
    def qps(self) -> float:
        return self.world_size * self.batch_size / self.iteration_seconds

    @property
    def pipelined_qps(self) -> float:
        return self.world_size * self.batch_size / self.pipelined_iteration_seconds

    def to_dict(self) -> dict:
        return {**asdict(self), "qps": self.qps, "pipelined_qps": self.pipelined_qps}


def simulate(result: PlanResult, dense: DenseModel) -> Simulation:
    topo, settings = result.topology, result.settings
    batch = settings.batch_size
    ranks = result.ranks()
    specs = {t.name: t for t in result.tables}
    ids_out = pooled_in = 0.0
    row_header = 8 if settings.comm_bytes == 1 else 0  # int8 rows carry their min and step
    for name, placement in result.placements.items():
        kind = placement.option.sharding_type
        if kind == ShardingType.DATA_PARALLEL:
            continue
        copies = placement.option.num_pieces if kind.splits_columns else 1  # every column piece gets the ids
        ids_out += copies * batch * (specs[name].pooling + 1) * ID_BYTES
        pooled_in += batch * (specs[name].dim * settings.comm_bytes + copies * row_header)
    owner_input = alltoall_seconds(ids_out, topo)
    owner_output = alltoall_seconds(pooled_in, topo)
    dense_forward = dense.mflops_per_sample * 1e6 * batch / topo.compute_flops
    phases = {
        "input_alltoall": max(max(r.cost.input_comm for r in ranks), owner_input),
        "lookup_forward": max(r.cost.lookup_forward + (topo.lookup_call_seconds if r.num_pieces else 0.0)
                              for r in ranks),
        "output_alltoall": max(max(r.cost.output_comm for r in ranks), owner_output),
        "dense_forward": dense_forward,
        "dense_backward": 2 * dense_forward,
        "gradient_alltoall": max(max(r.cost.gradient_comm for r in ranks), owner_output),
        "lookup_backward_and_optimizer": max(r.cost.lookup_backward + r.cost.optimizer for r in ranks),
        "allreduce": allreduce_seconds(dense.num_parameters * 4.0, topo) + max(r.cost.allreduce for r in ranks),
    }
    comm_keys = ("input_alltoall", "output_alltoall", "gradient_alltoall", "allreduce")
    total = sum(phases.values())
    exposed = sum(phases[k] for k in comm_keys)
    rest = total - phases["input_alltoall"] - phases["allreduce"]
    hidden_input = min(phases["input_alltoall"], rest)
    hidden_allreduce = min(phases["allreduce"], phases["dense_backward"])
    pipelined = total - hidden_input - hidden_allreduce
    return Simulation(topo.world_size, batch, phases, total, pipelined, exposed,
                      exposed - hidden_input - hidden_allreduce)


def scaling(tables: Sequence[TableSpec], topology: Topology, settings: PlanSettings, dense: DenseModel,
            nodes: Sequence[int] = (1, 2, 4, 8, 16), time_limit: float = 10.0,
            scale_model: bool = False, max_rounds: int = 10_000, planned=None) -> List[dict]:
    """Plan and simulate the model (same local batch) on 1, 2, 4 ... nodes; efficiency =
    QPS(n) / (n x QPS(first that fits)). A node count the model does not fit gives a row with
    its ``error`` (the planner's message) and no timings. ``scale_model``: the tables' rows grow
    with the node count (n / largest n of them), so every rank holds about the same bytes at every
    size (weak scaling of model and cluster together); otherwise the same model everywhere, which
    on few nodes may need slower tiers or lower precision. ``planned``: the ``PlanResult`` already
    made for ``topology``'s node count and these tables, used for that row (planned again, under a
    time limit, it could differ from the plan printed above the study)."""
    rows: List[dict] = []
    for n in nodes:
        topo = topology.with_nodes(n)
        specs = list(tables)
        if scale_model:
            factor = n / max(nodes)
            specs = [dataclasses.replace(t, num_rows=max(1, int(t.num_rows * factor))) for t in tables]
        try:
            if planned is not None and n == topology.num_nodes and specs == list(tables):
                result = planned
            else:
                result = plan_tables(specs, topo, settings, time_limit=time_limit, max_rounds=max_rounds)
        except InfeasiblePlanError as exc:
            rows.append({"nodes": n, "ranks": topo.world_size, "error": str(exc), "efficiency": None})
            continue
        sim = simulate(result, dense)
        rows.append({"nodes": n, "ranks": topo.world_size, "qps": sim.qps, "pipelined_qps": sim.pipelined_qps,
                     "iteration_ms": sim.iteration_seconds * 1e3,
                     "pipelined_iteration_ms": sim.pipelined_iteration_seconds * 1e3,
                     "precisions": sorted({p.option.precision for p in result.placements.values()}),
                     "tiers": sorted({p.option.tier for p in result.placements.values()}),
                     "gap": result.gap})
    fits = [row for row in rows if "error" not in row]
    base = fits[0]["pipelined_qps"] / fits[0]["nodes"] if fits else 0.0
    for row in fits:
        row["efficiency"] = row["pipelined_qps"] / (row["nodes"] * base)
    return rows
