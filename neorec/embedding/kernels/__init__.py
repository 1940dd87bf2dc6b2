"""Kernels of the table-batched embedding op.

* ``layout``: ``TableBatchedLayout``, the metadata both implementations take (torch only).
* ``reference``: plain-torch forward and fused backward-optimizer (loops; the tests' yardstick).
* ``triton_tbe``: the Triton kernels (optional: ``pip install 'neorec[gpu]'``). Import it only
  after ``triton_available()`` says yes; nothing here imports triton at package import time.
* ``triton_cache``: Triton kernels of the embedding cache's tag lookup and victim choice (same
  rule; dispatched by ``neorec/embedding/cache_kernels.py``).

Checks on a CPU-only machine: ``TRITON_INTERPRET=1 python -m pytest tests/gpu -m triton -q``
"""

from __future__ import annotations

import importlib.util
import os

from neorec.embedding.kernels.layout import OPTIMIZER_KINDS, TableBatchedLayout

__all__ = ["OPTIMIZER_KINDS", "TableBatchedLayout", "triton_available", "triton_interpreting",
           "triton_unavailable_reason"]


def triton_interpreting() -> bool:
    """True when ``TRITON_INTERPRET`` asks triton to run kernels in its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def triton_unavailable_reason() -> str | None:
    """Why the Triton kernels cannot run here (None when they can: triton is installed and either
    a CUDA device is present or ``TRITON_INTERPRET=1``, for CPU tensors). Does not import triton."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install 'neorec[gpu]')"
    if triton_interpreting():
        return None
    import torch

    if not torch.cuda.is_available():
        return "there is no CUDA device (TRITON_INTERPRET=1 runs the kernels on CPU tensors, slowly)"
    return None


def triton_available() -> bool:
    """Whether the Triton kernels can run here (``triton_unavailable_reason`` says why not)."""
    return triton_unavailable_reason() is None
