"""Sharding planner: the 100-task suite against baselines, and Neo's Model-A/F/I on ZionEX.

1. ``suite``: 100 generated sharding tasks (10-60 tables, dims 4-128, power-law sizes and pooling
   factors, 4-128 ranks of ZionEX A100s, 1 to 16 nodes, batch 512 per rank). Per task: the
   planner's slowest-rank cost, the lower bound, the gap, and the slowest rank of the size-greedy,
   lookup-greedy and random placements (same cost model). Target: mean gap <= 10%, better than
   every baseline on every task.
2. ``paper``: Model-A/F/I presets on 16 ZionEX nodes: predicted QPS (with and without
   pipelining) against the paper's 1.2M / 1.7M / 3.4M, and 1 -> 16 node scaling efficiency of A
   and I against ~50% / ~75%, both for the same model on every cluster size and for a model
   whose rows grow with the node count (same bytes per rank). No constant is tuned to the paper; the ratios are what they are.

Run (from the repository root, venv active; a few minutes on 2 cores):

    python benchmarks/bench_planner.py --out benchmarks/results/bench_planner.json
    python benchmarks/bench_planner.py --part suite --tasks 20       # quicker
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import List

import torch

from neorec.planner.baselines import BASELINES, baseline_loads
from neorec.planner.cost_model import PlanSettings, TableSpec
from neorec.planner.planner import plan_tables
from neorec.planner.presets import MODEL_PRESETS, get_model_preset
from neorec.planner.simulate import scaling, simulate
from neorec.planner.topology import zionex

from bench_args import at_least, check_out, number  # same folder (run as a script)

WORLDS = (4, 8, 16, 32, 64, 128)
# the presets with the paper's QPS to compare with (Neo's; the Criteo DLRMs have none)
PAPER_MODELS = tuple(name for name, make in MODEL_PRESETS.items() if make().paper_qps is not None)


def make_task(seed: int):
    rng = random.Random(seed)
    num_tables = rng.randint(10, 60)
    alpha = rng.uniform(0.8, 1.5)
    tables = []
    for i in range(num_tables):
        rows = int(min(50_000_000, 1000 * rng.paretovariate(alpha) ** 3))   # power-law rows
        dim = rng.choice([4, 8, 16, 32, 64, 128])
        pooling = round(min(200.0, rng.paretovariate(1.1)), 3)             # power-law pooling
        tables.append(TableSpec(f"t{i}", rows, dim, pooling))
    world = rng.choice(WORLDS)
    topo = zionex().with_world(world, min(world, 8))
    return tables, topo


def run_suite(num_tasks: int, time_limit: float) -> dict:
    settings = PlanSettings(batch_size=512)
    rows = []
    print(f"{'task':>4} {'tables':>6} {'ranks':>5} {'planner ms':>10} {'bound ms':>9} {'gap %':>6} "
          + " ".join(f"{b:>13}" for b in BASELINES) + f" {'plan s':>6}", flush=True)
    for seed in range(num_tasks):
        tables, topo = make_task(seed)
        start = time.perf_counter()
        result = plan_tables(tables, topo, settings, time_limit=time_limit)
        seconds = time.perf_counter() - start
        base = {b: max(baseline_loads(b, tables, topo, settings, seed=seed)) for b in BASELINES}
        row = {"task": seed, "tables": len(tables), "ranks": topo.world_size, "planner": result.makespan,
               "bound": result.lower_bound, "gap": result.gap, "plan_seconds": seconds, **base,
               "beats_all": all(result.makespan < base[b] for b in BASELINES)}
        rows.append(row)
        print(f"{seed:>4} {len(tables):>6} {topo.world_size:>5} {result.makespan * 1e3:>10.3f} "
              f"{result.lower_bound * 1e3:>9.3f} {result.gap * 100:>6.1f} "
              + " ".join(f"{base[b] * 1e3:>13.3f}" for b in BASELINES) + f" {seconds:>6.2f}", flush=True)
    summary = {
        "tasks": len(rows), "mean_gap": statistics.mean(r["gap"] for r in rows),
        "median_gap": statistics.median(r["gap"] for r in rows), "max_gap": max(r["gap"] for r in rows),
        "beats_all_baselines_on": sum(r["beats_all"] for r in rows),
        **{f"median_{b}_over_planner": statistics.median(r[b] / r["planner"] for r in rows) for b in BASELINES},
        **{f"min_{b}_over_planner": min(r[b] / r["planner"] for r in rows) for b in BASELINES},
        "mean_plan_seconds": statistics.mean(r["plan_seconds"] for r in rows),
    }
    print(json.dumps(summary, indent=1), flush=True)
    return {"rows": rows, "summary": summary}


def run_paper(rounds: int, models, nodes=(1, 2, 4, 8, 16)) -> dict:
    time_limit = float("inf")  # deterministic: a fixed number of search rounds
    out = {}
    for name in models:
        preset = get_model_preset(name)
        start = time.perf_counter()
        result = plan_tables(preset.tables, zionex(16), preset.settings, time_limit=time_limit, max_rounds=rounds)
        sim = simulate(result, preset.dense)
        entry = {"paper_qps": preset.paper_qps, "qps": sim.qps, "pipelined_qps": sim.pipelined_qps,
                 "ratio_pipelined": sim.pipelined_qps / preset.paper_qps, "ratio_unpipelined": sim.qps / preset.paper_qps,
                 "phases_ms": {k: v * 1e3 for k, v in sim.phases.items()}, "gap": result.gap,
                 "precisions": sorted({p.option.precision for p in result.placements.values()}),
                 "tiers": sorted({p.option.tier for p in result.placements.values()}),
                 "types": sorted({p.option.sharding_type.value for p in result.placements.values()}),
                 "plan_seconds": time.perf_counter() - start}
        print(f"{name}: predicted {sim.pipelined_qps:,.0f} QPS pipelined ({sim.qps:,.0f} without), paper "
              f"{preset.paper_qps:,.0f}: ratio {entry['ratio_pipelined']:.2f} ({entry['ratio_unpipelined']:.2f}); "
              f"{entry['precisions']} {entry['tiers']} {entry['types']}; phases ms "
              + ", ".join(f"{k} {v:.2f}" for k, v in entry["phases_ms"].items()), flush=True)
        if preset.paper_scaling_efficiency is not None:
            entry["paper_scaling_efficiency"] = preset.paper_scaling_efficiency
            for label, scale in (("scaling_fixed_model", False), ("scaling_model_grows_with_nodes", True)):
                rows = scaling(preset.tables, zionex(), preset.settings, preset.dense, nodes, time_limit=time_limit,
                               scale_model=scale, max_rounds=rounds)
                entry[label] = rows
                for row in rows:
                    print(f"   {label}: {row['nodes']:>2} nodes: {row['pipelined_qps']:>12,.0f} QPS, efficiency "
                          f"{row['efficiency']:.2f} {row['precisions']} {row['tiers']}", flush=True)
        out[name] = entry
    return out


def models_arg(text: str) -> List[str]:
    """``--models``: comma-separated presets of ``neorec.planner.presets`` that carry the paper's QPS
    (an unknown name was refused only after the suite had run)."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in PAPER_MODELS]
    if unknown or not names:
        what = "no model preset" if not unknown else f"unknown model preset {unknown[0]!r}" \
            if unknown[0] not in MODEL_PRESETS else f"model preset {unknown[0]!r} has no paper QPS to compare with"
        raise argparse.ArgumentTypeError(f"{what}; choose from {', '.join(PAPER_MODELS)}")
    return names


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("suite", "paper", "all"), default="all",
                        help="suite: the 100-task suite; paper: Model-A/F/I on ZionEX; all: both (default)")
    parser.add_argument("--models", default="neo-model-a,neo-model-f,neo-model-i", type=models_arg,
                        help=f"paper: comma-separated model presets, from {', '.join(PAPER_MODELS)} "
                             "(default neo-model-a,neo-model-f,neo-model-i)")
    parser.add_argument("--tasks", type=at_least(1), default=100,
                        help="suite: generated tasks, the first N of the fixed seeds (default 100)")
    parser.add_argument("--time-limit", type=number(0, finite=False), default=2.0,
                        help="planner search seconds per suite task, >= 0 (0: the greedy start, no search after it; "
                             "default 2)")
    parser.add_argument("--paper-rounds", type=at_least(1), default=300,
                        help="improvement-search rounds per model plan (no time limit: deterministic)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    check_out(parser, args.out)
    report = {"machine": platform.platform(), "python": sys.version.split()[0], "torch": torch.__version__,
              "command": " ".join(sys.argv)}
    if args.part in ("suite", "all"):
        report["suite"] = run_suite(args.tasks, args.time_limit)
    if args.part in ("paper", "all"):
        report["paper"] = run_paper(args.paper_rounds, args.models)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
