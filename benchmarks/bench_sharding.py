"""Sharded embeddings: bytes each sharding type sends per step, and multi-process training speed.

1. ``bytes``: the default job's tables (8 tables, dim 16, 100 to 100k rows, pooling 2, batch 1024
   per rank) sharded all one way (table-wise, row-wise, column-wise, data-parallel, table-row-wise,
   table-column-wise) and by ``default_plan``, on 2 and 4 gloo ranks (2 ranks per node). One
   forward + backward of ``ShardedEmbeddingBagCollection`` per step; bytes are counted at the
   collectives (``CommStats``: what each rank hands to them for OTHER ranks), summed over ranks,
   averaged over the steps.
2. ``speed``: training samples/s (the ``final`` record's qps: training time only) of
   ``neorec train --nproc 2`` against ``--nproc 1`` on the default config (runs alternate, medians;
   ``--nproc 1`` with torch's default threads and with one thread per process).

Run (from the repository root, venv active; about 5 minutes on 2 cores):

    python benchmarks/bench_sharding.py --out benchmarks/results/bench_sharding.json
    python benchmarks/bench_sharding.py --part bytes            # only the byte counts (fast)
    python benchmarks/bench_sharding.py --part speed --repeats 5 --samples 200000
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench_args import check_out, list_of  # same folder (run as a script)
from neorec.config import load_config
from neorec.data import make_data_source
from neorec.sharding import (
    CommStats,
    ShardedEmbeddingBagCollection,
    ShardingPlan,
    column_wise,
    data_parallel,
    default_plan,
    row_wise,
)
from neorec.train.distributed import split_batch

from bench_args import at_least  # same folder (run as a script)

ROOT = Path(__file__).resolve().parents[1]
KINDS = ["table_wise", "row_wise", "column_wise", "data_parallel", "table_row_wise", "table_column_wise", "default"]
RANKS_PER_NODE = 2


def make_plan(kind: str, tables, world: int) -> ShardingPlan:
    if kind == "default":
        return default_plan(tables, world, RANKS_PER_NODE)
    if kind == "table_wise":
        return default_plan(tables, world, RANKS_PER_NODE, row_wise_factor=float("inf"))
    nodes = world // RANKS_PER_NODE
    plans = {}
    for i, table in enumerate(tables):
        node = list(range((i % nodes) * RANKS_PER_NODE, (i % nodes + 1) * RANKS_PER_NODE))
        plans[table.name] = {
            "row_wise": lambda: row_wise(table, list(range(world))),
            "column_wise": lambda: column_wise(table, list(range(world))),
            "data_parallel": data_parallel,
            "table_row_wise": lambda: row_wise(table, node, node_local=True),
            "table_column_wise": lambda: column_wise(table, node, node_local=True),
        }[kind]()
    return ShardingPlan(plans, world, RANKS_PER_NODE)


def worlds_arg(text: str) -> List[int]:
    """``--worlds``: comma-separated world sizes, each a multiple of ``RANKS_PER_NODE`` (the plans
    place ``RANKS_PER_NODE`` ranks on each node; ``--worlds 1`` or ``3`` failed inside the spawned
    ranks)."""
    worlds = list_of(RANKS_PER_NODE)(text)
    odd = [w for w in worlds if w % RANKS_PER_NODE]
    if odd:
        raise argparse.ArgumentTypeError(f"must be multiples of {RANKS_PER_NODE} (the ranks per node), got {odd[0]}")
    return worlds


def full_batches(world: int) -> int:
    """The full batches (``data.batch_size`` samples per rank) the default config's data holds for
    ``world`` ranks: the most steps a byte count can average over."""
    cfg = load_config(ROOT / "configs" / "default.toml")
    return make_data_source(cfg.data).num_train_samples() // (cfg.data.batch_size * world)


def _bytes_rank(rank: int, world: int, directory: str, steps: int) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(directory, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300))
    cfg = load_config(ROOT / "configs" / "default.toml")
    source = make_data_source(cfg.data)
    tables = source.tables(cfg.model.embedding_dim, cfg.model.pooling)
    batches = []
    for i, batch in enumerate(source.train_batches(cfg.data.batch_size * world)):
        batches.append(split_batch(batch, rank, world))
        if i + 1 == steps:
            break
    results: Dict[str, Dict[str, float]] = {}
    for kind in KINDS:
        stats = CommStats()
        collection = ShardedEmbeddingBagCollection(tables, make_plan(kind, tables, world), dist.group.WORLD,
                                                   cfg.embedding.optimizer, cfg.embedding.storage, comm_stats=stats)
        for batch in batches:
            pooled = collection(batch.sparse).values
            pooled.backward(torch.ones_like(pooled))
        results[kind] = {name: value / len(batches) for name, value in stats.bytes_sent.items()}
        dist.barrier()
    Path(directory, f"bytes{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def measure_bytes(world: int, steps: int) -> Dict[str, Dict[str, float]]:
    with tempfile.TemporaryDirectory() as directory:
        mp.start_processes(_bytes_rank, args=(world, directory, steps), nprocs=world, start_method="spawn")
        per_rank = [json.loads(Path(directory, f"bytes{r}.json").read_text()) for r in range(world)]
    total: Dict[str, Dict[str, float]] = {}
    for kind in KINDS:
        names = sorted({n for rank in per_rank for n in rank[kind]})
        total[kind] = {n: sum(rank[kind].get(n, 0.0) for rank in per_rank) for n in names}
        total[kind]["total"] = sum(total[kind].values())
    return total


def train_qps(nproc: int, samples: int, threads: int) -> float:
    """Training samples/s of one ``neorec train`` run on the default config."""
    with tempfile.TemporaryDirectory() as out:
        steps = samples // (1024 * nproc)
        command = [sys.executable, "-m", "neorec", "train", "--config", str(ROOT / "configs" / "default.toml"),
                   "--max-steps", str(steps), "--output-dir", out, "--no-progress",
                   "--set", "data.synthetic.num_eval_samples=4096", "--set", "train.log_every_steps=1000",
                   "--set", f"train.num_threads={threads}"]
        if nproc > 1:
            command += ["--nproc", str(nproc)]
        run = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=900)
        if run.returncode != 0:  # the ranks' own error lines, not only "returned non-zero exit status"
            raise RuntimeError(f"neorec train --nproc {nproc} failed (exit {run.returncode}):\n{run.stderr[-3000:]}")
        final = json.loads(Path(out, "metrics.jsonl").read_text().splitlines()[-1])
        return float(final["qps"])


def measure_speed(repeats: int, samples: int) -> Dict[str, Dict]:
    contenders = {"nproc1_default_threads": (1, 0), "nproc2": (2, 0), "nproc1_threads1": (1, 1)}
    runs: Dict[str, List[float]] = {name: [] for name in contenders}
    for _ in range(repeats):
        for name, (nproc, threads) in contenders.items():
            runs[name].append(train_qps(nproc, samples, threads))
            print(f"  {name}: {runs[name][-1]:,.0f} samples/s", flush=True)
    medians = {name: statistics.median(values) for name, values in runs.items()}
    return {"runs": runs, "median": medians,
            "ratio_nproc2_over_nproc1_default": medians["nproc2"] / medians["nproc1_default_threads"],
            "ratio_nproc2_over_nproc1_threads1": medians["nproc2"] / medians["nproc1_threads1"]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["bytes", "speed", "all"], default="all",
                        help="bytes: the byte counts only; speed: the training speed only; all: both (default)")
    parser.add_argument("--worlds", default="2,4", type=worlds_arg,
                        help=f"world sizes of the byte counts, multiples of {RANKS_PER_NODE} (default 2,4)")
    parser.add_argument("--steps", type=at_least(1), default=3,
                        help="steps averaged in the byte counts, at most the full batches of the data at the "
                             "largest world size (default 3)")
    parser.add_argument("--repeats", type=at_least(1), default=3, help="alternating runs of each speed contender")
    parser.add_argument("--samples", type=at_least(2048), default=153_600,
                        help="training samples per speed run (at least one step of 1024 samples on each of 2 "
                        "ranks: --max-steps 0 would mean a whole epoch)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.part in ("bytes", "all"):
        world = max(args.worlds)
        available = full_batches(world)
        if args.steps > available:  # the steps past the data's end were not run, yet divided by
            parser.error(f"argument --steps: the default config's data holds {available} full batches at {world} "
                         f"ranks, got {args.steps}")
    check_out(parser, args.out)
    report = {"machine": {"platform": platform.platform(), "python": platform.python_version(),
                          "torch": torch.__version__, "cpus": os.cpu_count()},
              "date": time.strftime("%Y-%m-%d")}
    if args.part in ("bytes", "all"):
        report["bytes_per_step"] = {}
        for world in args.worlds:
            counts = measure_bytes(world, args.steps)
            report["bytes_per_step"][str(world)] = counts
            print(f"\nbytes sent per step, {world} ranks ({RANKS_PER_NODE} per node), summed over ranks (MB):")
            names = ["input_dist.header", "input_dist", "input_dist.weights", "output_dist", "output_dist.backward",
                     "replica_all_reduce", "total"]
            print(f"{'plan':<20}" + "".join(f"{n:>22}" for n in names))
            for kind, values in counts.items():
                print(f"{kind:<20}" + "".join(f"{values.get(n, 0.0) / 1e6:>22.3f}" for n in names))
    if args.part in ("speed", "all"):
        print(f"\ntraining samples/s, default config, {args.samples:,} samples per run, {args.repeats} alternating runs:")
        report["speed"] = measure_speed(args.repeats, args.samples)
        for name, value in report["speed"]["median"].items():
            print(f"  median {name}: {value:,.0f} samples/s")
        print(f"  nproc2 / nproc1 (default threads): {report['speed']['ratio_nproc2_over_nproc1_default']:.2f}x; "
              f"nproc2 / nproc1 (1 thread): {report['speed']['ratio_nproc2_over_nproc1_threads1']:.2f}x")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
