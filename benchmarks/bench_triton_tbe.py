"""GPU benchmark of the Triton table-batched embedding kernels against torch, side by side.

Phases: ``forward`` (pooled lookup of all tables) and ``step`` (forward + backward + row-wise
AdaGrad update of every touched row). Contenders, alternated A, B, C, D, A, B, ... ``--repeats``
times, each timing ``--steps`` consecutive calls with CUDA events; medians and ratios:

- ``triton_fp32`` / ``triton_fp16``: ``neorec.embedding.kernels.triton_tbe`` on fp32 / fp16 weights
  (one forward launch over all tables; backward = row sort + one fused gradient/update launch);
- ``torch_per_table``: one CUDA ``nn.EmbeddingBag(mode="sum", sparse=True)`` per table, outputs
  concatenated; step: sparse gradients, coalesced, hand-written row-wise AdaGrad per table;
- ``torch_concat``: all tables in one [total_rows, dim] weight, ids shifted by their table's first
  row, one ``F.embedding_bag``; step as above on the one sparse gradient.

Configurations mirror ``bench_tbe.py``'s (pool1, pool20, pool10) scaled up to batch 65536 and
1M-row tables (one dim per configuration); ids are Zipf(1.05) over rows (hot rows scattered).
Achieved bandwidth = ideal bytes / median time, against the measured device-to-device copy
bandwidth (read + write of a 1 GiB tensor). Ideal bytes: forward reads N rows (N * dim * elem) and
N ids, writes [B, F * dim] fp32; the step adds one read of grad_output and of the ids, and a read +
write of each of the U unique rows and its state value.

Run on a CUDA machine (repository root, venv active, ``pip install -e '.[gpu]'``):

    python benchmarks/bench_triton_tbe.py --out benchmarks/results/bench_triton_tbe.json
    python benchmarks/bench_triton_tbe.py --configs pool20 --repeats 7

Without CUDA it says so and exits 2 (nothing measured). ``--smoke`` runs every code path on CPU
at tiny sizes in triton's interpreter (timings meaningless); a smoke run writes no JSON unless
``--out`` names a file (the default is the committed GPU results):

    python benchmarks/bench_triton_tbe.py --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

from bench_args import at_least, check_out  # same folder (run as a script)

LEARNING_RATE, EPS = 0.05, 1e-8


@dataclass
class BenchConfig:
    name: str
    num_tables: int
    num_rows: int
    dim: int
    batch_size: int
    pooling: int  # mean ids per bag (exactly 1 when 1)
    zipf_alpha: float = 1.05


CONFIGS = {
    "pool1": BenchConfig("pool1", 26, 1_000_000, 64, 65536, 1),
    "pool20": BenchConfig("pool20", 16, 1_000_000, 64, 65536, 20),
    "pool10": BenchConfig("pool10", 8, 1_000_000, 128, 65536, 10),
}
SMOKE = {name: BenchConfig(c.name, 2, 300, 16, 8, c.pooling) for name, c in CONFIGS.items()}


@dataclass
class Batch:
    indices: torch.Tensor  # [N] int64 table-local ids, key-major
    offsets: torch.Tensor  # [T * B + 1] int64
    global_indices: torch.Tensor  # [N] ids + table's first row (for the concatenated path)
    table_indices: List[torch.Tensor]  # per table [N_t]
    table_offsets: List[torch.Tensor]  # per table [B + 1], starting at 0
    num_unique_rows: int


def make_batch(config: BenchConfig, device: torch.device, generator: torch.Generator) -> Batch:
    num_bags = config.num_tables * config.batch_size
    if config.pooling == 1:
        lengths = torch.ones(num_bags, dtype=torch.int64, device=device)
    else:
        lengths = torch.randint(1, 2 * config.pooling, (num_bags,), device=device, generator=generator)
    ranks = torch.arange(1, config.num_rows + 1, dtype=torch.float64, device=device)
    cdf = torch.cumsum(ranks.pow(-config.zipf_alpha), 0)
    cdf /= cdf[-1].clone()
    per_table = lengths.view(config.num_tables, config.batch_size).sum(1).tolist()
    table_indices, table_offsets = [], []
    for table, count in enumerate(per_table):
        draws = torch.rand(count, dtype=torch.float64, device=device, generator=generator)
        rank = torch.searchsorted(cdf, draws).clamp_(max=config.num_rows - 1)
        scatter = torch.randperm(config.num_rows, device=device, generator=generator)
        table_indices.append(scatter[rank])
        table_lengths = lengths[table * config.batch_size : (table + 1) * config.batch_size]
        table_offsets.append(F.pad(torch.cumsum(table_lengths, 0), (1, 0)))
    indices = torch.cat(table_indices)
    offsets = F.pad(torch.cumsum(lengths, 0), (1, 0))
    row_starts = torch.arange(config.num_tables, device=device) * config.num_rows
    global_indices = indices + torch.repeat_interleave(row_starts, torch.tensor(per_table, device=device))
    return Batch(indices, offsets, global_indices, table_indices, table_offsets,
                 int(torch.unique(global_indices).numel()))


def ideal_bytes(config: BenchConfig, batch: Batch, element_size: int, phase: str) -> int:
    num_values, cols = batch.indices.numel(), config.num_tables * config.dim
    forward = num_values * (config.dim * element_size + 8) + batch.offsets.numel() * 8 + config.batch_size * cols * 4
    if phase == "forward":
        return forward
    return forward + config.batch_size * cols * 4 + num_values * 8 + batch.num_unique_rows * 2 * (config.dim * element_size + 4)


def rowwise_adagrad_sparse(weight: torch.Tensor, state: torch.Tensor) -> None:
    """Row-wise AdaGrad on ``weight.grad`` (sparse COO), the torch baseline's update."""
    grad = weight.grad.coalesce()
    rows, values = grad.indices()[0], grad.values()
    accumulated = state.index_select(0, rows).add_(values.pow(2).mean(1))
    state.index_copy_(0, rows, accumulated)
    weight.data.index_add_(0, rows, values * (-LEARNING_RATE / (accumulated.sqrt() + EPS)).unsqueeze(1))
    weight.grad = None


