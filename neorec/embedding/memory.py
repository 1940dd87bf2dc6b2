"""Host memory for large embedding buffers: backed by transparent huge pages where the OS allows.

A training step touches embedding rows at random over gigabytes. With 4 KiB pages nearly every row
access also misses the TLB, and the page walk's own entries are cold after the dense part of the
step has run (twice as costly under a hypervisor). ``empty_huge`` asks Linux for 2 MiB pages
(``madvise(MADV_HUGEPAGE)``, honoured when ``/sys/kernel/mm/transparent_hugepage/enabled`` is
``always`` or ``madvise``) before the first touch; elsewhere it is a plain ``torch.empty``. The
contents and the tensor are ordinary: only the page size changes.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Optional

import torch

HUGE_PAGE_BYTES = 2 << 20
MADV_HUGEPAGE = 14  # Linux
MIN_BYTES = 4 * HUGE_PAGE_BYTES  # smaller buffers gain nothing measurable

_madvise = None


def _libc_madvise():
    global _madvise
    if _madvise is None:
        try:
            function = ctypes.CDLL(None, use_errno=True).madvise
            function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            function.restype = ctypes.c_int
            _madvise = function
        except (OSError, AttributeError):
            _madvise = False
    return _madvise


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask for huge pages under the whole 2 MiB-aligned part of ``tensor``'s memory (CPU, Linux;
    call before the memory is first written). True when the kernel accepted the advice."""
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.device.type != "cpu" or not sys.platform.startswith("linux") or nbytes < MIN_BYTES:
        return False
    madvise = _libc_madvise()
    if not madvise:
        return False
    start = tensor.data_ptr()
    aligned = (start + HUGE_PAGE_BYTES - 1) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    end = (start + nbytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    return end > aligned and madvise(aligned, end - aligned, MADV_HUGEPAGE) == 0


def empty_huge(numel: int, dtype: torch.dtype, device: Optional[torch.device | str] = None) -> torch.Tensor:
    """``torch.empty(numel, dtype=dtype, device=device)``, on huge pages when it is a large CPU
    buffer (see the module docstring)."""
    tensor = torch.empty(numel, dtype=dtype, device=device)
    advise_huge_pages(tensor)
    return tensor
