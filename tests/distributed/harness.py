"""Runs a function on N gloo ranks (torch.multiprocessing.spawn, a FileStore, one thread per rank)
with a deadline: a deadlock fails the test instead of hanging it.

    results = run_ranks(worker, world_size=2, directory=tmp_path, args=(...,))
    # worker(rank, world_size, process_group, *args) -> anything torch.save can write
"""

from __future__ import annotations

import gc
import os
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, List, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT = 150.0


class RankTimeout(AssertionError):
    """The ranks did not finish before the deadline (a deadlock, or a far too slow machine)."""


def _worker(rank: int, fn: Callable, world_size: int, directory: str, args: Sequence[Any], timeout: float) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(directory, "store"), world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout))
    try:
        result = fn(rank, world_size, dist.group.WORLD, *args)
        torch.save({"result": result}, os.path.join(directory, f"result{rank}.pt"))
    except BaseException:
        Path(directory, f"error{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        gc.collect()  # models (DDP reducers) go before their groups: see DistributedContext.close
        dist.destroy_process_group()


def run_ranks(fn: Callable, world_size: int, directory: Path, args: Sequence[Any] = (),
              timeout: float = DEFAULT_TIMEOUT) -> List[Any]:
    """Run ``fn(rank, world_size, process_group, *args)`` on ``world_size`` processes; return the
    results in rank order. A rank's exception fails with its traceback; after ``timeout`` seconds
    all ranks are killed and ``RankTimeout`` is raised."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    context = mp.start_processes(_worker, args=(fn, world_size, str(directory), tuple(args), timeout),
                                 nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise RankTimeout(f"{world_size} ranks did not finish within {timeout:.0f} s (deadlock?)")
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
        errors = sorted(directory.glob("error*.txt"))
        details = "\n".join(f"--- {p.name}\n{p.read_text()}" for p in errors)
        raise AssertionError(f"a rank failed:\n{details or exc}") from None
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join(5)
    return [torch.load(directory / f"result{r}.pt", weights_only=True)["result"] for r in range(world_size)]