def build_contenders(config: BenchConfig, device: torch.device, batches: List[Batch]) -> Dict[str, Dict[str, Callable]]:
    from neorec.embedding.kernels import TableBatchedLayout
    from neorec.embedding.kernels.triton_tbe import tbe_backward_update, tbe_forward

    generator = torch.Generator(device=device).manual_seed(1)
    total_rows = config.num_tables * config.num_rows
    layout = TableBatchedLayout.build(
        [config.dim] * config.num_tables, [config.num_rows] * config.num_tables,
        list(range(config.num_tables)), [False] * config.num_tables, device=device,
    )
    master = torch.rand(total_rows * config.dim, device=device, generator=generator).sub_(0.5).mul_(0.01)
    grad_output = torch.randn(config.batch_size, layout.total_cols, device=device, generator=generator)

    def triton_path(dtype: torch.dtype):
        weights = master.to(dtype)
        state = torch.zeros(total_rows, device=device)
        steps_taken = [0]

        def forward(b: Batch):
            return tbe_forward(weights, layout, b.indices, b.offsets, config.batch_size, check_ids=False)

        def step(b: Batch):
            steps_taken[0] += 1
            tbe_forward(weights, layout, b.indices, b.offsets, config.batch_size, check_ids=False)
            tbe_backward_update("rowwise_adagrad", weights, state, layout, b.indices, b.offsets, config.batch_size,
                                grad_output, learning_rate=LEARNING_RATE, eps=EPS, seed=steps_taken[0],
                                check_ids=False)
        return {"forward": forward, "step": step}

    def per_table_path():
        bags = [torch.nn.EmbeddingBag(config.num_rows, config.dim, mode="sum", sparse=True).to(device)
                for _ in range(config.num_tables)]
        for t, bag in enumerate(bags):
            bag.weight.data.copy_(master[t * config.num_rows * config.dim : (t + 1) * config.num_rows * config.dim]
                                  .view(config.num_rows, config.dim))
        states = [torch.zeros(config.num_rows, device=device) for _ in bags]

        def pooled(b: Batch) -> torch.Tensor:
            return torch.cat([bag(i, o[:-1]) for bag, i, o in zip(bags, b.table_indices, b.table_offsets)], dim=1)

        def forward(b: Batch):
            with torch.no_grad():
                return pooled(b)

        def step(b: Batch):
            pooled(b).backward(grad_output)
            for bag, state in zip(bags, states):
                rowwise_adagrad_sparse(bag.weight, state)
        return {"forward": forward, "step": step}

    def concat_path():
        weight = torch.nn.Parameter(master.view(total_rows, config.dim).clone())
        state = torch.zeros(total_rows, device=device)

        def pooled(b: Batch) -> torch.Tensor:
            out = F.embedding_bag(b.global_indices, weight, b.offsets[:-1], mode="sum", sparse=True)
            return out.view(config.num_tables, config.batch_size, config.dim).transpose(0, 1).reshape(config.batch_size, -1)

        def forward(b: Batch):
            with torch.no_grad():
                return pooled(b)

        def step(b: Batch):
            pooled(b).backward(grad_output)
            rowwise_adagrad_sparse(weight, state)
        return {"forward": forward, "step": step}

    return {"triton_fp32": triton_path(torch.float32), "triton_fp16": triton_path(torch.float16),
            "torch_per_table": per_table_path(), "torch_concat": concat_path()}


