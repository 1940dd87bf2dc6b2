"""Machine floors for the end-to-end DLRM benchmark (bench_e2e.py): what this machine can do at best.

Measures, for 1 thread and for all cores:

- sgemm rate on the DLRM's own matrix shapes (forward, and the two backward products of each
  ``nn.Linear``), so the dense part's floor is FLOPs / measured rate, not a datasheet peak; and
  the same with the interaction width rounded up to a multiple of 8 (415 -> 416 at pool1), to show
  what an odd width costs the GEMM library;
- the core's peak FMA rate (``fma_peak.c``, AVX2 + FMA machines with a C compiler), to say how
  close the GEMMs run to the hardware;
- streaming copy bandwidth (a 256 MiB ``copy_``, warm buffers);
- random 256-byte row reads from an 800 MiB table (``index_select``), on 4 KiB pages and on
  transparent huge pages (``neorec.embedding.memory.empty_huge``),

then prints, per bench_e2e configuration, a floor of one training step: the dense FLOPs at the
measured GEMM rate, plus the embedding part: every distinct row of the batch fetched once at the
measured random-read cost on huge pages (repeated ids of hot rows are served from cache; the
update's write of a row follows its read) and the pooled output and its gradient streamed at the
copy bandwidth. The interaction, activations and optimizers are left out, so real steps are above
it.

Run (repository root, venv active; about a minute):

    python benchmarks/bench_floor.py --out benchmarks/results/bench_floor.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_args import check_out  # noqa: E402
from bench_e2e import BOTTOM, CONFIGS, NUM_DENSE, TOP  # noqa: E402  (same model as the benchmark)
from bench_tbe import BenchConfig, make_batches  # noqa: E402

from neorec.embedding.memory import empty_huge  # noqa: E402
from neorec.native.build import find_compiler  # noqa: E402
from neorec.planner.calibrate import median_seconds  # noqa: E402


def linear_shapes(num_features: int, dim: int, align: int = 1) -> List[tuple]:
    """(in, out) of every Linear of the benchmark's DLRM (the interaction width rounded up to a
    multiple of ``align``)."""
    interaction = dim + (num_features + 1) * num_features // 2
    interaction = -(-interaction // align) * align
    sizes = [NUM_DENSE] + BOTTOM + [dim]
    top = [interaction] + TOP + [1]
    return list(zip(sizes[:-1], sizes[1:])) + list(zip(top[:-1], top[1:]))


def gemm_step_seconds(batch: int, shapes: List[tuple]) -> Dict[str, float]:
    """Measured seconds of the forward (addmm), weight-gradient and input-gradient products."""
    total = {"forward": 0.0, "weight_grad": 0.0, "input_grad": 0.0, "flops": 0.0}
    for index, (fan_in, fan_out) in enumerate(shapes):
        x, w, b = torch.randn(batch, fan_in), torch.randn(fan_out, fan_in), torch.randn(fan_out)
        g = torch.randn(batch, fan_out)
        flops = 2.0 * batch * fan_in * fan_out
        total["forward"] += median_seconds(lambda: torch.addmm(b, x, w.t()))
        total["weight_grad"] += median_seconds(lambda: g.t().mm(x))
        total["flops"] += 2 * flops
        if index != 0:  # no gradient for the dense input
            total["input_grad"] += median_seconds(lambda: g.mm(w))
            total["flops"] += flops
    total["seconds"] = total["forward"] + total["weight_grad"] + total["input_grad"]
    total["gflops_per_s"] = total["flops"] / total["seconds"] / 1e9
    return total


def fma_peak_gflops(copies: int) -> Optional[float]:
    """Sum of the FMA rates of ``copies`` simultaneous single-thread probes (None when this is not
    an x86 machine with AVX2 + FMA and a C compiler)."""
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    compiler = find_compiler()
    if platform.machine() != "x86_64" or " avx2" not in flags or " fma" not in flags or compiler is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        binary = os.path.join(tmp, "fma_peak")
        source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fma_peak.c")
        subprocess.run([compiler, "-O2", "-mavx2", "-mfma", source, "-o", binary], check=True)
        probes = [subprocess.Popen([binary], stdout=subprocess.PIPE, text=True) for _ in range(copies)]
        return sum(float(p.communicate()[0].split()[0]) for p in probes)


def copy_bandwidth() -> float:
    source, target = torch.ones(64 << 20), torch.empty(64 << 20)
    seconds = median_seconds(lambda: target.copy_(source), repeats=5)
    return 2 * source.numel() * 4 / seconds  # read + write bytes per second


def random_row_ns(huge: bool, rows: int = 3_200_000, dim: int = 64, count: int = 113_000) -> float:
    table = empty_huge(rows * dim, torch.float32) if huge else torch.empty(rows * dim)
    table.fill_(1.0)
    table = table.view(rows, dim)
    out = torch.empty(count, dim)
    generator = torch.Generator().manual_seed(0)
    indices = [torch.randint(0, rows, (count,), generator=generator) for _ in range(4)]
    state = {"i": 0}

    def gather():
        state["i"] += 1
        torch.index_select(table, 0, indices[state["i"] % 4], out=out)

    return median_seconds(gather, repeats=7) / count * 1e9


def embedding_accesses(name: str) -> Dict[str, float]:
    """ids and unique rows per step of the bench_e2e configuration (bench_tbe's Zipf batches)."""
    c = CONFIGS[name]
    batch = make_batches(BenchConfig(name, c.num_tables, c.num_rows, c.dim, c.batch_size, int(c.pooling)), 1)[0]
    unique = 0
    for key in batch.keys():
        unique += int(torch.unique(batch[key].values).numel())
    return {"ids": batch.values.numel(), "unique_rows": unique}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="", help="write the results as JSON here (default: none)")
    args = parser.parse_args(argv)
    check_out(parser, args.out)
    cores = os.cpu_count() or 1
    report: Dict = {"torch": torch.__version__, "cpus": cores, "threads": {}}
    for threads in sorted({1, cores}):
        torch.set_num_threads(threads)
        entry: Dict = {"fma_peak_gflops_per_s": fma_peak_gflops(threads), "copy_bytes_per_s": copy_bandwidth(),
                       "random_row_ns_4k_pages": random_row_ns(False), "random_row_ns_huge_pages": random_row_ns(True)}
        for name, c in CONFIGS.items():
            gemm = gemm_step_seconds(c.batch_size, linear_shapes(c.num_tables, c.dim))
            gemm_aligned = gemm_step_seconds(c.batch_size, linear_shapes(c.num_tables, c.dim, align=8))
            access = embedding_accesses(name)
            row_ns = entry["random_row_ns_huge_pages"]
            embedding_seconds = access["unique_rows"] * row_ns * 1e-9 \
                + 2 * c.batch_size * c.num_tables * c.dim * 4 / entry["copy_bytes_per_s"]
            entry[name] = {"gemm": gemm, "gemm_width_aligned_to_8": gemm_aligned, **access,
                           "embedding_floor_s": embedding_seconds,
                           "step_floor_s": gemm["seconds"] + embedding_seconds}
        report["threads"][threads] = entry
        peak = entry["fma_peak_gflops_per_s"]
        print(f"threads {threads}: FMA peak {f'{peak:.0f} GFLOP/s' if peak else 'not measured'}, "
              f"copy {entry['copy_bytes_per_s'] / 1e9:.1f} GB/s, random 256 B row "
              f"{entry['random_row_ns_4k_pages']:.0f} ns (4 KiB pages) / {entry['random_row_ns_huge_pages']:.0f} ns "
              f"(huge pages)")
        for name in CONFIGS:
            e = entry[name]
            print(f"  {name}: dense GEMMs {e['gemm']['flops'] / 1e9:.2f} GFLOP at {e['gemm']['gflops_per_s']:.0f} GFLOP/s"
                  f" = {e['gemm']['seconds'] * 1e3:.1f} ms (interaction width aligned to 8:"
                  f" {e['gemm_width_aligned_to_8']['gflops_per_s']:.0f} GFLOP/s,"
                  f" {e['gemm_width_aligned_to_8']['seconds'] * 1e3:.1f} ms); embedding {e['ids']} ids, {e['unique_rows']} unique rows"
                  f" -> {e['embedding_floor_s'] * 1e3:.1f} ms; step floor {e['step_floor_s'] * 1e3:.1f} ms", flush=True)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
