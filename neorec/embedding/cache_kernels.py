"""Which implementation ``SetAssociativeCache`` uses for its tag lookup (``_find``) and victim
choice (``_place``): torch ops, or the Triton kernels of ``kernels/triton_cache.py``.

Chosen once per cache from its ``kernel`` argument, like ``TableBatchedEmbeddingBags(kernel=)``:
"auto" takes Triton when the cache's metadata is on a CUDA device and triton is installed, else
torch ops (always on CPU tensors); "torch" never uses Triton; "triton" insists, and on CPU
tensors needs ``TRITON_INTERPRET=1`` (the tests):

    TRITON_INTERPRET=1 python -m pytest tests/gpu/test_triton_cache.py -q

Both give the same slots and pins, so a cache trains the same bits either way. This module never
imports triton at import time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Tuple

import torch

from neorec.embedding.kernels import triton_interpreting, triton_unavailable_reason

if TYPE_CHECKING:  # pragma: no cover
    from neorec.embedding.cache import SetAssociativeCache

CACHE_KERNELS = ("auto", "torch", "triton")


def check_cache_kernel(kernel: str, name: str) -> str:
    if kernel not in CACHE_KERNELS:
        raise ValueError(f"cache {name!r}: kernel must be one of {CACHE_KERNELS}, got {kernel!r}")
    return kernel


def cache_kernel_unsupported_reason(device: torch.device) -> Optional[str]:
    """Why the Triton cache kernels cannot run on ``device`` (None when they can)."""
    unavailable = triton_unavailable_reason()
    if unavailable is not None:
        return unavailable
    if device.type != "cuda" and not triton_interpreting():
        return "the cache's tensors are on the CPU (set TRITON_INTERPRET=1 to run the kernels there)"
    return None


def choose_cache_kernel(kernel: str, device: torch.device, name: str) -> bool:
    """True to use the Triton kernels for a cache on ``device``."""
    check_cache_kernel(kernel, name)
    if kernel == "torch":
        return False
    reason = cache_kernel_unsupported_reason(torch.device(device))
    if kernel == "triton":
        if reason is not None:
            raise ValueError(f"cache {name!r}: kernel='triton' was asked for but {reason}")
        return True
    return reason is None and torch.device(device).type == "cuda"


def find(cache: "SetAssociativeCache", rows: torch.Tensor, hash_multiplier: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``cache._find`` on the Triton kernel: (slot or -1 [n], home set [n]) of unique ``rows`` [n]."""
    from neorec.embedding.kernels import triton_cache

    return triton_cache.cache_find(cache.slot_rows, cache.num_sets, cache.ways, rows, hash_multiplier)


def place(cache: "SetAssociativeCache", sets: torch.Tensor, generation: int) -> torch.Tensor:
    """``cache._place`` on the Triton kernel: slots (or -1) for the misses of home ``sets`` [n],
    pinned with ``generation``."""
    from neorec.embedding.kernels import triton_cache

    return triton_cache.cache_place(cache.slot_rows, cache.last_use, cache.counts, cache.pinned_until, cache.ways,
                                    cache.policy == "lfu", cache.completed, generation, sets)
