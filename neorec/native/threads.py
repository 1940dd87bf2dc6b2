"""How to split native kernel work over threads (the kernels run the parts on OpenMP threads)."""

from __future__ import annotations

from typing import List, Tuple

import torch

MIN_WORK_PER_THREAD = 4096  # items (ids, samples) below which another thread costs more than it saves


def threads_for(work: int, min_work: int = MIN_WORK_PER_THREAD) -> int:
    """Threads worth using for ``work`` items."""
    return max(1, min(torch.get_num_threads(), work // min_work))


def ranges_tensor(ranges: List[Tuple[int, int]]) -> torch.Tensor:
    """[2 * len(ranges)] int64 (begin, end, begin, end, ...) for the C side."""
    return torch.tensor([x for r in ranges for x in r], dtype=torch.int64)


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

