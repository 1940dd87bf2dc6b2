"""Embedding cache benchmark: hit rates against Belady's optimum, training throughput through the
cache, and a table larger than the process's memory budget trained from SSD.

Sections (all by default; ``--sections`` picks some):

- ``hit-rate``: Zipf traces (several skews) of batches of ids over one table; the distinct ids of
  each batch are looked up in a ``SetAssociativeCache`` (32 ways) with LRU and with LFU (counts
  kept with the rows), at cache sizes from 1% to 50% of the rows, against Belady's optimal policy
  (fully associative, evicts the row used furthest in the future; computed offline on the same
  trace, same batch granularity). Hit rate = hits / distinct ids looked up, after a warm-up.
  Target: LRU or LFU within 10 percentage points of Belady at 10% on Zipf(1.05).
- ``train``: DLRM training samples/s with the big tables on the device (fully resident) and
  cached (10% and 25% of rows) over a DRAM store and over an SSD store, fp32, fp16 and int8 rows,
  and with prefetch (next batch named ahead, data moved in a worker thread). Variants alternate round by round (A, B, C, ..., A, B, C, ...);
  medians and ratios to the resident run. Same batches for every variant.
- ``big-ssd``: in a child process whose data segment is capped (``RLIMIT_DATA``, default 1 GiB;
  shared file mappings are not counted, private memory is), a table several times that size
  (fp16 rows on SSD) trains through a cache; the device-resident module is tried first under the
  same cap and is refused. Reports peak / final RSS, samples/s, hit rate; then a full checkpoint
  of the trained model (dirty rows still in the cache) is saved and restored into the same stores,
  under the same cap (time, bytes, peak RSS; sampled rows compared before and after).

Run (from the repository root, venv active; about 4 minutes on 2 cores):

    python benchmarks/bench_cache.py --out benchmarks/results/bench_cache.json
    python benchmarks/bench_cache.py --smoke                 # every code path, tiny sizes
    python benchmarks/bench_cache.py --sections hit-rate     # one section
"""

from __future__ import annotations

import argparse
import heapq
import io
import json
import math
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Dict, List

import numpy as np
import torch

from neorec.config import config_from_dict
from neorec.data.synthetic import ZipfSampler
from neorec.embedding.cache import SetAssociativeCache
from neorec.embedding.cache_prefetch import cached_collections, with_prefetch
from neorec.embedding.storage import DramRowStore

from bench_args import at_least, check_out, number  # same folder (run as a script)

CACHE_FRACTIONS = (0.01, 0.02, 0.05, 0.10, 0.25, 0.50)
SECTIONS = ("hit-rate", "train", "big-ssd")


# ---------------------------------------------------------------------------------- hit rates
def zipf_trace(num_rows: int, alpha: float, ids_per_batch: int, num_batches: int, seed: int) -> List[np.ndarray]:
    """Distinct sorted ids of each batch; ranks Zipf(alpha), spread over the table by an affine map."""
    sampler, rng = ZipfSampler(num_rows, alpha), np.random.default_rng(seed)
    multiplier = 2_654_435_761 % num_rows
    while math.gcd(multiplier, num_rows) != 1:
        multiplier += 1
    return [np.unique((sampler.sample(rng.random(ids_per_batch)) * multiplier + 12345) % num_rows)
            for _ in range(num_batches)]


def belady_hit_rate(trace: List[np.ndarray], capacity: int, warmup: int) -> float:
    """Fully associative optimal replacement at batch granularity: a batch's rows are resident
    together; on a miss the resident row whose next use is furthest away is evicted."""
    flat = np.concatenate(trace)
    batch_of = np.repeat(np.arange(len(trace)), [len(b) for b in trace])
    order = np.argsort(flat, kind="stable")
    next_use = np.full(flat.size, len(trace) + 1, dtype=np.int64)
    same = flat[order[1:]] == flat[order[:-1]]
    next_use[order[:-1][same]] = batch_of[order[1:][same]]
    resident: Dict[int, int] = {}  # row -> its next use
    heap: List = []  # (-next use, row), stale entries skipped
    hits = lookups = 0
    position = 0
    for b, rows in enumerate(trace):
        rows_list = rows.tolist()
        missing = [r for r in rows_list if r not in resident]
        if b >= warmup:
            lookups += len(rows_list)
            hits += len(rows_list) - len(missing)
        for r in rows_list:  # in use now: never the furthest
            resident[r] = b
        overflow = len(resident) - capacity
        while overflow > 0:
            use, row = heapq.heappop(heap)
            if resident.get(row) == -use and -use != b:
                del resident[row]
                overflow -= 1
        for r, use in zip(rows_list, next_use[position : position + len(rows_list)].tolist()):
            resident[r] = use
            heapq.heappush(heap, (-use, r))
        position += len(rows_list)
        # rows resident now but needed in this batch were pushed with b: those entries are stale
    return hits / max(lookups, 1)