def timed(function: Callable, steps: int, device: torch.device, batches: List = (None,)) -> float:
    """Milliseconds per call over ``steps`` calls, cycling through ``batches``."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for call in range(steps):
            function(batches[call % len(batches)])
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / steps
    began = time.perf_counter()
    for call in range(steps):
        function(batches[call % len(batches)])
    return (time.perf_counter() - began) * 1e3 / steps


def copy_bandwidth(device: torch.device, num_bytes: int, repeats: int) -> float:
    """Measured device copy bandwidth in GB/s (read + write)."""
    source = torch.empty(num_bytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    target = torch.empty_like(source)
    target.copy_(source)
    times = [timed(lambda _: target.copy_(source), 5, device) for _ in range(repeats)]
    return 2 * source.numel() * 4 / (statistics.median(times) * 1e-3) / 1e9


def timing_device(script: str, smoke: bool, tests: str) -> torch.device | None:
    """The device a GPU-kernel benchmark times on: the CPU in triton's interpreter with ``--smoke``
    (code paths only), CUDA otherwise; None, after saying why, without CUDA or without triton."""
    if smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print(f"{script}: no CUDA device here; this benchmark times GPU kernels and needs one. "
              f"(The kernels' correctness is checked on CPU by `python -m pytest {tests}`; "
              "`--smoke` runs this script's code paths on CPU in triton's interpreter.)", file=sys.stderr)
        return None
    else:
        device = torch.device("cuda")
    from neorec.embedding.kernels import triton_available

    if not triton_available():
        print(f"{script}: triton is not installed (pip install -e '.[gpu]')", file=sys.stderr)
        return None
    return device


RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")  # from any working directory


def output_path(out: str | None, smoke: bool, name: str) -> str | None:
    """Where a GPU-kernel benchmark writes its JSON: ``--out`` when given; else, for a full run,
    ``benchmarks/results/NAME.json`` of this repository; a ``--smoke`` run without ``--out``
    writes nothing (its CPU interpreter timings must not replace the committed GPU results)."""
    if out:
        return out
    return None if smoke else os.path.join(RESULTS_DIR, f"{name}.json")


def check_forward(contenders, batch: Batch) -> float:
    """Max abs difference between the Triton fp32 forward and the concatenated torch forward."""
    triton_output = contenders["triton_fp32"]["forward"](batch)
    return float((triton_output - contenders["torch_concat"]["forward"](batch)).abs().max())


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS),
                        help=f"configurations to run, from {', '.join(CONFIGS)} (default: all)")
    parser.add_argument("--repeats", type=at_least(1), default=5,
                        help="alternating rounds of the contenders per phase, medians over them (default 5; --smoke 1)")
    parser.add_argument("--steps", type=at_least(1), default=10,
                        help="consecutive calls in each timed sample (default 10; --smoke 1)")
    parser.add_argument("--num-batches", type=at_least(1), default=4,
                        help="distinct batches per configuration, cycled through by the calls (default 4; --smoke 2)")
    parser.add_argument("--out", default=None,
                        help="results JSON (default: benchmarks/results/bench_triton_tbe.json of this repository; "
                             "with --smoke, nothing is written unless --out is given)")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, triton interpreter: code paths only")
    args = parser.parse_args(argv)
    args.out = output_path(args.out, args.smoke, "bench_triton_tbe")
    check_out(parser, args.out)

    device = timing_device("bench_triton_tbe", args.smoke, "tests/gpu")
    if device is None:
        return 2  # nothing measured: not a success for a script checking exit codes
    configs = SMOKE if args.smoke else CONFIGS
    if args.smoke:
        args.repeats, args.steps, args.num_batches = 1, 1, 2
    import triton

    copy_gbs = copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (1 << 24), args.repeats)
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke, interpreter)",
               "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
               "copy_bandwidth_gbs": copy_gbs, "args": vars(args), "configs": {}}
    print(f"device {results['device']}; measured copy bandwidth {copy_gbs:.0f} GB/s")
    print(f"{'config':8} {'phase':8} {'contender':16} {'median ms':>10} {'GB/s':>8} {'% copy':>7} {'vs triton_fp32':>15}")
    for name in args.configs:
        config = configs[name]
        generator = torch.Generator(device=device).manual_seed(0)
        batches = [make_batch(config, device, generator) for _ in range(args.num_batches)]
        contenders = build_contenders(config, device, batches)
        entry = {"config": asdict(config), "forward_max_abs_diff": check_forward(contenders, batches[0]),
                 "num_values": batches[0].indices.numel(), "num_unique_rows": batches[0].num_unique_rows, "phases": {}}
        for phase in ("forward", "step"):
            times: Dict[str, List[float]] = {c: [] for c in contenders}
            for c in contenders:  # warm-up: compile, allocate
                timed(contenders[c][phase], 1, device, batches)
            for _ in range(args.repeats):
                for c in contenders:
                    times[c].append(timed(contenders[c][phase], args.steps, device, batches))
            medians = {c: statistics.median(t) for c, t in times.items()}
            rows = {}
            for c, median in medians.items():
                element_size = 2 if c == "triton_fp16" else 4
                gbs = ideal_bytes(config, batches[0], element_size, phase) / (median * 1e-3) / 1e9
                rows[c] = {"median_ms": median, "times_ms": times[c], "achieved_gbs": gbs,
                           "fraction_of_copy": gbs / copy_gbs, "time_vs_triton_fp32": median / medians["triton_fp32"]}
                print(f"{name:8} {phase:8} {c:16} {median:10.3f} {gbs:8.0f} {100 * gbs / copy_gbs:6.1f}% "
                      f"{median / medians['triton_fp32']:14.2f}x")
            entry["phases"][phase] = rows
        results["configs"][name] = entry
        del contenders, batches
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.smoke:
        print("smoke run: code paths checked on CPU; timings are meaningless")
    if args.out is None:
        print("not written (a smoke run writes its JSON only where --out says)")
        return 0
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(results, handle, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
