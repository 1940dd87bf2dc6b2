"""The dot interaction behind a sharded collection (forward + backward): placing the received
column blocks into one [B, F * D] matrix and running the native kernel on it, against the kernel
reading the blocks in place (``ColumnBlocks``, ``dot_interaction_blocks``). Alternating in one
process, medians of ``--rounds``.

Shapes of bench_e2e's 2-rank runs, per rank: pool1 = 26 features of width 64, B 2048; pool20 = 16
features, B 1024; the features dealt to the two ranks alternately (table-wise), so every feature
is its own run of the received buffer. Run (repository root, venv active):

    python benchmarks/bench_interaction_blocks.py --threads 1
    python benchmarks/bench_interaction_blocks.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from neorec.model.native_interaction import dot_interaction, dot_interaction_blocks
from neorec.native import native_available
from neorec.sharding.output_dist import part_runs
from neorec.sparse.column_blocks import ColumnBlocks

from bench_args import at_least  # same folder (run as a script)

SHAPES = {"pool1": (26, 2048), "pool20": (16, 1024)}
DIM = 64


WARMUP = 5  # rounds dropped before the medians


def rounds_arg(text: str) -> int:
    try:
        rounds = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if rounds <= WARMUP:
        raise argparse.ArgumentTypeError(f"must be more than {WARMUP} (the first {WARMUP} rounds are warm-up, "
                                         f"dropped): got {rounds}")
    return rounds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=at_least(1), default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--rounds", type=rounds_arg, default=40,
                        help=f"rounds per shape; the first {WARMUP} are warm-up and dropped, so at least "
                             f"{WARMUP + 1} (default 40)")
    args = parser.parse_args(argv)
    reason = native_available()
    if reason is not None:
        raise SystemExit(f"the native kernels are not available: {reason}")
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}, rounds {args.rounds} (first {WARMUP} dropped), ms per forward + backward")
    for name, (features, rows) in SHAPES.items():
        order = [f for rank in range(2) for f in range(features) if f % 2 == rank]  # what rank 0, then 1 sent
        widths = (sum(1 for f in order if f % 2 == 0) * DIM, sum(1 for f in order if f % 2 == 1) * DIM)
        columns = [order[i // DIM] * DIM + i % DIM for i in range(features * DIM)]
        runs = tuple(part_runs(columns, list(widths)))
        flat = torch.randn(rows * features * DIM, requires_grad=True)
        dense = torch.randn(rows, DIM, requires_grad=True)
        pairs = (features + 1) * features // 2
        upstream = torch.randn(rows, DIM + pairs)

        def placed():
            blocks = ColumnBlocks(flat, rows, widths, (), runs)
            dot_interaction(dense, blocks.materialize().view(rows, features, DIM), False).backward(upstream)

        def in_place():
            dot_interaction_blocks(dense, ColumnBlocks(flat, rows, widths, (), runs), False).backward(upstream)

        times = {placed: [], in_place: []}
        for _ in range(args.rounds):
            for fn in times:
                start = time.perf_counter()
                fn()
                times[fn].append(time.perf_counter() - start)
                flat.grad = dense.grad = None
        a, b = (statistics.median(times[fn][WARMUP:]) * 1e3 for fn in (placed, in_place))
        print(f"{name:7} placement + interaction {a:6.2f}   blocks read in place {b:6.2f}   saved {a - b:5.2f} ms "
              f"({(a - b) / a:.0%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