def policy_hit_rate(trace: List[np.ndarray], num_rows: int, slots: int, policy: str, ways: int, warmup: int) -> float:
    store = DramRowStore(num_rows, 1, "fp32", with_counts=policy == "lfu")
    cache = SetAssociativeCache(store, torch.zeros(slots, 1), {}, ways=ways, policy=policy)
    for b, rows in enumerate(trace):
        if b == warmup:
            cache.reset_stats()
        cache.lookup(torch.from_numpy(rows), update=False)
    return cache.stats.hit_rate


def section_hit_rate(args) -> Dict:
    results = []
    print(f"\n## hit rate: {args.rows:,} rows, {args.batches} batches of {args.ids_per_batch} ids "
          f"(warm-up {args.warmup}), {args.ways}-way LRU / LFU vs Belady (fully associative)")
    print(f"{'zipf':>5} {'cache':>6} {'slots':>7} {'LRU':>7} {'LFU':>7} {'Belady':>7} {'best gap (pp)':>14}")
    skipped = []
    for alpha in args.skews:
        trace = zipf_trace(args.rows, alpha, args.ids_per_batch, args.batches, seed=7)
        distinct = statistics.mean(len(b) for b in trace)
        for fraction in args.fractions:
            slots = max(args.ways, math.ceil(fraction * args.rows / args.ways) * args.ways)
            largest = max(len(b) for b in trace)
            if slots < largest:  # a batch would not fit (the collection would grow the cache): said, not dropped
                skipped.append({"zipf": alpha, "cache_fraction": fraction, "slots": slots, "largest_batch": largest})
                print(f"{alpha:>5} {fraction:>6.0%} {slots:>7}  not run: a batch has {largest} distinct ids, more "
                      f"than the cache's {slots} slots (more --rows, a larger fraction or fewer --ids-per-batch)",
                      flush=True)
                continue
            row = {"zipf": alpha, "cache_fraction": fraction, "slots": slots, "distinct_per_batch": distinct,
                   "lru": policy_hit_rate(trace, args.rows, slots, "lru", args.ways, args.warmup),
                   "lfu": policy_hit_rate(trace, args.rows, slots, "lfu", args.ways, args.warmup),
                   "belady": belady_hit_rate(trace, slots, args.warmup)}
            row["gap_pp"] = 100 * (row["belady"] - max(row["lru"], row["lfu"]))
            results.append(row)
            print(f"{alpha:>5} {fraction:>6.0%} {slots:>7} {row['lru']:>7.1%} {row['lfu']:>7.1%} "
                  f"{row['belady']:>7.1%} {row['gap_pp']:>14.1f}", flush=True)
    return {"rows": args.rows, "batches": args.batches, "ids_per_batch": args.ids_per_batch, "warmup": args.warmup,
            "ways": args.ways, "results": results, "skipped": skipped}


# ---------------------------------------------------------------------------------- training
def train_config(args, location=None) -> Dict:
    config = {
        "model": {"embedding_dim": args.dim, "dense_layers": [64, args.dim], "over_layers": [64, 32]},
        "embedding": {"optimizer": {"kind": "rowwise_adagrad", "learning_rate": 0.05}},
        "data": {"batch_size": args.batch_size, "synthetic": {
            "num_tables": len(args.tables), "num_embeddings": args.tables, "pooling": args.pooling,
            "num_train_samples": args.batch_size * (args.warmup_steps + args.rounds * args.steps),
            "num_eval_samples": 1, "zipf_alpha": 1.05}},
        "train": {"progress": False, "output_dir": "", "epochs": 1},
    }
    if location is not None:
        config["embedding"]["location"] = location
    return config


