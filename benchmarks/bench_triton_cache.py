"""GPU benchmark of the embedding cache's hot path: the Triton kernels of
``neorec/embedding/kernels/triton_cache.py`` against the cache's own torch ops, side by side.

Phases, each on one ``SetAssociativeCache`` state per configuration (about 90% of the slots
full, rows in their home sets, 5% of the ways pinned by a prefetch, random last uses and counts):

- ``find``: the tag lookup of ``--unique`` distinct ids (``--hit-fraction`` of them resident):
  ``SetAssociativeCache._find`` -> (slot or -1, home set) per id;
- ``place``: the victim choice for those ids' misses, grouped by set (several misses per set where
  the hash puts them together): ``_place`` -> slot or -1 per miss, pins set. The pins are restored
  before every call, outside the timed window.

Contenders, alternated torch, triton, torch, ... ``--repeats`` times, one call timed per sample
(CUDA events); medians and the ratio torch / triton (> 1: the kernel is faster). Both give the
same slots, checked once per configuration. "GB/s" counts the metadata bytes a call must touch at
least: find reads every id and the ``ways`` tags of its set and writes slot + set; place reads
the four int64 metadata words of each way of each set with misses and writes one slot per miss;
it is compared with the measured device copy bandwidth (read + write of a 1 GiB tensor).

Run on a CUDA machine (repository root, venv active, ``pip install -e '.[gpu]'``):

    python benchmarks/bench_triton_cache.py --out benchmarks/results/bench_triton_cache.json

Without CUDA it says so and exits 2 (nothing measured). ``--smoke`` runs every code path on CPU
at tiny sizes in triton's interpreter (timings meaningless); a smoke run writes no JSON unless
``--out`` names a file (the default is the committed GPU results):

    python benchmarks/bench_triton_cache.py --smoke
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

from bench_args import at_least, check_out
from bench_triton_tbe import copy_bandwidth, output_path, timing_device  # same folder (run as a script)


@dataclass
class CacheBenchConfig:
    name: str
    num_rows: int  # rows of the table behind the cache
    num_slots: int
    ways: int
    policy: str
    unique: int  # distinct ids per lookup
    hit_fraction: float = 0.8


CONFIGS = {
    "lru32": CacheBenchConfig("lru32", 20_000_000, 1 << 21, 32, "lru", 1 << 19),
    "lfu32": CacheBenchConfig("lfu32", 20_000_000, 1 << 21, 32, "lfu", 1 << 19),
    "lru8": CacheBenchConfig("lru8", 20_000_000, 1 << 21, 8, "lru", 1 << 19),
}
SMOKE = {name: CacheBenchConfig(c.name, 5000, 256, c.ways, c.policy, 96) for name, c in CONFIGS.items()}


def make_cache(config: CacheBenchConfig, device: torch.device, kernel: str, generator: torch.Generator):
    """A cache (1-column rows, no state) filled as the module doc says; returns (cache, ids)."""
    from neorec.embedding.cache import SetAssociativeCache
    from neorec.embedding.storage import DramRowStore

    store = DramRowStore(config.num_rows, 1, "fp32", {}, name=config.name)
    cache = SetAssociativeCache(store, torch.zeros(config.num_slots, 1, device=device), {}, ways=config.ways,
                                policy=config.policy, name=config.name, kernel=kernel)
    candidates = torch.randperm(config.num_rows, generator=generator)[: config.num_slots].to(device)
    homes = cache._home_sets(candidates.clone())
    order = torch.argsort(homes, stable=True)
    homes, candidates = homes[order], candidates[order]
    first = torch.searchsorted(homes, homes, right=False)
    rank = torch.arange(homes.numel(), device=device) - first
    keep = (rank < config.ways) & (torch.rand(homes.numel(), generator=generator).to(device) < 0.9)
    cache.slot_rows[homes[keep] * config.ways + rank[keep]] = candidates[keep]
    cache.last_use.copy_(torch.randint(0, 1000, (config.num_slots,), generator=generator))
    cache.counts.copy_(torch.randint(0, 50, (config.num_slots,), generator=generator))
    cache.completed = cache.generation = 1000
    pinned = torch.rand(config.num_slots, generator=generator) < 0.05
    cache.pinned_until.copy_(torch.where(pinned, 1001, 999))
    resident = cache.slot_rows[cache.slot_rows >= 0]
    num_hits = min(int(config.unique * config.hit_fraction), resident.numel())
    hits = resident[torch.randperm(resident.numel(), generator=generator)[:num_hits].to(device)]
    is_resident = torch.zeros(config.num_rows, dtype=torch.bool, device=device)
    is_resident[resident] = True
    others = torch.randperm(config.num_rows, generator=generator).to(device)
    misses = others[~is_resident[others]][: config.unique - num_hits]
    ids = torch.cat([hits, misses])
    return cache, ids[torch.randperm(ids.numel(), generator=generator).to(device)]


def timed_call(function: Callable, before: Callable, device: torch.device) -> float:
    """Milliseconds of one call of ``function`` (``before`` runs first, untimed)."""
    before()
    if device.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        function()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)
    began = time.perf_counter()
    function()
    return (time.perf_counter() - began) * 1e3


def run_config(config: CacheBenchConfig, device: torch.device, repeats: int, copy_gbs: float) -> Dict:
    caches = {}
    for kernel in ("torch", "triton"):
        cache, ids = make_cache(config, device, kernel, torch.Generator().manual_seed(0))
        caches[kernel] = cache
    assert caches["triton"].uses_triton and not caches["torch"].uses_triton
    saved_pins = caches["torch"].pinned_until.clone()
    found, sets = caches["torch"]._find(ids)
    miss_ids, miss_sets = ids[found < 0], sets[found < 0]
    per_set = torch.bincount(miss_sets)
    sets_with_misses = int((per_set > 0).sum())

    def restore() -> None:
        for cache in caches.values():
            cache.pinned_until.copy_(saved_pins)

    outputs = {}
    restore()
    for kernel, cache in caches.items():
        outputs[kernel] = (cache._find(ids), cache._place(miss_ids, miss_sets, cache.generation + 1))
    (torch_found, torch_sets), torch_placed = outputs["torch"]
    (triton_found, triton_sets), triton_placed = outputs["triton"]
    identical = (torch.equal(torch_found, triton_found) and torch.equal(torch_sets, triton_sets)
                 and torch.equal(torch_placed, triton_placed)
                 and torch.equal(caches["torch"].pinned_until, caches["triton"].pinned_until))
    phases = {
        "find": ({k: (lambda c=c: c._find(ids)) for k, c in caches.items()},
                 ids.numel() * (8 + 8 * config.ways + 16)),
        "place": ({k: (lambda c=c: c._place(miss_ids, miss_sets, c.generation + 1)) for k, c in caches.items()},
                  sets_with_misses * config.ways * 32 + miss_sets.numel() * 16),
    }
    entry = {"config": asdict(config), "identical": identical, "num_misses": int(miss_sets.numel()),
             "sets_with_misses": sets_with_misses, "max_misses_per_set": int(per_set.max()), "phases": {}}
    for phase, (functions, num_bytes) in phases.items():
        for function in functions.values():  # warm-up: compile, allocate
            timed_call(function, restore, device)
        times: Dict[str, List[float]] = {k: [] for k in functions}
        for _ in range(repeats):
            for kernel, function in functions.items():
                times[kernel].append(timed_call(function, restore, device))
        medians = {k: statistics.median(t) for k, t in times.items()}
        rows = {}
        for kernel, median in medians.items():
            gbs = num_bytes / (median * 1e-3) / 1e9
            rows[kernel] = {"median_ms": median, "times_ms": times[kernel], "achieved_gbs": gbs,
                            "fraction_of_copy": gbs / copy_gbs, "ids_per_s": ids.numel() / (median * 1e-3)}
            print(f"{config.name:7} {phase:6} {kernel:7} {median:10.3f} {gbs:8.1f} {100 * gbs / copy_gbs:6.1f}% "
                  f"{medians['torch'] / median:12.2f}x")
        entry["phases"][phase] = rows
    return entry


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS),
                        help=f"configurations to run, from {', '.join(CONFIGS)} (default: all)")
    parser.add_argument("--repeats", type=at_least(1), default=15,
                        help="timed calls per contender and phase (default 15; --smoke 2)")
    parser.add_argument("--out", default=None,
                        help="results JSON (default: benchmarks/results/bench_triton_cache.json of this repository; "
                             "with --smoke, nothing is written unless --out is given)")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, triton interpreter: code paths only")
    args = parser.parse_args(argv)
    args.out = output_path(args.out, args.smoke, "bench_triton_cache")
    check_out(parser, args.out)

    device = timing_device("bench_triton_cache", args.smoke, "tests/gpu/test_triton_cache.py")
    if device is None:
        return 2  # nothing measured: not a success for a script checking exit codes
    configs = SMOKE if args.smoke else CONFIGS
    if args.smoke:
        args.repeats = 2
    import triton

    copy_gbs = copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (1 << 24), 5)
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke, interpreter)",
               "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
               "copy_bandwidth_gbs": copy_gbs, "args": vars(args), "configs": {}}
    print(f"device {results['device']}; measured copy bandwidth {copy_gbs:.0f} GB/s")
    print(f"{'config':7} {'phase':6} {'kernel':7} {'median ms':>10} {'GB/s':>8} {'% copy':>7} {'torch/this':>13}")
    for name in args.configs:
        entry = run_config(configs[name], device, args.repeats, copy_gbs)
        print(f"{name:7} same slots from both: {entry['identical']}; {entry['num_misses']} misses in "
              f"{entry['sets_with_misses']} sets (at most {entry['max_misses_per_set']} in one)")
        results["configs"][name] = entry
        if not entry["identical"]:
            print(f"bench_triton_cache: {name}: the kernels' slots differ from the torch ops'", file=sys.stderr)
            return 1
    if args.smoke:
        print("smoke run: code paths checked on CPU; timings are meaningless")
    if args.out is None:
        print("not written (a smoke run writes its JSON only where --out says)")
        return 0
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    temporary = args.out + ".tmp"
    with open(temporary, "w") as handle:
        json.dump(results, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
