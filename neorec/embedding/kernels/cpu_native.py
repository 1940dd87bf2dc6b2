"""Build and call the native CPU kernels of the table-batched embedding op (``cpu_tbe.c``).

The C source ships with the package and is compiled on first use with the system C compiler
(``$CC``, else ``cc`` / ``gcc`` / ``clang``; ``-O3 -march=native``) into a cache folder
(``$NEOREC_KERNEL_CACHE``, else ``~/.cache/neorec/kernels``), keyed by a hash of the source, the
flags, the compiler's version and this CPU's model and flags; later processes load the cached
library (about 1 s for the first build). Loaded with ctypes, whose calls release the GIL: the
kernels run on ``torch.get_num_threads()`` threads (a small pool of Python threads, each on a
disjoint range of bags or rows).

No compiler, or a failed build: ``native_available()`` says why and ``TableBatchedEmbeddingBags``
keeps its torch path (``kernel="auto"``) or raises (``kernel="native"``).

    python -c "from neorec.embedding.kernels.cpu_native import native_available; print(native_available())"
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

import torch

SOURCE = Path(__file__).with_name("cpu_tbe.c")
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-std=gnu11", "-shared", "-fPIC"]
KIND_CODES = {"sgd": 0, "rowwise_adagrad": 1, "adagrad": 2}

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_I32 = ctypes.c_int32
_F32 = ctypes.c_float
_SIGNATURES = {
    "neorec_forward": (_I64, [_P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _P]),
    "neorec_backward_update": (_I64, [_I32, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I64, _I64, _P,
                                      _I64, _I64, _F32, _F32, _F32, _P, _P, _P, _P, _P, _P, _P, _P]),
}

_lock = threading.Lock()
_library: Optional[ctypes.CDLL] = None
_failure: Optional[str] = None


class NativeUnavailable(RuntimeError):
    """The native kernels cannot be built or loaded here (the message says why)."""


def _compiler() -> Optional[str]:
    for name in [os.environ.get("CC", "")] + ["cc", "gcc", "clang"]:
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def cache_dir() -> Path:
    root = os.environ.get("NEOREC_KERNEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "neorec" / "kernels"


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    digest = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(FLAGS), version, _cpu_signature(),
                                       platform.machine()]).encode()).hexdigest()[:16]
    target = cache_dir() / f"cpu_tbe-{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"],
                                capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise NativeUnavailable(f"compiling {SOURCE.name} with {compiler} failed:\n{result.stderr.strip()}")
        os.replace(built, target)  # atomic: concurrent builders (ranks) each rename a complete file
    return target


def load() -> ctypes.CDLL:
    """The loaded kernel library (built on first use); NativeUnavailable if that is impossible."""
    global _library, _failure
    with _lock:
        if _library is not None:
            return _library
        if _failure is not None:
            raise NativeUnavailable(_failure)
        try:
            if sys.byteorder != "little" or ctypes.sizeof(ctypes.c_void_p) != 8:
                raise NativeUnavailable("the native kernels need a 64-bit little-endian machine")
            compiler = _compiler()
            if compiler is None:
                raise NativeUnavailable("no C compiler found (set CC, or install gcc or clang)")
            library = ctypes.CDLL(str(_build(compiler)))
            for name, (restype, argtypes) in _SIGNATURES.items():
                function = getattr(library, name)
                function.restype, function.argtypes = restype, argtypes
        except (NativeUnavailable, OSError, subprocess.SubprocessError) as error:
            _failure = str(error)
            raise NativeUnavailable(_failure) from None
        _library = library
        return library


def native_available() -> Optional[str]:
    """None when the native kernels are usable, else why not."""
    try:
        load()
    except NativeUnavailable as error:
        return str(error)
    return None


# ---------------------------------------------------------------------------------- threads
_pool: Optional[ThreadPoolExecutor] = None
_pool_size = 0


def _run_parallel(tasks: Sequence[Callable[[], object]]) -> List[object]:
    """Run ``tasks`` (ctypes calls, which release the GIL) on a pool of threads, the first on the
    calling thread; results in task order."""
    global _pool, _pool_size
    if len(tasks) == 1:
        return [tasks[0]()]
    if _pool is None or _pool_size < len(tasks) - 1:
        if _pool is not None:
            _pool.shutdown(wait=True)
        _pool_size = len(tasks) - 1
        _pool = ThreadPoolExecutor(max_workers=_pool_size, thread_name_prefix="neorec-tbe")
    futures = [_pool.submit(task) for task in tasks[1:]]
    first = tasks[0]()
    return [first] + [f.result() for f in futures]


def _split(bounds: torch.Tensor, count: int, parts: int) -> List[Tuple[int, int]]:
    """``parts`` contiguous ranges of [0, count) items whose cumulative work ``bounds`` [count + 1]
    is about equal (at least one item each, no empty range)."""
    if parts <= 1 or count <= 1:
        return [(0, count)]
    total = int(bounds[-1]) - int(bounds[0])
    targets = torch.tensor([int(bounds[0]) + total * k // parts for k in range(1, parts)], dtype=bounds.dtype)
    cuts = torch.searchsorted(bounds, targets).tolist()
    edges = sorted({0, count, *[min(max(c, 1), count - 1) for c in cuts]})
    return list(zip(edges[:-1], edges[1:]))


def _threads(work: int) -> int:
    """Threads worth starting for ``work`` values (a thread costs ~20 us to hand work to)."""
    return max(1, min(torch.get_num_threads(), work // 4096 or 1))


# ---------------------------------------------------------------------------------- kernels
class NativeKernels:
    """The native forward and fused backward of one table-batched layout (fp32 weights).

    Metadata tensors are kept as contiguous CPU tensors whose pointers are passed to the C
    functions; scratch buffers of the backward grow as needed and are reused."""

    def __init__(self, table_dims: Sequence[int], table_rows: Sequence[int], table_offsets: Sequence[int],
                 table_row_offsets: Sequence[int], feature_table: Sequence[int], feature_mean: Sequence[bool],
                 col_offsets: Sequence[int], total_rows: int) -> None:
        self.lib = load()
        self.table_dims = torch.tensor(list(table_dims), dtype=torch.int32)
        self.table_rows = torch.tensor(list(table_rows), dtype=torch.int64)
        self.table_offsets = torch.tensor(list(table_offsets), dtype=torch.int64)
        self.table_row_offsets = torch.tensor(list(table_row_offsets), dtype=torch.int64)
        self.feature_table = torch.tensor(list(feature_table), dtype=torch.int32)
        self.feature_mean = torch.tensor([int(m) for m in feature_mean], dtype=torch.int32)
        self.col_offsets = torch.tensor(list(col_offsets), dtype=torch.int64)
        self.num_features = len(self.feature_table)
        self.total_cols = sum(int(table_dims[t]) for t in feature_table)
        self.max_dim = max([int(d) for d in table_dims], default=1)
        self.total_rows = int(total_rows)
        self._feature_table = [int(t) for t in feature_table]  # host copy for splitting the work
        self._scratch: dict = {}

    def _buffer(self, name: str, size: int, dtype: torch.dtype) -> torch.Tensor:
        buffer = self._scratch.get(name)
        if buffer is None or buffer.numel() < size or buffer.dtype != dtype:
            buffer = torch.empty(max(size, 1), dtype=dtype)
            self._scratch[name] = buffer
        return buffer

    @staticmethod
    def _pointer(tensor: Optional[torch.Tensor]) -> Optional[int]:
        return None if tensor is None else tensor.data_ptr()

    def forward(self, weights: torch.Tensor, ids: torch.Tensor, bag_offsets: torch.Tensor,
                value_weights: Optional[torch.Tensor], batch_size: int) -> Tuple[torch.Tensor, int]:
        """-> (pooled [B, total_cols] fp32, -1 or the position of the first id outside its table).
        ``ids`` / ``bag_offsets`` int64 contiguous, ``value_weights`` fp32 contiguous or None."""
        out = torch.empty(batch_size, self.total_cols, dtype=torch.float32)
        num_bags = self.num_features * batch_size
        if num_bags == 0:
            return out, -1
        pointers = (weights.data_ptr(), self.table_offsets.data_ptr(), self.table_dims.data_ptr(),
                    self.table_rows.data_ptr(), self.feature_table.data_ptr(), self.feature_mean.data_ptr(),
                    self.col_offsets.data_ptr(), ids.data_ptr(), bag_offsets.data_ptr(),
                    self._pointer(value_weights), batch_size, self.total_cols)
        forward = self.lib.neorec_forward
        ranges = _split(bag_offsets, num_bags, _threads(ids.numel() + num_bags))
        bad = _run_parallel([lambda lo=lo, hi=hi: forward(*pointers, lo, hi, out.data_ptr()) for lo, hi in ranges])
        bad = [b for b in bad if b >= 0]
        return out, (min(bad) if bad else -1)

    def _table_groups(self, bag_offsets: torch.Tensor, batch_size: int, parts: int) -> List[Tuple[int, int]]:
        """Up to ``parts`` feature ranges [begin, end) with about equal numbers of values, cut only
        where the table changes (a table's features are adjacent), so no two share a row."""
        cuts = [f for f in range(1, self.num_features) if self._feature_table[f] != self._feature_table[f - 1]]
        if parts <= 1 or not cuts:
            return [(0, self.num_features)]
        value_starts = bag_offsets[:: batch_size].tolist()  # [F + 1]: values before feature f
        total = value_starts[-1] - value_starts[0]
        edges = [0]
        for k in range(1, parts):
            target = value_starts[0] + total * k / parts
            best = min(cuts, key=lambda f: abs(value_starts[f] - target))
            if best > edges[-1]:
                edges.append(best)
        edges.append(self.num_features)
        return list(zip(edges[:-1], edges[1:]))

    def backward_update(self, kind: str, weights: torch.Tensor, state: Optional[torch.Tensor], ids: torch.Tensor,
                        bag_offsets: torch.Tensor, value_weights: Optional[torch.Tensor], batch_size: int,
                        grad_output: torch.Tensor, learning_rate: float, eps: float, weight_decay: float,
                        modified: Optional[torch.Tensor] = None) -> None:
        """One optimizer step on every row the batch touched (ids already checked by forward).
        ``grad_output`` [B, total_cols] fp32 contiguous; ``modified``: [total_rows] bool or None.
        Tables are split into groups (one per thread); each group is sorted by row and updated."""
        first = int(bag_offsets[0])
        count = int(bag_offsets[-1]) - first
        if count == 0:
            return
        if count >= 2**31:
            raise ValueError(f"the native embedding kernels take < 2^31 ids per batch, got {count}")
        scaled = value_weights is not None or bool(self.feature_mean.any())
        buffers = [self._buffer(name, count, dtype) for name, dtype in (
            ("keys", torch.int32), ("keys_tmp", torch.int32), ("bags", torch.int32), ("bags_tmp", torch.int32),
            ("scales", torch.float32), ("scales_tmp", torch.float32)) if scaled or not name.startswith("scales")]
        groups = self._table_groups(bag_offsets, batch_size, _threads(count))
        gradient = self._buffer("gradient", len(groups) * self.max_dim, torch.float32)
        common = (KIND_CODES[kind], weights.data_ptr(), self._pointer(state), self.table_offsets.data_ptr(),
                  self.table_dims.data_ptr(), self.table_rows.data_ptr(), self.table_row_offsets.data_ptr(),
                  self.feature_table.data_ptr(),
                  self.feature_mean.data_ptr(), self.col_offsets.data_ptr(), ids.data_ptr(), bag_offsets.data_ptr(),
                  self._pointer(value_weights), batch_size, self.total_cols, grad_output.data_ptr())
        update = self.lib.neorec_backward_update
        tasks = []
        for index, (begin, end) in enumerate(groups):
            skip = int(bag_offsets[begin * batch_size]) - first  # this group's values start here
            scratch = [b.data_ptr() + 4 * skip for b in buffers] + [None, None] * (not scaled)
            tasks.append(lambda begin=begin, end=end, scratch=scratch, index=index:
                         update(*common, begin, end, float(learning_rate), float(eps),
                                float(weight_decay), self._pointer(modified), *scratch,
                                gradient.data_ptr() + 4 * index * self.max_dim))
        _run_parallel(tasks)