def section_train(args, workdir: str) -> Dict:
    from neorec.train.trainer import Trainer

    big = min(args.tables)  # the smallest table stays on the device
    variants = {"resident": None}
    for where in ("cached_dram", "cached_ssd"):
        for fraction in (0.25, 0.10):
            variants[f"{where} {fraction:.0%}"] = {"default": where, "cache_fraction": fraction}
    for precision in ("fp16", "int8"):
        variants[f"cached_ssd 10% {precision}"] = {"default": "cached_ssd", "cache_fraction": 0.10, "precision": precision}
    variants["cached_ssd 10% + prefetch"] = {"default": "cached_ssd", "cache_fraction": 0.10, "prefetch": True}
    trainers = {}
    for name, location in variants.items():
        if location is not None:
            location = {**location, "min_rows": big + 1, "ssd_dir": os.path.join(workdir, name.replace(" ", "_"))}
        trainers[name] = Trainer(config_from_dict(train_config(args, location)), out=io.StringIO())
    source = next(iter(trainers.values())).source
    batches = list(source.train_batches(args.batch_size))
    print(f"\n## training: tables {args.tables} x dim {args.dim}, pooling {args.pooling}, batch {args.batch_size}, "
          f"{args.threads} thread(s); {args.rounds} rounds of {args.steps} steps after {args.warmup_steps} warm-up")

    def run(name: str, chunk) -> float:
        trainer = trainers[name]
        prefetch = variants[name] is not None and variants[name].get("prefetch", False)
        start = time.perf_counter()
        for batch in (with_prefetch(chunk, trainer.model) if prefetch else chunk):
            trainer.train_step(batch)
        return len(chunk) * args.batch_size / (time.perf_counter() - start)

    for name in variants:
        run(name, batches[: args.warmup_steps])
        for collection in cached_collections(trainers[name].model):
            for cache in collection.caches.values():
                cache.reset_stats()
    rates = {name: [] for name in variants}
    for r in range(args.rounds):
        chunk = batches[args.warmup_steps + r * args.steps : args.warmup_steps + (r + 1) * args.steps]
        for name in variants:
            rates[name].append(run(name, chunk))
    results = []
    base = statistics.median(rates["resident"])
    print(f"{'variant':<28} {'samples/s':>10} {'vs resident':>12} {'hit rate':>9} {'loaded/step':>12}")
    for name in variants:
        median = statistics.median(rates[name])
        stats = [c.stats for col in cached_collections(trainers[name].model) for c in col.caches.values()]
        lookups = sum(s.lookups for s in stats)
        hit = sum(s.hits for s in stats) / lookups if lookups else None  # no cache: null in the JSON (no NaN)
        loaded = sum(s.misses + s.prefetch_loads for s in stats) / (args.rounds * args.steps)
        results.append({"variant": name, "samples_per_s": median, "all_samples_per_s": rates[name],
                        "ratio_to_resident": median / base, "hit_rate": hit, "rows_loaded_per_step": loaded})
        shown = f"{hit:>9.1%}" if hit is not None else f"{'-':>9}"
        print(f"{name:<28} {median:>10,.0f} {median / base:>12.2f} {shown} {loaded:>12,.0f}", flush=True)
    for trainer in trainers.values():
        for collection in cached_collections(trainer.model):
            collection.close()
    return {"tables": args.tables, "dim": args.dim, "pooling": args.pooling, "batch_size": args.batch_size,
            "rounds": args.rounds, "steps": args.steps, "threads": args.threads, "results": results}


