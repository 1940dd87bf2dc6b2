"""Run native kernels on several threads: ctypes calls release the GIL, so a small pool of Python
threads, each on a disjoint range of the work, uses ``torch.get_num_threads()`` cores without a
second OpenMP runtime beside torch's."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, List, Optional, Sequence, Tuple

import torch

MIN_WORK_PER_THREAD = 4096  # items (ids, samples) below which another thread costs more than it saves

_pool: Optional[ThreadPoolExecutor] = None
_pool_size = 0


def threads_for(work: int, min_work: int = MIN_WORK_PER_THREAD) -> int:
    """Threads worth using for ``work`` items (handing work to a thread costs ~20 us)."""
    return max(1, min(torch.get_num_threads(), work // min_work))


def run_parallel(tasks: Sequence[Callable[[], object]]) -> List[object]:
    """Run ``tasks`` (ctypes calls) on a pool of threads, the first on the calling thread; results
    in task order."""
    global _pool, _pool_size
    if len(tasks) == 1:
        return [tasks[0]()]
    if _pool is None or _pool_size < len(tasks) - 1:
        if _pool is not None:
            _pool.shutdown(wait=True)
        _pool_size = len(tasks) - 1
        _pool = ThreadPoolExecutor(max_workers=_pool_size, thread_name_prefix="neorec-native")
    futures = [_pool.submit(task) for task in tasks[1:]]
    first = tasks[0]()
    return [first] + [f.result() for f in futures]


def split_by_work(bounds: torch.Tensor, count: int, parts: int) -> List[Tuple[int, int]]:
    """``parts`` contiguous ranges of [0, count) items whose cumulative work ``bounds`` [count + 1]
    is about equal (no empty range)."""
    if parts <= 1 or count <= 1:
        return [(0, count)]
    total = int(bounds[-1]) - int(bounds[0])
    targets = torch.tensor([int(bounds[0]) + total * k // parts for k in range(1, parts)], dtype=bounds.dtype)
    cuts = torch.searchsorted(bounds, targets).tolist()
    edges = sorted({0, count, *[min(max(c, 1), count - 1) for c in cuts]})
    return list(zip(edges[:-1], edges[1:]))


def split_even(count: int, parts: int) -> List[Tuple[int, int]]:
    """``parts`` contiguous ranges of [0, count) of equal size (no empty range)."""
    parts = max(1, min(parts, count))
    edges = [count * k // parts for k in range(parts + 1)]
    return list(zip(edges[:-1], edges[1:]))
