"""neorec's training step with and without ``train.reuse_freed_memory`` (glibc malloc thresholds,
``neorec/train/allocator.py``): wall time, minor page faults and system time per step.

The setting is process-wide and one-way, so each variant runs in its own process (bench_e2e's
DLRM and batches, 1 process, ``--threads`` intra-op threads), alternating off, on, off, on, ...
``--pairs`` times; each process times ``--runs`` runs of ``--steps`` steps after a warm-up and
reports medians. Run (repository root, venv active; about 2 minutes):

    python benchmarks/bench_allocator.py --config pool1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from bench_args import at_least  # same folder (run as a script)

WORKER = r"""
import dataclasses, json, resource, statistics, sys, time
sys.path.insert(0, sys.argv[1])
import torch
import bench_e2e
from neorec.data import make_data_source

name, reuse, threads, runs, steps = sys.argv[2], sys.argv[3] == "1", int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
config = bench_e2e.CONFIGS[name]
cfg = bench_e2e.neorec_config(config, 1, reuse_freed_memory=reuse)
source = make_data_source(cfg.data)
batches = bench_e2e.make_batches(source, config, 1, 0, 8, torchrec=False)  # neorec alone
runner = bench_e2e.NeorecRunner(cfg, source, 0, 1, None, batches)  # train_step over the 8 batches, cycled
torch.set_num_threads(threads)
runner.run(6)  # warm-up
wall, faults, system = [], [], []
for _ in range(runs):
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    runner.run(steps)
    seconds, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    wall.append(seconds / steps * 1e3)
    faults.append((after.ru_minflt - before.ru_minflt) / steps)
    system.append((after.ru_stime - before.ru_stime) / steps * 1e3)
print(json.dumps({"ms": statistics.median(wall), "faults": statistics.median(faults),
                  "system_ms": statistics.median(system),
                  "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="pool1", choices=["pool1", "pool20"],
                        help="bench_e2e's configuration to train (default pool1)")
    parser.add_argument("--pairs", type=at_least(1), default=4,
                        help="processes of each variant, alternating off, on, off, on, ... (default 4)")
    parser.add_argument("--runs", type=at_least(1), default=12,
                        help="timed runs in each process, after a warm-up of 6 steps; medians (default 12)")
    parser.add_argument("--steps", type=at_least(1), default=5, help="training steps per timed run (default 5)")
    parser.add_argument("--threads", type=at_least(1), default=os.cpu_count() or 1,
                        help="torch intra-op threads of each process (default: the cores)")
    args = parser.parse_args(argv)
    here = os.path.dirname(os.path.abspath(__file__))
    results = {"off": [], "on": []}
    print(f"{args.config}, 1 process, {args.threads} threads; per process: medians of {args.runs} runs of "
          f"{args.steps} steps")
    for _ in range(args.pairs):
        for label, flag in (("off", "0"), ("on", "1")):
            out = subprocess.run([sys.executable, "-c", WORKER, here, args.config, flag, str(args.threads),
                                  str(args.runs), str(args.steps)], capture_output=True, text=True)
            if out.returncode != 0:
                sys.stderr.write(out.stderr)
                print(f"bench_allocator: the reuse_freed_memory {label} process failed (exit {out.returncode}); "
                      "its stderr is above", file=sys.stderr)
                return 1
            r = json.loads(out.stdout.strip().splitlines()[-1])
            results[label].append(r)
            print(f"  reuse_freed_memory {label:3}: {r['ms']:6.1f} ms/step  {r['faults']:7.0f} faults/step  "
                  f"{r['system_ms']:5.2f} ms system/step  max RSS {r['max_rss_mb']:.0f} MB", flush=True)
    pairs = [on["ms"] / off["ms"] for off, on in zip(results["off"], results["on"])]
    print(f"on / off, per pair: {[round(p, 3) for p in pairs]}, median {statistics.median(pairs):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
