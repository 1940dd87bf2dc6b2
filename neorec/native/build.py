"""Build and load neorec's native CPU kernels (``tbe.c``: the table-batched embedding op,
``interaction.c``: the DLRM dot interaction, ``blocks.c``: row-by-row column-block copies).

The C sources ship with the package and are compiled on first use with the system C compiler
(``$CC``, else ``cc`` / ``gcc`` / ``clang``; ``-O3 -march=native``, no fast-math) into one shared
library in a cache folder (``$NEOREC_KERNEL_CACHE``, else ``~/.cache/neorec/kernels``), keyed by a
hash of the sources, the flags, the compiler's version and this CPU's model and flags (a per-user
folder under the temp directory when that one cannot be written); later
processes load the cached library (the first build takes about a second) with ctypes.

Threads: the kernels parallelise with OpenMP. The library is loaded after torch, whose libgomp
(soname ``libgomp.so.1``) the dynamic linker then reuses, so the kernels run on torch's own thread
pool: no second set of spinning threads competes for the cores (``torch.set_num_threads`` bounds
both). Where torch uses another OpenMP runtime the kernels still run, on their own pool.

No compiler, a failed build, or ``NEOREC_NATIVE=0`` in the environment: ``native_available()``
says why, and the callers keep their torch ops (or raise when the native kernels were asked for by
name).

    python -c "from neorec.native import native_available; print(native_available() or 'native kernels ready')"
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
from pathlib import Path
from typing import Optional

SOURCES = [Path(__file__).with_name(name) for name in ("tbe.c", "interaction.c", "blocks.c")]
HEADERS = [Path(__file__).with_name("common.h")]
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-std=gnu11", "-shared", "-fPIC", "-fopenmp"]

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_I32 = ctypes.c_int32
_F32 = ctypes.c_float
SIGNATURES = {
    "neorec_forward": (_I64, [_P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I64, _I64, _P, _I64, _P]),
    "neorec_backward_update": (_I64, [_I32, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I64, _I64, _P,
                                      _P, _I64, _F32, _F32, _F32, _P, _P, _P, _P, _P, _P, _P]),
    "neorec_dot_interaction_forward": (None, [_P, _P, _I64, _I64, _I64, _I32, _I64, _I64, _P]),
    "neorec_dot_interaction_backward": (None, [_P, _I64, _P, _P, _I64, _I64, _I64, _I32, _I64, _I64, _P, _P]),
    "neorec_dot_interaction_forward_blocks": (None, [_P, _I64, _I64, _I32, _I64, _I64, _I64, _P, _P, _P, _P, _P]),
    "neorec_dot_interaction_backward_blocks": (None, [_P, _I64, _P, _I64, _I64, _I32, _I64, _I64, _I64, _P, _P,
                                                      _P, _P, _P, _P, _P]),
    "neorec_dot_interaction_forward_vectors": (None, [_P, _I64, _I64, _I32, _I64, _I64, _P, _P, _P]),
    "neorec_dot_interaction_backward_vectors": (None, [_P, _I64, _P, _I64, _I64, _I32, _I64, _I64, _P, _P, _P, _P,
                                                       _P]),
    "neorec_copy_blocks": (None, [_I64, _I64, _P, _P, _P, _P, _P, _I64]),
}

_lock = threading.Lock()
_library: Optional[ctypes.CDLL] = None
_failure: Optional[str] = None


class NativeUnavailable(RuntimeError):
    """The native kernels cannot be built or loaded here (the message says why)."""


def find_compiler() -> Optional[str]:
    """``$CC``, else the first of cc / gcc / clang on the PATH (None when there is none)."""
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


def _writable_cache() -> Path:
    """``cache_dir()``, or a per-user folder under the temp directory when that cannot be created."""
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if os.access(folder, os.W_OK):
            return folder
    except OSError:
        pass
    folder = Path(tempfile.gettempdir()) / f"neorec-kernels-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _build(compiler: str) -> Path:
    """The cached library for this source, compiler and CPU (compiled now when missing). A compiler
    without OpenMP support (e.g. clang without libomp) gets a single-threaded build."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    inputs = [*(s.read_text() for s in SOURCES + HEADERS), version, _cpu_signature(), platform.machine()]
    folder = _writable_cache()
    errors = []
    for flags in (FLAGS, [f for f in FLAGS if f != "-fopenmp"] + ["-Wno-unknown-pragmas"]):
        digest = hashlib.sha256("\0".join(inputs + [" ".join(flags)]).encode()).hexdigest()[:16]
        name = f"neorec_cpu-{digest}.so"
        for built_before in (cache_dir() / name, folder / name):  # a read-only cache may hold it
            if built_before.exists():
                return built_before
        target = folder / name
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            result = subprocess.run([compiler, *flags, *map(str, SOURCES), "-o", str(built), "-lm"],
                                    capture_output=True, text=True, timeout=300)
            if result.returncode == 0:
                os.replace(built, target)  # atomic: concurrent builders (ranks) each rename a complete file
                return target
        errors.append(result.stderr.strip())
    raise NativeUnavailable(f"compiling {[s.name for s in SOURCES]} with {compiler} failed:\n{errors[0]}")


def load() -> ctypes.CDLL:
    """The loaded kernel library (built on first use); NativeUnavailable if that is impossible."""
    global _library, _failure
    if os.environ.get("NEOREC_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        raise NativeUnavailable("the native kernels are switched off (NEOREC_NATIVE=0)")
    with _lock:
        if _library is not None:
            return _library
        if _failure is not None:
            raise NativeUnavailable(_failure)
        try:
            if sys.byteorder != "little" or ctypes.sizeof(ctypes.c_void_p) != 8:
                raise NativeUnavailable("the native kernels need a 64-bit little-endian machine")
            compiler = find_compiler()
            if compiler is None:
                raise NativeUnavailable("no C compiler found (set CC, or install gcc or clang)")
            library = ctypes.CDLL(str(_build(compiler)))
            for name, (restype, argtypes) in SIGNATURES.items():
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
