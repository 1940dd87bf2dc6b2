"""Check-N-Run checkpoint benchmark: bytes written per checkpoint (full vs incremental vs
incremental + quantized rows) on Zipf-skewed synthetic training at several checkpoint intervals,
the storage capacity the restorable chain takes, NE after restoring quantized checkpoints vs fp32,
and the step-time cost of modified-row tracking in the fused embedding backward.

Run (from the repository root, venv active; a few minutes on 2 cores):

    python benchmarks/bench_checkpoint.py --out benchmarks/results/bench_checkpoint.json
    python benchmarks/bench_checkpoint.py --quick          # smoke run
    python benchmarks/bench_checkpoint.py --tracking-only --repeats 15   # step time, tracking off / on

Modes (every run trains the same deterministic model; only the checkpoints differ):
  full        every checkpoint writes all rows (fp32)
  incr        incremental: rows modified since the previous checkpoint; a full one when the
              increments since the last full would exceed ``--fraction`` of a full one
  incr+q8/q4  incremental with rows quantized to 8 / 4 bits (per-row min/max)
"Write" = mean bytes written per checkpoint (all files); "capacity" = mean over checkpoints of the
bytes of the chain needed to restore it (full + increments).
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import torch

from neorec.config import load_config
from neorec.train.checkpoint import verify_checkpoint
from neorec.train.trainer import Trainer

from bench_args import at_least, check_out, list_of  # same folder (run as a script)

MODES = {"full": (False, 32), "incr": (True, 32), "incr+q8": (True, 8), "incr+q4": (True, 4)}


def base_overrides(args) -> List[str]:
    return [
        f"data.synthetic.num_train_samples={args.steps * args.batch_size}", "data.synthetic.num_eval_samples=20000",
        f"data.batch_size={args.batch_size}", "data.eval_batch_size=4096", f"model.embedding_dim={args.dim}",
        f"model.dense_layers=[64, {args.dim}]", "model.over_layers=[64]", "train.progress=false", "train.epochs=1",
        "train.log_every_steps=1000", f"train.num_threads={args.threads}",
    ]


def run_mode(args, mode: str, interval: int, directory: Path) -> Dict:
    incremental, bits = MODES[mode]
    cfg = load_config(None, base_overrides(args) + [
        f"train.output_dir='{directory / 'out'}'", f"checkpoint.dir='{directory / 'ckpt'}'",
        f"checkpoint.every_steps={interval}", f"checkpoint.incremental={str(incremental).lower()}",
        f"checkpoint.row_bits={bits}", f"checkpoint.full_when_fraction_exceeds={args.fraction}",
        "checkpoint.keep_last=1000", "checkpoint.save_final=false"])
    trainer = Trainer(cfg, out=io.StringIO())
    trainer.evaluate = lambda max_batches=None: {"auc": 0.5, "ne": 1.0, "calibration": 1.0, "num_samples": 0,
                                                  "log_loss": 0.0}  # no eval in the timed part
    trainer.fit()
    records = trainer.checkpointer.bytes_written
    capacity = []
    for record in records:
        manifest = verify_checkpoint(directory / "ckpt" / f"step-{record['step']:09d}")
        capacity.append(sum(records_by_step(records)[int(name[5:])]["total_bytes"] for name in manifest["chain"]))
    return {"mode": mode, "interval": interval, "checkpoints": len(records),
            "full_checkpoints": sum(r["kind"] == "full" for r in records),
            "write_bytes": statistics.mean(r["total_bytes"] for r in records),
            "embedding_write_bytes": statistics.mean(r["embedding_bytes"] for r in records),
            "capacity_bytes": statistics.mean(capacity)}


def records_by_step(records):
    return {r["step"]: r for r in records}


def quantized_ne(args, directory: Path) -> List[Dict]:
    """Train, checkpoint at the end with 32/8/4/2-bit rows, restore each and evaluate; then train
    ``--after`` more steps from each restored model and evaluate again."""
    results = []
    total = args.steps + args.after
    for bits in (32, 8, 4, 2):
        common = base_overrides(args) + [f"data.synthetic.num_train_samples={total * args.batch_size}",
                                         f"checkpoint.row_bits={bits}", f"checkpoint.dir='{directory / f'q{bits}'}'"]
        first = Trainer(load_config(None, common + [f"train.max_steps={args.steps}",
                                                    f"train.output_dir='{directory / 'a'}'"]), out=io.StringIO())
        first.fit()
        restored = Trainer(load_config(None, common + [f"train.max_steps={total}",
                                                       f"train.output_dir='{directory / 'b'}'"]),
                           out=io.StringIO(), resume=str(directory / f"q{bits}"))
        restored.checkpointer.start(restored.resume, 10**9)
        at_restore = restored.evaluate()
        restored.checkpointer.root = None  # no more saving
        final = restored.fit()
        results.append({"row_bits": bits, "ne_at_restore": at_restore["ne"], "auc_at_restore": at_restore["auc"],
                        "ne_after_more_steps": final.final_eval["ne"], "steps_after": args.after})
    return results


def tracking_overhead(args) -> Dict:
    """Training-step time of the fused module with modified-row tracking off / on, alternating."""
    from neorec.embedding import SparseOptimizerConfig, TableBatchedEmbeddingBags, TableConfig
    from neorec.sparse import KeyedJaggedTensor

    generator = torch.Generator().manual_seed(0)
    tables = [TableConfig(f"t{i}", 100_000, 64, [f"f{i}"]) for i in range(8)]
    tbe = TableBatchedEmbeddingBags(tables, SparseOptimizerConfig(kind="rowwise_adagrad"))
    batch, pooling = 2048, 20
    ranks = torch.arange(1, 100_001, dtype=torch.float64)
    probabilities = ranks.pow(-1.05)
    ids = torch.multinomial(probabilities / probabilities.sum(), 8 * batch * pooling, replacement=True,
                            generator=generator)
    kjt = KeyedJaggedTensor([t.feature_names[0] for t in tables], ids, torch.full((8 * batch,), pooling))
    timings = {"off": [], "on": []}
    for _ in range(args.repeats):
        for mode in ("off", "on"):
            tbe.track_modified_rows(mode == "on")
            tbe(kjt).values.sum().backward()  # warm
            start = time.perf_counter()
            for _ in range(5):
                tbe(kjt).values.sum().backward()
            timings[mode].append((time.perf_counter() - start) / 5)
    off, on = statistics.median(timings["off"]), statistics.median(timings["on"])
    return {"step_ms_off": off * 1e3, "step_ms_on": on * 1e3, "ratio_on_off": on / off, "repeats": args.repeats,
            "tables": "8 x 100000 x 64, rowwise_adagrad, batch 2048, pooling 20, Zipf 1.05"}


def bytes_and_ne(args, intervals: List[int], tmp: Path, results: Dict) -> None:
    print(f"{'interval':>8} {'mode':>8} {'ckpts':>5} {'fulls':>5} {'write MB':>9} {'x less':>7} "
          f"{'capacity MB':>11} {'x less':>7}")
    for interval in intervals:
        full = None
        for mode in MODES:
            row = run_mode(args, mode, interval, tmp / f"{mode}-{interval}")
            full = full or row
            row["write_reduction"] = full["write_bytes"] / row["write_bytes"]
            row["capacity_reduction"] = full["capacity_bytes"] / row["capacity_bytes"]
            results["bytes"].append(row)
            print(f"{interval:>8} {mode:>8} {row['checkpoints']:>5} {row['full_checkpoints']:>5} "
                  f"{row['write_bytes'] / 1e6:>9.2f} {row['write_reduction']:>7.1f} "
                  f"{row['capacity_bytes'] / 1e6:>11.2f} {row['capacity_reduction']:>7.1f}", flush=True)
    print(f"\n{'row bits':>8} {'NE at restore':>13} {'AUC':>7} {'NE after ' + str(args.after) + ' steps':>18}")
    for row in quantized_ne(args, tmp / "ne"):
        results["quantized_ne"].append(row)
        print(f"{row['row_bits']:>8} {row['ne_at_restore']:>13.5f} {row['auc_at_restore']:>7.4f} "
              f"{row['ne_after_more_steps']:>18.5f}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=at_least(1), help="training steps per run (default 200; --quick 40)")
    parser.add_argument("--intervals", type=list_of(1), help="checkpoint every N steps (comma list, each at most "
                        "--steps; default 10,25,50; --quick 10,20)")
    parser.add_argument("--batch-size", type=at_least(1), default=512, help="samples per training step (default 512)")
    parser.add_argument("--dim", type=at_least(1), default=16, help="embedding dim")
    parser.add_argument("--fraction", type=float, default=1.0, help="checkpoint.full_when_fraction_exceeds")
    parser.add_argument("--after", type=at_least(0), help="steps trained after restoring (NE part; default 100; "
                        "--quick 20)")
    parser.add_argument("--repeats", type=at_least(1), help="alternating rounds of the tracking timing (default 7; "
                        "--quick 3)")
    parser.add_argument("--threads", type=at_least(0), default=0, help="torch intra-op threads (0 = default)")
    parser.add_argument("--quick", action="store_true", help="small run (smoke test): smaller defaults of "
                        "--steps, --intervals, --after and --repeats (options given keep their value)")
    parser.add_argument("--tracking-only", action="store_true", help="only the modified-row tracking timing")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    defaults = dict(steps=40, intervals=[10, 20], after=20, repeats=3) if args.quick else \
        dict(steps=200, intervals=[10, 25, 50], after=100, repeats=7)  # (--quick used to override given ones)
    intervals_given = args.intervals is not None
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    too_long = [interval for interval in args.intervals if interval > args.steps]
    if too_long and not args.tracking_only:  # no checkpoint in the run: "mean requires at least one data point"
        which = "--quick's" if args.quick else "the"
        given = "" if intervals_given else (f" ({which} default --intervals {','.join(map(str, args.intervals))}: "
                                            f"give --intervals up to {args.steps}, or more --steps)")
        parser.error(f"argument --intervals: {too_long[0]} is more than --steps {args.steps}, so no checkpoint would "
                     f"be taken{given}")
    check_out(parser, args.out)
    intervals = args.intervals
    results: Dict = {"machine": platform.platform(), "python": sys.version.split()[0], "torch": torch.__version__,
                     "args": vars(args), "bytes": [], "quantized_ne": [], "tracking": {}}
    if not args.tracking_only:
        with tempfile.TemporaryDirectory() as tmp:
            bytes_and_ne(args, intervals, Path(tmp), results)
    tracking = tracking_overhead(args)
    results["tracking"] = tracking
    print(f"\nmodified-row tracking: step {tracking['step_ms_off']:.2f} ms off, {tracking['step_ms_on']:.2f} ms on "
          f"(ratio {tracking['ratio_on_off']:.3f}; {tracking['tables']})")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
