"""Keep the C allocator from giving each training step's buffers back to the kernel.

glibc's malloc serves large blocks (above a threshold that adapts up to 32 MiB) with fresh
``mmap``s and returns the free top of its heap to the kernel when more than twice that is free.
A training step frees most of what it allocated (activations, pooled embeddings, gradients), so
the next step gets fresh pages again and pays a page fault (a kernel entry and a zeroed 4 KiB page;
more under a hypervisor's nested paging) for every page it touches: on the 2-core test VM, 0.5-2k
faults and 1-6 ms of system time per pool1 step of ``bench_e2e``'s DLRM, about 5% of the step.

``reuse_freed_memory()`` raises both thresholds (``mallopt``: blocks up to ``MMAP_THRESHOLD`` come
from the heap, up to ``TRIM_THRESHOLD`` of free heap is kept), so freed memory is taken again
instead of going back to the kernel (``benchmarks/bench_allocator.py``: no faults per step after
the warm-up steps, the same peak RSS). The cost: up to ``TRIM_THRESHOLD`` of freed memory stays with the process.
The setting is process-wide (every library in the process allocates through the same malloc) and
stays for the life of the process. The ``Trainer`` applies it unless ``train.reuse_freed_memory``
is false. Other C libraries (musl) or systems: nothing is changed, the reason is returned.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from typing import Optional

MMAP_THRESHOLD = 64 << 20
TRIM_THRESHOLD = 512 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)

_applied: Optional[str] = ""  # "" = not tried yet; None = applied; else why not


def reuse_freed_memory() -> Optional[str]:
    """Apply the thresholds above to this process's malloc (once); None when applied, else why not."""
    global _applied
    if _applied != "":
        return _applied
    _applied = _apply()
    return _applied


def _apply() -> Optional[str]:
    if not sys.platform.startswith("linux"):
        return f"only done on Linux with glibc (this is {sys.platform})"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # glibc only: musl's mallopt does nothing
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "the C library is not glibc"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1 or mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        return "glibc's mallopt refused the thresholds"
    return None
