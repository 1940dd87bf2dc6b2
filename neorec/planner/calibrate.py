"""Calibration of the ``local-cpu`` topology: measure this machine, write a topology JSON.

    python -m neorec plan --calibrate                 # writes ~/.cache/neorec/topology-local-cpu.json
    python -m neorec plan --calibrate --calibration-out cpu.json --calibrate-ranks 2

Measured (medians of a few repeats):
- device_bandwidth: bytes per second an ``embedding_bag`` lookup reads (random rows of a table
  larger than the caches) on one rank's threads: the op the lookups cost.
- lookup_call_seconds / seconds_per_id: the fused ``TableBatchedEmbeddingBags`` forward +
  backward at two id counts with tiny rows (fixed cost per call, cost per id).
- compute_flops: a float32 matmul (the MLPs).
- intra_node_bandwidth / collective_latency: ``all_to_all_single`` over gloo between
  ``num_ranks`` local processes (a large and a tiny message).
Host DRAM is the machine's memory, shared by the ranks; the device tier of a CPU rank is its
share of the same memory. inter_node_bandwidth is set equal to the intra-node one (one node).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Dict, Optional

import torch

from neorec.planner.topology import Topology, default_calibration_path
from neorec.train.distributed import usable_cpus


def median_seconds(fn, repeats: int = 5, before=None) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after one warm-up; ``before()`` runs
    untimed ahead of each call (a barrier, so that every rank starts a collective together)."""
    fn()
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_lookup_bandwidth(num_rows: int = 1_000_000, dim: int = 64, num_ids: int = 200_000,
                             seed: int = 0) -> float:
    """Bytes of embedding rows read per second by a sum-pooled ``embedding_bag``."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(num_rows, dim, generator=gen)
    ids = torch.randint(0, num_rows, (num_ids,), generator=gen)
    offsets = torch.arange(0, num_ids, 10)
    seconds = median_seconds(lambda: torch.nn.functional.embedding_bag(ids, weight, offsets, mode="sum"))
    return num_ids * dim * 4 / seconds


def measure_lookup_overheads(dim: int = 4, num_tables: int = 4, seed: int = 0) -> Dict[str, float]:
    """{"call": seconds per fused forward + backward call, "per_id": seconds per id}: the fused
    ``TableBatchedEmbeddingBags`` (row-wise AdaGrad) timed at two id counts with tiny rows (so that
    bytes hardly count); the line through the two points."""
    from neorec.embedding.config import SparseOptimizerConfig, TableConfig
    from neorec.embedding.tbe import TableBatchedEmbeddingBags
    from neorec.sparse.jagged import KeyedJaggedTensor

    tables = [TableConfig(f"t{i}", 10_000, dim) for i in range(num_tables)]
    tbe = TableBatchedEmbeddingBags(tables, SparseOptimizerConfig())
    gen = torch.Generator().manual_seed(seed)
    points = []
    for batch in (256, 8192):
        lengths = torch.full((num_tables * batch,), 4, dtype=torch.long)
        kjt = KeyedJaggedTensor([t.name for t in tables], torch.randint(0, 10_000, (int(lengths.sum()),), generator=gen),
                                lengths)

        def step():
            out = tbe(kjt).values
            out.backward(torch.ones_like(out))
        points.append((int(lengths.sum()), median_seconds(step)))
    (n1, t1), (n2, t2) = points
    per_id = max(0.0, (t2 - t1) / (n2 - n1))
    return {"call": max(0.0, t1 - n1 * per_id), "per_id": per_id}


def measure_matmul_flops(size: int = 512) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    seconds = median_seconds(lambda: a @ b)
    return 2 * size ** 3 / seconds


def _alltoall_worker(rank: int, world: int, directory: str, num_bytes: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(directory, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        results = {}
        for label, size in (("big", num_bytes), ("tiny", 4 * world)):
            send = torch.zeros(size // 4 // world * world)
            recv = torch.empty_like(send)
            # the all-to-all alone: a barrier timed with it had doubled the latency (~500 against ~280 us)
            seconds = median_seconds(lambda: dist.all_to_all_single(recv, send), repeats=7, before=dist.barrier)
            results[label] = seconds
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


def measure_alltoall(num_ranks: int = 2, num_bytes: int = 32 * 2 ** 20) -> Dict[str, float]:
    """{"bandwidth": bytes/s one rank sends to the others, "latency": seconds of a tiny call}."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as directory:
        out = os.path.join(directory, "result.pt")
        mp.start_processes(_alltoall_worker, args=(num_ranks, directory, num_bytes, out), nprocs=num_ranks,
                           join=True, start_method="spawn")
        results = torch.load(out, weights_only=True)
    sent = num_bytes * (num_ranks - 1) / num_ranks
    latency = results["tiny"]
    return {"bandwidth": sent / max(results["big"] - latency, 1e-9), "latency": latency}


def host_memory_bytes() -> float:
    """This machine's physical memory (8 GB when the system does not say)."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8e9


def calibrate(num_ranks: int = 2, out: Optional[str | Path] = None, progress=print) -> Topology:
    """Measure this machine for ``num_ranks`` local ranks and save the topology (atomically)."""
    if num_ranks < 1:
        raise ValueError(f"calibration: num_ranks must be >= 1, got {num_ranks}")
    threads = max(1, usable_cpus() // num_ranks)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        progress(f"calibrating local-cpu for {num_ranks} ranks ({threads} threads each): lookup bandwidth ...")
        lookup = measure_lookup_bandwidth()
        progress("... fused lookup overheads (per call, per id) ...")
        overheads = measure_lookup_overheads()
        progress("... matmul rate ...")
        flops = measure_matmul_flops()
    finally:
        torch.set_num_threads(previous)
    comm = {"bandwidth": lookup, "latency": 50e-6}
    if num_ranks > 1:
        progress(f"... gloo all-to-all between {num_ranks} processes ...")
        comm = measure_alltoall(num_ranks)
    memory = host_memory_bytes()
    topo = Topology(
        name="local-cpu", num_nodes=1, ranks_per_node=num_ranks,
        device_memory_bytes=memory / num_ranks / 2,   # half of a rank's share of the memory for its tables
        device_bandwidth=lookup, host_dram_bytes=0.0, host_dram_bandwidth=lookup,  # (the same memory)
        ssd_bytes=0.0, ssd_bandwidth=0.0,
        intra_node_bandwidth=comm["bandwidth"], inter_node_bandwidth=comm["bandwidth"],
        compute_flops=flops, collective_latency=comm["latency"], lookup_call_seconds=overheads["call"],
        seconds_per_id=overheads["per_id"], unified_memory=1)
    path = Path(out) if out else default_calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    topo.save(path)
    progress(f"lookup {lookup / 1e9:.2f} GB/s, call {overheads['call'] * 1e3:.2f} ms + {overheads['per_id'] * 1e9:.0f} ns "
             f"per id, matmul {flops / 1e9:.1f} GFLOP/s, all-to-all "
             f"{comm['bandwidth'] / 1e9:.2f} GB/s per rank, latency {comm['latency'] * 1e6:.0f} us -> {path}")
    return topo
