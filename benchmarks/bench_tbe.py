"""Training-step time of the fused TableBatchedEmbeddingBags against two peers, side by side.

One step = forward + backward + row-wise AdaGrad update of every touched row, fp32 weights, sum
pooling, Zipf-distributed ids. Contenders (each run is ``--steps`` steps; runs alternate
neorec, loop, fbgemm, neorec, loop, fbgemm, ... ``--repeats`` times; medians and ratios):

- ``neorec``: ``neorec.embedding.TableBatchedEmbeddingBags`` as users get it (``kernel="auto"``: the
  native C kernels on CPU, ``neorec/native/tbe.c``; one fused op, optimizer in backward);
- ``neorec_torch``: the same module on its torch-ops path (``kernel="torch"``);
- ``loop``:   one ``nn.EmbeddingBag(sparse=True)`` per table + a hand-written row-wise AdaGrad;
- ``fbgemm``: fbgemm_gpu's CPU TBE (``SplitTableBatchedEmbeddingBagsCodegen``, EmbeddingLocation.HOST,
  ComputeDevice.CPU, EXACT_ROWWISE_ADAGRAD), when importable (see requirements-peers.txt).

Run (from the repository root, venv active; about 4 minutes on 2 cores):

    python benchmarks/bench_tbe.py --out /tmp/tbe.json   # RESULTS.md names each recorded run's file

    python benchmarks/bench_tbe.py --quick                          # smoke run, small tables
    python benchmarks/bench_tbe.py --configs pool20 --repeats 11    # one config
    python benchmarks/bench_tbe.py --threads 1                      # one intra-op thread each
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional

import torch
from torch import nn

from neorec.embedding import SparseOptimizerConfig, TableBatchedEmbeddingBags, TableConfig
from neorec.sparse import KeyedJaggedTensor

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
    "pool1": BenchConfig("pool1", 26, 100_000, 64, 2048, 1),
    "pool20": BenchConfig("pool20", 16, 200_000, 64, 1024, 20),
    "pool10": BenchConfig("pool10", 8, 500_000, 128, 2048, 10),
}
QUICK = {name: BenchConfig(c.name, c.num_tables, c.num_rows // 20, c.dim, c.batch_size // 4, c.pooling)
         for name, c in CONFIGS.items()}


def make_batches(config: BenchConfig, count: int, seed: int = 0) -> List[KeyedJaggedTensor]:
    """``count`` KJTs with keys f0..f{T-1}; ids Zipf(alpha) over rows, hot rows scattered by a
    fixed permutation per table; lengths 1 (pooling 1) or uniform in [1, 2 * pooling - 1]."""
    generator = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, config.num_rows + 1, dtype=torch.float64)
    cdf = torch.cumsum(ranks.pow(-config.zipf_alpha), 0)
    cdf /= cdf[-1].clone()
    scatter = [torch.randperm(config.num_rows, generator=generator) for _ in range(config.num_tables)]
    batches = []
    for _ in range(count):
        num_bags = config.num_tables * config.batch_size
        if config.pooling == 1:
            lengths = torch.ones(num_bags, dtype=torch.int64)
        else:
            lengths = torch.randint(1, 2 * config.pooling, (num_bags,), generator=generator)
        per_table = lengths.view(config.num_tables, config.batch_size).sum(1).tolist()
        values = []
        for table, n in enumerate(per_table):
            rank = torch.searchsorted(cdf, torch.rand(n, generator=generator, dtype=torch.float64))
            values.append(scatter[table][rank.clamp_(max=config.num_rows - 1)])
        keys = [f"f{t}" for t in range(config.num_tables)]
        batches.append(KeyedJaggedTensor(keys, torch.cat(values), lengths))
    return batches


# ---------------------------------------------------------------------------------- contenders
def neorec_step(config: BenchConfig, kernel: str = "auto") -> Callable[[KeyedJaggedTensor, torch.Tensor], None]:
    tables = [TableConfig(f"t{t}", config.num_rows, config.dim, [f"f{t}"]) for t in range(config.num_tables)]
    module = TableBatchedEmbeddingBags(tables, SparseOptimizerConfig("rowwise_adagrad", LEARNING_RATE, eps=EPS),
                                       kernel=kernel)

    def step(kjt: KeyedJaggedTensor, grad: torch.Tensor) -> None:
        module(kjt).values.backward(grad)

    return step


def loop_step(config: BenchConfig) -> Callable[[KeyedJaggedTensor, torch.Tensor], None]:
    bags = [nn.EmbeddingBag(config.num_rows, config.dim, mode="sum", sparse=True) for _ in range(config.num_tables)]
    for bag in bags:
        bound = (1.0 / config.num_rows) ** 0.5
        nn.init.uniform_(bag.weight, -bound, bound)
    states = [torch.zeros(config.num_rows) for _ in bags]

    def step(kjt: KeyedJaggedTensor, grad: torch.Tensor) -> None:
        pooled = []
        for t, bag in enumerate(bags):
            jagged = kjt[f"f{t}"]
            pooled.append(bag(jagged.values, jagged.offsets()[:-1]))
        torch.cat(pooled, dim=1).backward(grad)
        with torch.no_grad():
            for bag, state in zip(bags, states):
                sparse = bag.weight.grad.coalesce()
                rows, g = sparse.indices()[0], sparse.values()
                row_state = state.index_select(0, rows).add_(g.pow(2).mean(1))
                state.index_copy_(0, rows, row_state)
                bag.weight.index_add_(0, rows, g * (-LEARNING_RATE / (row_state.sqrt() + EPS)).unsqueeze(1))
                bag.weight.grad = None

    return step


def fbgemm_available() -> Optional[str]:
    try:
        import fbgemm_gpu  # noqa: F401
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (  # noqa: F401
            SplitTableBatchedEmbeddingBagsCodegen,
        )
    except Exception as error:  # ImportError, or an ABI mismatch with the installed torch
        print(f"fbgemm_gpu not usable ({type(error).__name__}: {error}); skipping it", file=sys.stderr)
        return None
    return getattr(fbgemm_gpu, "__version__", "unknown")


def fbgemm_step(config: BenchConfig) -> Callable[[KeyedJaggedTensor, torch.Tensor], None]:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import ComputeDevice, EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

    specs = [(config.num_rows, config.dim, EmbeddingLocation.HOST, ComputeDevice.CPU)] * config.num_tables
    module = SplitTableBatchedEmbeddingBagsCodegen(
        specs, optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=LEARNING_RATE, eps=EPS,
        pooling_mode=PoolingMode.SUM,
    )
    bound = (1.0 / config.num_rows) ** 0.5
    with torch.no_grad():
        for weight in module.split_embedding_weights():
            weight.uniform_(-bound, bound)

    def step(kjt: KeyedJaggedTensor, grad: torch.Tensor) -> None:
        module(kjt.values, kjt.offsets()).backward(grad)

    return step


# ---------------------------------------------------------------------------------- timing
def contenders_kernel(config: BenchConfig) -> str:
    """The path ``kernel="auto"`` takes here ("native", or "torch" when the C kernels cannot build)."""
    tables = [TableConfig("t", 8, config.dim)]
    return TableBatchedEmbeddingBags(tables, SparseOptimizerConfig("rowwise_adagrad")).kernel_path()


def bench_config(config: BenchConfig, repeats: int, steps: int, warmup: int, use_fbgemm: bool) -> Dict:
    batches = make_batches(config, count=4)
    grads = [torch.randn(config.batch_size, config.num_tables * config.dim, generator=torch.Generator().manual_seed(i))
             for i in range(len(batches))]
    builders = {"neorec": neorec_step, "neorec_torch": lambda c: neorec_step(c, "torch"), "loop": loop_step}
    if use_fbgemm:
        builders["fbgemm"] = fbgemm_step
    contenders = {name: build(config) for name, build in builders.items()}
    counter = {name: 0 for name in contenders}

    def run(name: str, count: int) -> float:
        start = time.perf_counter()
        for _ in range(count):
            i = counter[name] % len(batches)
            contenders[name](batches[i], grads[i])
            counter[name] += 1
        return (time.perf_counter() - start) / count * 1e3

    for name in contenders:
        if warmup:
            run(name, warmup)
    times: Dict[str, List[float]] = {name: [] for name in contenders}
    for _ in range(repeats):
        for name in contenders:  # A, B, C, A, B, C ...
            times[name].append(run(name, steps))
    medians = {name: statistics.median(values) for name, values in times.items()}
    result = {
        "config": asdict(config),
        "num_ids_per_batch": [b.values.numel() for b in batches],
        "median_ms": medians,
        "all_ms": times,
        "ratios": {f"neorec/{name}": medians["neorec"] / medians[name] for name in medians if name != "neorec"},
        "kernel": contenders_kernel(config),
    }
    contenders.clear()  # frees the modules (the timing closure keeps the dict)
    gc.collect()
    return result


def machine() -> Dict:
    info = {
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu_model"] = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    except OSError:
        pass
    return info


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {list(CONFIGS)}")
    parser.add_argument("--repeats", type=at_least(1), default=None,
                        help="alternating rounds per contender (default 7; --quick 3)")
    parser.add_argument("--steps", type=at_least(1), default=3, help="training steps per timed run")
    parser.add_argument("--warmup", type=at_least(0), default=2, help="untimed steps per contender first")
    parser.add_argument("--quick", action="store_true",
                        help="small tables and 3 repeats unless --repeats is given (smoke test)")
    parser.add_argument("--threads", type=at_least(1), default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--no-fbgemm", action="store_true", help="skip fbgemm_gpu even if importable")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    table = QUICK if args.quick else CONFIGS
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in table]
    if unknown:
        parser.error(f"unknown configs {unknown}; choose from {list(table)}")
    if not names:
        parser.error(f"argument --configs: no config named; choose from {list(table)}")
    check_out(parser, args.out)
    repeats = args.repeats if args.repeats is not None else 3 if args.quick else 7  # a given --repeats wins
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    fbgemm_version = None if args.no_fbgemm else fbgemm_available()
    report = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "machine": machine(),
              "fbgemm_gpu": fbgemm_version, "repeats": repeats, "steps_per_run": args.steps, "results": []}
    names_shown = ["neorec", "neorec_torch", "loop", "fbgemm"]
    header = f"{'config':8} {'T x rows, dim':>18} {'B':>5} {'L':>3} | " + " ".join(
        f"{n + ' ms':>15}" for n in names_shown) + " | fbgemm/neorec neorec_torch/neorec"
    print(header)
    print("-" * len(header))
    for name in names:
        config = table[name]
        result = bench_config(config, repeats, args.steps, args.warmup, fbgemm_version is not None)
        report["results"].append(result)
        med = result["median_ms"]
        cells = " ".join(f"{med[n]:15.2f}" if n in med else f"{'-':>15}" for n in names_shown)
        fb = f"{med['fbgemm'] / med['neorec']:.2f}" if "fbgemm" in med else "-"
        print(f"{name:8} {f'{config.num_tables} x {config.num_rows}, {config.dim}':>18} {config.batch_size:5} "
              f"{config.pooling:3} | {cells} | {fb:>13} {med['neorec_torch'] / med['neorec']:>18.2f}", flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