# ---------------------------------------------------------------------------------- big table on SSD
def _memory() -> Dict[str, int]:
    fields = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "VmData"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def big_ssd_child(args) -> Dict:
    """Runs in a child process under RLIMIT_DATA."""
    limit = int(args.data_limit_gb * (1 << 30))
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    from neorec.embedding import EmbeddingBagCollection, TableConfig
    from neorec.train.trainer import Trainer

    rows, dim = args.big_rows, args.big_dim
    out: Dict = {"data_limit_bytes": limit, "rows": rows, "dim": dim,
                 "fp32_table_bytes": rows * dim * 4}
    try:
        EmbeddingBagCollection([TableConfig("big", rows, dim)])
        out["resident_attempt"] = "allocated (the cap did not bite)"
    except RuntimeError as error:
        out["resident_attempt"] = "refused: " + str(error).split("\n")[0][:160]
    ssd_dir = os.path.join(args.workdir, "big")
    config = train_config(argparse.Namespace(**{**vars(args), "tables": [rows, 1000, 100], "dim": dim}),
                          {"default": "cached_ssd", "min_rows": rows, "cache_rows": args.big_cache_rows,
                           "precision": "fp16", "ssd_dir": ssd_dir, "resident_budget_mb": args.resident_budget_mb})
    config["data"]["synthetic"]["num_train_samples"] = args.batch_size * args.big_steps
    start = time.perf_counter()
    trainer = Trainer(config_from_dict(config), out=io.StringIO())
    out["create_seconds"] = time.perf_counter() - start
    store_path = os.path.join(ssd_dir, "t_feature_0", "rows.bin")
    out["store_file_bytes"] = os.path.getsize(store_path)
    out["memory_after_create"] = _memory()
    batches = list(trainer.source.train_batches(args.batch_size))
    collection = cached_collections(trainer.model)[0]
    chunk = max(1, len(batches) // 6)  # alternate: prefetch on, off, on, off, ...
    rates: Dict[str, List[float]] = {"prefetch": [], "no_prefetch": []}
    for index, start_batch in enumerate(range(0, len(batches) - chunk + 1, chunk)):
        part = batches[start_batch : start_batch + chunk]
        mode = "prefetch" if index % 2 == 0 else "no_prefetch"
        start = time.perf_counter()
        for batch in (with_prefetch(part, trainer.model) if mode == "prefetch" else part):
            trainer.train_step(batch)
        rates[mode].append(len(part) * args.batch_size / (time.perf_counter() - start))
    steps = sum(len(r) for r in rates.values()) * chunk
    out["samples_per_s"] = {mode: statistics.median(r) for mode, r in rates.items()}
    out["all_samples_per_s"] = rates
    before = collection.cache_stats()["t_feature_0"]
    out["checkpoint"] = _big_checkpoint(args, trainer, collection)
    after = collection.cache_stats()["t_feature_0"]
    moved = {k: after[k] - before[k] for k in ("store_bytes_read", "store_bytes_written")}
    out["checkpoint"].update(moved)  # the store I/O of the save and the restore, not counted below
    collection.flush()
    stats = collection.cache_stats()["t_feature_0"]
    out.update(steps=steps, cache_rows=collection.caches["t_feature_0"].num_slots, hit_rate=stats["hit_rate"],
               evictions=stats["evictions"], write_backs=stats["write_backs"],
               store_bytes_read=stats["store_bytes_read"] - moved["store_bytes_read"],
               store_bytes_written=stats["store_bytes_written"] - moved["store_bytes_written"],
               page_releases=collection.caches["t_feature_0"].store.releases, memory_end=_memory())
    collection.close()
    return out


def _reset_peak_rss() -> bool:
    try:  # Linux: writing 5 to clear_refs resets VmHWM to the current RSS
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _big_checkpoint(args, trainer, collection) -> Dict:
    """Save a full checkpoint of ``trainer`` (its big table in chunk files) and restore it into the
    same stores; rows sampled before the save must come back equal (the fp16 store's rows are
    exact in fp32, and resident rows go back to their slots)."""
    from neorec.train.checkpoint import Checkpointer
    from neorec.train.checkpoint_config import CheckpointConfig

    directory = os.path.join(args.workdir, "ckpt")
    shutil.rmtree(directory, ignore_errors=True)
    checkpointer = Checkpointer(CheckpointConfig(dir=directory, row_bits=args.big_checkpoint_bits), trainer)
    sample = torch.randint(0, args.big_rows, (20_000,), generator=torch.Generator().manual_seed(1)).unique()
    before, _ = collection.read_rows("t_feature_0", sample)
    out: Dict = {"row_bits": args.big_checkpoint_bits, "peak_reset": _reset_peak_rss()}
    start = time.perf_counter()
    path = checkpointer.save()
    out["save_seconds"] = time.perf_counter() - start
    out["files"] = len(list(path.glob("rank0*.pt")))
    out["bytes"] = sum(f.stat().st_size for f in path.glob("*.pt"))
    out["memory_after_save"] = _memory()
    _reset_peak_rss()
    start = time.perf_counter()
    checkpointer.restore(path)
    out["restore_seconds"] = time.perf_counter() - start
    out["memory_after_restore"] = _memory()
    after, _ = collection.read_rows("t_feature_0", sample)
    error = (after - before).abs().max().item()
    out["sampled_rows"], out["sampled_max_abs_error"] = sample.numel(), error
    if args.big_checkpoint_bits == 32 and error != 0:
        raise RuntimeError(f"restored rows differ from the saved ones (max |error| {error})")
    shutil.rmtree(directory, ignore_errors=True)
    return out


def section_big_ssd(args, workdir: str) -> Dict:
    command = [sys.executable, os.path.abspath(__file__), "--child-big-ssd", "--workdir", workdir,
               "--threads", str(args.threads), "--big-rows", str(args.big_rows), "--big-dim", str(args.big_dim),
               "--big-steps", str(args.big_steps), "--big-cache-rows", str(args.big_cache_rows),
               "--batch-size", str(args.batch_size), "--pooling", str(args.pooling),
               "--data-limit-gb", str(args.data_limit_gb), "--resident-budget-mb", str(args.resident_budget_mb),
               "--big-checkpoint-bits", str(args.big_checkpoint_bits)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"big-ssd child failed:\n{done.stderr[-4000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    gib = 1 << 30
    print(f"\n## big table from SSD under a {out['data_limit_bytes'] / gib:.2f} GiB data cap: {out['rows']:,} rows x "
          f"{out['dim']} (fp32 would be {out['fp32_table_bytes'] / gib:.2f} GiB; fp16 store file "
          f"{out['store_file_bytes'] / gib:.2f} GiB)")
    print(f"device-resident module under the same cap: {out['resident_attempt']}")
    rates = out["samples_per_s"]
    print(f"store created in {out['create_seconds']:.1f} s; {out['steps']} steps, samples/s with prefetch "
          f"{rates['prefetch']:,.0f}, without {rates['no_prefetch']:,.0f} (alternating chunks, medians); "
          f"cache {out['cache_rows']:,} rows, hit rate {out['hit_rate']:.1%}, {out['evictions']:,} evictions, "
          f"{out['write_backs']:,} write-backs, store read {out['store_bytes_read'] / 2**20:,.0f} MiB, written "
          f"{out['store_bytes_written'] / 2**20:,.0f} MiB")
    ck = out["checkpoint"]
    peak = "" if ck["peak_reset"] else " (peak not reset: the process's peak so far)"
    print(f"full checkpoint ({ck['row_bits']}-bit rows), dirty rows in the cache: saved in {ck['save_seconds']:.1f} s, "
          f"{ck['bytes'] / gib:.2f} GiB in {ck['files']} files, peak RSS {ck['memory_after_save']['VmHWM'] / gib:.2f} "
          f"GiB{peak}; restored into the stores in {ck['restore_seconds']:.1f} s, peak RSS "
          f"{ck['memory_after_restore']['VmHWM'] / gib:.2f} GiB; {ck['sampled_rows']:,} sampled rows max |error| "
          f"{ck['sampled_max_abs_error']:.3g}; store read {ck['store_bytes_read'] / gib:.2f} GiB, written "
          f"{ck['store_bytes_written'] / gib:.2f} GiB")
    for when in ("memory_after_create", "memory_end"):
        m = out[when]
        print(f"{when}: peak RSS {m['VmHWM'] / gib:.2f} GiB, RSS {m['VmRSS'] / gib:.2f} GiB "
              f"(anon {m['RssAnon'] / gib:.2f}, file {m['RssFile'] / gib:.2f}), data {m['VmData'] / gib:.2f} GiB")
    return out


# ---------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), metavar="SECTION",
                        help=f"the sections to run, from {', '.join(SECTIONS)} (default: all)")
    parser.add_argument("--out", default="", metavar="FILE.json", help="write the report JSON here (default: none)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes, in place of those given: checks every code path")
    parser.add_argument("--threads", type=at_least(1), default=2, metavar="N", help="torch threads (default 2)")
    parser.add_argument("--rows", type=at_least(1), default=200_000, metavar="N",
                        help="hit-rate: rows of the table (default 200000)")
    parser.add_argument("--batches", type=at_least(1), default=1000, metavar="N",
                        help="hit-rate: batches in each trace, warm-up included (default 1000)")
    parser.add_argument("--ids-per-batch", type=at_least(1), default=1024, metavar="N",
                        help="hit-rate: ids drawn per batch (default 1024)")
    parser.add_argument("--warmup", type=at_least(0), default=200, metavar="N",
                        help="hit-rate: batches looked up before hits are counted (default 200)")
    parser.add_argument("--ways", type=at_least(1), default=32, metavar="N",
                        help="hit-rate: ways of the set-associative cache (default 32)")
    parser.add_argument("--skews", type=number(0), nargs="+", default=[0.8, 1.05, 1.2], metavar="ALPHA",
                        help="hit-rate: Zipf skews of the traces, >= 0 (0 = uniform; default 0.8 1.05 1.2)")
    parser.add_argument("--fractions", type=number(0, 1, above=True), nargs="+", default=list(CACHE_FRACTIONS),
                        metavar="F", help="hit-rate: cache sizes as fractions of the rows, in (0, 1], rounded up to "
                        f"whole sets of --ways slots (default {' '.join(str(f) for f in CACHE_FRACTIONS)}); a size "
                        "smaller than a batch's distinct ids is not run, and said")
    parser.add_argument("--tables", type=at_least(1), nargs="+", default=[1_000_000, 300_000, 50_000, 1000],
                        metavar="ROWS", help="train: rows of each table; the smallest stays on the device "
                                             "(default 1000000 300000 50000 1000)")
    parser.add_argument("--dim", type=at_least(1), default=32, metavar="D",
                        help="train: embedding dimension (default 32)")
    parser.add_argument("--pooling", type=float, default=4.0, metavar="P",
                        help="train, big-ssd: mean ids per bag (default 4)")
    parser.add_argument("--batch-size", type=at_least(1), default=2048, metavar="B",
                        help="train, big-ssd: samples per step (default 2048)")
    parser.add_argument("--warmup-steps", type=at_least(0), default=30, metavar="N",
                        help="train: untimed steps of each variant first (default 30)")
    parser.add_argument("--steps", type=at_least(1), default=20, metavar="N",
                        help="train: timed steps of each variant per round (default 20)")
    parser.add_argument("--rounds", type=at_least(1), default=5, metavar="N",
                        help="train: rounds, the variants alternating (default 5)")
    parser.add_argument("--big-rows", type=at_least(1), default=16_000_000, metavar="N",
                        help="big-ssd: rows of the big table (default 16000000)")
    parser.add_argument("--big-dim", type=at_least(1), default=64, metavar="D",
                        help="big-ssd: its embedding dimension (default 64)")
    parser.add_argument("--big-steps", type=at_least(2), default=60, metavar="N",
                        help="big-ssd: training steps, at least 2: chunks with and without prefetch alternate "
                             "(default 60)")
    parser.add_argument("--big-cache-rows", type=at_least(1), default=32_768, metavar="N",
                        help="big-ssd: rows of its cache (default 32768)")
    parser.add_argument("--data-limit-gb", type=number(0, above=True), default=1.0, metavar="GB",
                        help="big-ssd: the child's data segment cap, RLIMIT_DATA (default 1)")
    parser.add_argument("--resident-budget-mb", type=at_least(1), default=256, metavar="MB",
                        help="big-ssd: pages of the SSD store released after about this much is written "
                             "while it is initialised (default 256)")
    parser.add_argument("--big-checkpoint-bits", type=int, default=32, choices=(32, 8, 4, 2),
                        help="big-ssd: row_bits of the big table's checkpoint (32 = exact)")
    parser.add_argument("--workdir", default="", metavar="DIR",
                        help="folder for the SSD stores and the checkpoint, kept (default: a temporary "
                             "folder, removed at the end)")
    parser.add_argument("--child-big-ssd", action="store_true", help=argparse.SUPPRESS)
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    """The options, ``--smoke``'s sizes put in, checked together (usage errors, exit 2)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.smoke:
        args.rows, args.batches, args.ids_per_batch, args.warmup, args.skews = 20_000, 40, 256, 10, [1.05]
        args.tables, args.batch_size, args.warmup_steps, args.steps, args.rounds = [20_000, 5_000, 100], 256, 3, 3, 2
        args.big_rows, args.big_steps, args.big_cache_rows, args.big_dim = 400_000, 5, 8192, 16
        args.data_limit_gb = 1.0
    if args.warmup >= args.batches:  # no batch left to count: LRU/LFU gave the warm-up's rates, Belady 0
        parser.error(f"argument --warmup: must be less than --batches ({args.batches}): hits are counted on the "
                     f"batches after the warm-up, got {args.warmup}")
    check_out(parser, args.out)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore", RuntimeWarning)
    if args.child_big_ssd:
        print(json.dumps(big_ssd_child(args)))
        return 0
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench_cache_")
    report = {"machine": {"platform": platform.platform(), "processor": platform.processor(),
                          "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                          "numpy": np.__version__, "load_average_start": os.getloadavg()},
              "command": " ".join([os.path.basename(sys.executable), *sys.argv]), "smoke": args.smoke}
    try:
        if "hit-rate" in args.sections:
            report["hit_rate"] = section_hit_rate(args)
        if "train" in args.sections:
            report["train"] = section_train(args, workdir)
        if "big-ssd" in args.sections:
            report["big_ssd"] = section_big_ssd(args, workdir)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    report["machine"]["load_average_end"] = os.getloadavg()
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
