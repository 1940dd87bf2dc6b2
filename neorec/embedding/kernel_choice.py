"""Which implementation serves a ``TableBatchedEmbeddingBags``: ``"triton"`` (CUDA weights,
``triton_path.py``), ``"native"`` (CPU fp32 weights, the C kernels of ``native_path.py``) or
``"torch"`` (any device, precision and optimizer: torch ops in ``tbe.py``).

``kernel="auto"`` takes Triton for CUDA weights and the native kernels for CPU weights wherever
they can serve the module, else torch ops; ``"triton"`` / ``"native"`` insist (ValueError saying
why when they cannot); ``"torch"`` always takes torch ops.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from neorec.embedding.native_path import native_unsupported_reason
from neorec.embedding.triton_path import triton_unsupported_reason

if TYPE_CHECKING:  # pragma: no cover
    from neorec.embedding.tbe import TableBatchedEmbeddingBags

KERNELS = ("auto", "torch", "triton", "native")


def check_kernel(kernel: str) -> str:
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    return kernel


def choose_kernel(module: "TableBatchedEmbeddingBags", kernel: str) -> str:
    """The path ("triton", "native" or "torch") that runs ``module`` for the asked ``kernel``."""
    check_kernel(kernel)
    if kernel == "torch":
        return "torch"
    if kernel == "triton":
        reason = triton_unsupported_reason(module)
        if reason is not None:
            raise ValueError(f"kernel='triton' was asked for but {reason}")
        return "triton"
    if kernel == "native":
        reason = native_unsupported_reason(module)
        if reason is not None:
            raise ValueError(f"kernel='native' was asked for but {reason}")
        return "native"
    if module.weights.is_cuda:
        return "triton" if triton_unsupported_reason(module) is None else "torch"
    return "native" if native_unsupported_reason(module) is None else "torch"


def kernel_summary(module: "TableBatchedEmbeddingBags") -> str:
    """The path serving ``module`` and, when "auto" fell back to torch ops, why (for a run's header)."""
    path = module.kernel_path()
    if path != "torch" or module.kernel == "torch":
        return path
    reason = triton_unsupported_reason(module) if module.weights.is_cuda else native_unsupported_reason(module)
    return f"torch ({reason})" if reason else path
