"""What the sharded output exchange costs on this host: gloo's all-to-all (TCP over loopback)
against the same bytes moved through shared memory (each rank copies its outgoing part into a
/dev/shm buffer, one gloo barrier, each rank copies its incoming part out; double-buffered so one
barrier per exchange suffices), for the per-rank pooled output of bench_e2e's 2-rank cells.
Also gloo's barrier and all-reduce. Two ranks, one thread each, medians.

    python benchmarks/bench_transport.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench_args import at_least  # same folder (run as a script)

# floats each rank holds for the output all-to-all: [world x local batch, its tables x dim]
SIZES = {"pool1 (26 tables, B 2048/rank)": 2 * 2048 * 13 * 64, "pool20 (16 tables, B 1024/rank)": 2 * 1024 * 8 * 64}


def _median_ms(fn, repeats: int) -> float:
    times = []
    for i in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def worker(rank: int, world: int, store: str, token: str, repeats: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    for label, n in SIZES.items():
        part = n // world
        x, out = torch.randn(n), torch.empty(n)
        gloo_ms = _median_ms(lambda i: dist.all_to_all_single(out, x), repeats)
        names = [f"/dev/shm/neorec-bench-{token}-{r}-{k}" for r in range(world) for k in range(2)]
        for k in range(2):
            with open(names[2 * rank + k], "wb") as f:
                f.truncate(n * 4)
        dist.barrier()
        boxes = [torch.from_file(name, shared=True, size=n, dtype=torch.float32) for name in names]
        dist.barrier()
        os.unlink(names[2 * rank]), os.unlink(names[2 * rank + 1])

        def shm(i: int) -> None:
            k = i % 2
            mine = boxes[2 * rank + k]
            for peer in range(world):  # outgoing parts into my buffer, my own part straight across
                if peer != rank:
                    mine[peer * part : (peer + 1) * part].copy_(x[peer * part : (peer + 1) * part])
            out[rank * part : (rank + 1) * part].copy_(x[rank * part : (rank + 1) * part])
            dist.barrier()
            for peer in range(world):
                if peer != rank:
                    out[peer * part : (peer + 1) * part].copy_(boxes[2 * peer + k][rank * part : (rank + 1) * part])

        shm_ms = _median_ms(shm, repeats)
        half = torch.randn(n // 2)
        reduce_ms = _median_ms(lambda i: dist.all_reduce(half), repeats)
        barrier_ms = _median_ms(lambda i: dist.barrier(), repeats)
        if rank == 0:
            print(f"{label}: {n * 4 / 1e6:.1f} MB per rank; all-to-all gloo {gloo_ms:.2f} ms, shared memory "
                  f"{shm_ms:.2f} ms; gloo all-reduce of {n * 2 / 1e6:.1f} MB {reduce_ms:.2f} ms; gloo barrier "
                  f"{barrier_ms * 1e3:.0f} us", flush=True)
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=at_least(1), default=40,
                        help="timed calls of each operation (gloo all-to-all, shared-memory exchange, all-reduce, "
                        "barrier) per message size; medians (default 40)")
    args = parser.parse_args(argv)
    if not os.path.isdir("/dev/shm"):
        print("no /dev/shm on this host", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(2, os.path.join(tmp, "store"), uuid.uuid4().hex[:12], args.repeats),
                           nprocs=2, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
