"""Cost model against measurement on this machine: predicted vs measured per-rank step times of
sharded embeddings on gloo (2 and 4 ranks, several plans).

For each world size W in --worlds: calibrate the local-cpu topology for W ranks
(``neorec.planner.calibrate``), make several plans of one set of tables (the planner's, the
planner restricted to row-wise / column-wise, and hand-made table-wise plans: all on rank 0, round
robin, the largest table row-wise and the rest on the last rank), then run
``ShardedEmbeddingBagCollection`` forward + backward on W gloo processes (one thread each) and
measure, per rank, the median over the steps of
- compute: the rank's fused lookup forward + backward (with the optimizer) on its received ids,
  timed on its own (no collective inside);
- step: input all-to-all + lookup + output all-to-all + backward (collectives included; all
  ranks see about the same, the slowest rank's pace).
Predicted: per rank the cost model's lookups + optimizer (+ the calibrated fixed cost of the fused
call on a rank that holds pieces), and per plan the simulator's
iteration (no dense part). Reported: Pearson and Spearman correlations over (plan, rank) points
for compute, over (plan, world) points for the step, and the predicted / measured ratios.

Run (from the repository root, venv active; a few minutes on 2 cores):

    python benchmarks/bench_planner_measured.py --out benchmarks/results/bench_planner_measured.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from neorec.embedding.config import SparseOptimizerConfig, StorageConfig, TableConfig
from neorec.planner.calibrate import calibrate
from neorec.planner.cost_model import PlanSettings, TableSpec
from neorec.planner.planner import evaluate_plan, plan_tables
from neorec.planner.presets import DenseModel
from neorec.planner.simulate import simulate
from neorec.sharding import ShardedEmbeddingBagCollection, ShardingPlan, row_wise, table_wise
from neorec.sparse.jagged import KeyedJaggedTensor

from bench_args import at_least, check_out, list_of  # same folder (run as a script)

BATCH = 512
VARIANTS = {  # planner runs restricted to these sharding types, plus hand-made plans (None)
    "planner": ("table_wise", "row_wise", "column_wise", "data_parallel", "table_row_wise", "table_column_wise"),
    "row_wise": ("row_wise",),
    "column_wise": ("column_wise",),
    "all_on_rank_0": None,
    "round_robin": None,
    "largest_row_wise_rest_on_last_rank": None,
}


def hand_plan(name: str, tables: List[TableSpec], world: int) -> ShardingPlan:
    configs = {t.name: TableConfig(t.name, t.num_rows, t.dim) for t in tables}
    largest = max(tables, key=lambda t: t.num_rows * t.dim).name
    plans = {}
    for i, t in enumerate(tables):
        if name == "all_on_rank_0":
            plans[t.name] = table_wise(configs[t.name], 0)
        elif name == "round_robin":
            plans[t.name] = table_wise(configs[t.name], i % world)
        elif t.name == largest:
            plans[t.name] = row_wise(configs[t.name], list(range(world)))
        else:
            plans[t.name] = table_wise(configs[t.name], world - 1)
    return ShardingPlan(plans, world, world)


def make_tables(seed: int = 0) -> List[TableSpec]:
    rng = random.Random(seed)
    tables = []
    for i in range(10):
        rows = int(10 ** rng.uniform(3.5, 5.7))
        tables.append(TableSpec(f"t{i}", rows, rng.choice([8, 16, 32, 64]), float(rng.choice([1, 2, 5, 10, 20, 40]))))
    return tables


def make_batches(tables: List[TableSpec], rank: int, steps: int) -> List[KeyedJaggedTensor]:
    gen = torch.Generator().manual_seed(1000 + rank)
    batches = []
    for _ in range(steps):
        lengths, values = [], []
        for t in tables:
            length = torch.poisson(torch.full((BATCH,), t.pooling), generator=gen).long()
            lengths.append(length)
            values.append(torch.randint(0, t.num_rows, (int(length.sum()),), generator=gen))
        batches.append(KeyedJaggedTensor([t.name for t in tables], torch.cat(values), torch.cat(lengths)))
    return batches


def _rank(rank: int, world: int, directory: str, tables: List[TableSpec], plans: Dict[str, str], steps: int) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(directory, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=600))
    configs = [TableConfig(t.name, t.num_rows, t.dim) for t in tables]
    batches = make_batches(tables, rank, steps + 2)
    out = {}
    for name, text in plans.items():
        collection = ShardedEmbeddingBagCollection(configs, ShardingPlan.from_json(text), dist.group.WORLD,
                                                   SparseOptimizerConfig(), StorageConfig())
        compute, step = [], []
        for i, kjt in enumerate(batches):
            dist.barrier()
            start = time.perf_counter()
            local = collection.input_dist(kjt).wait()
            pooled = collection.compute(local)
            result = collection.output_dist(local, pooled).wait()
            result.values.backward(torch.ones_like(result.values))
            elapsed = time.perf_counter() - start
            dist.barrier()
            # the rank's own lookup work, alone: fused forward + backward (optimizer included)
            begin = time.perf_counter()
            if collection.tbe is not None:
                own = collection.tbe(local.features).values
                own.backward(torch.ones_like(own))
            alone = time.perf_counter() - begin
            if i >= 2:
                step.append(elapsed)
                compute.append(alone)
        out[name] = {"compute": statistics.median(compute), "step": statistics.median(step)}
        dist.barrier()
    Path(directory, f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def pearson(x: List[float], y: List[float]) -> float:
    mx, my = statistics.mean(x), statistics.mean(y)
    sx = sum((a - mx) ** 2 for a in x) ** 0.5
    sy = sum((b - my) ** 2 for b in y) ** 0.5
    return sum((a - mx) * (b - my) for a, b in zip(x, y)) / (sx * sy) if sx and sy else float("nan")


def spearman(x: List[float], y: List[float]) -> float:
    def ranks(v):  # tied values share the mean of their positions
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        start = 0
        while start < len(order):
            end = start
            while end + 1 < len(order) and v[order[end + 1]] == v[order[start]]:
                end += 1
            for position in range(start, end + 1):
                r[order[position]] = (start + end) / 2
            start = end + 1
        return r
    return pearson(ranks(x), ranks(y))


def summarize(rows: List[dict]) -> dict:
    """Correlations of predicted and measured per-rank lookup compute over the ranks that hold
    pieces (an idle rank measures only its empty call, ~6 us, against a prediction of 0: such points
    at the origin inflated r and pulled the median ratio down), and of the step times per plan."""
    busy = [r for r in rows if r["predicted_compute"] > 0 and r["measured_compute"] > 0]
    compute_p = [r["predicted_compute"] for r in busy]
    compute_m = [r["measured_compute"] for r in busy]
    steps = {(r["world"], r["plan"]): (r["predicted_step"], r["measured_step"]) for r in rows}
    step_p, step_m = [v[0] for v in steps.values()], [v[1] for v in steps.values()]
    return {"points_compute": len(compute_p), "pearson_compute": pearson(compute_p, compute_m),
            "spearman_compute": spearman(compute_p, compute_m),
            "median_ratio_compute": statistics.median(p / m for p, m in zip(compute_p, compute_m)),
            "points_step": len(step_p), "pearson_step": pearson(step_p, step_m),
            "spearman_step": spearman(step_p, step_m),
            "median_ratio_step": statistics.median(p / m for p, m in zip(step_p, step_m))}


def run_world(world: int, steps: int, tables: List[TableSpec], calibration_dir: str) -> dict:
    topo = calibrate(world, Path(calibration_dir) / f"local-cpu-{world}.json")
    plans, predicted = {}, {}
    for name, types in VARIANTS.items():
        settings = PlanSettings(batch_size=BATCH, sharding_types=types or ("table_wise",), device_reserve_fraction=0.0)
        if types is None:
            result = evaluate_plan(hand_plan(name, tables, world), tables, topo, settings)
        else:
            result = plan_tables(tables, topo, settings, time_limit=float("inf"), max_rounds=200)
        plans[name] = result.plan.to_json()
        sim = simulate(result, DenseModel())
        # a rank's lookups + optimizer, plus the calibrated fixed cost of its fused call when it holds pieces
        predicted[name] = {"compute": [r.cost.compute + (topo.lookup_call_seconds if r.num_pieces else 0.0)
                                       for r in result.ranks()], "step": sim.iteration_seconds}
    with tempfile.TemporaryDirectory() as directory:
        mp.start_processes(_rank, args=(world, directory, tables, plans, steps), nprocs=world, start_method="spawn")
        measured = [json.loads(Path(directory, f"rank{r}.json").read_text()) for r in range(world)]
    rows = []
    for name in VARIANTS:
        for r in range(world):
            rows.append({"world": world, "plan": name, "rank": r, "predicted_compute": predicted[name]["compute"][r],
                         "measured_compute": measured[r][name]["compute"],
                         "predicted_step": predicted[name]["step"],
                         "measured_step": max(m[name]["step"] for m in measured)})
            print(f"W={world} {name:<26} rank {r}: compute predicted {rows[-1]['predicted_compute'] * 1e3:7.2f} ms "
                  f"measured {rows[-1]['measured_compute'] * 1e3:7.2f} ms | step predicted "
                  f"{rows[-1]['predicted_step'] * 1e3:7.2f} ms measured {rows[-1]['measured_step'] * 1e3:7.2f} ms",
                  flush=True)
    return {"topology": topo.to_dict(), "rows": rows}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="2,4", type=list_of(1), help="world sizes to calibrate, plan and "
                        "train (default 2,4)")
    parser.add_argument("--steps", type=at_least(1), default=8,
                        help="timed steps per plan on each rank, after 2 untimed ones; medians over them (default 8)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    check_out(parser, args.out)
    tables = make_tables()
    report = {"machine": platform.platform(), "cpus": os.cpu_count(), "python": sys.version.split()[0],
              "torch": torch.__version__, "command": " ".join(sys.argv),
              "tables": [dataclasses.asdict(t) for t in tables], "worlds": {}}
    rows = []
    with tempfile.TemporaryDirectory() as calibration_dir:
        for world in args.worlds:
            report["worlds"][world] = run_world(world, args.steps, tables, calibration_dir)
            rows += report["worlds"][world]["rows"]
    summary = summarize(rows)
    report["summary"] = summary
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
