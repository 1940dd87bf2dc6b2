"""Build and load neorec's native CPU kernels (``tbe.c``: the table-batched embedding op,
``interaction.c``: the DLRM dot interaction, ``blocks.c``: row-by-row column-block copies).

The C sources ship with the package and are compiled on first use with the system C compiler
(``$CC``, else ``cc`` / ``gcc`` / ``clang``; ``-O3 -march=native``, no fast-math) into one shared
library in a cache folder (``$NEOREC_KERNEL_CACHE``, else ``~/.cache/neorec/kernels``), keyed by a
hash of the sources, the flags, the compiler command and its version and this CPU's kind
(``_cpu_signature``); later processes load the cached library with ctypes (the first build takes
several seconds: ~10 s on this project's 2-core machine). When that folder cannot be written, the
build goes to a per-user folder under the temp directory, used only while it is this user's alone
(owned by them, writable by no one else, not a link), else to a fresh private temporary folder: a
library someone else could have put there is never loaded.

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
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import warnings
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
    """The compiler command: ``$CC`` (it may carry words of its own, as ``ccache gcc``) when its
    program is on the PATH, else the first of cc / gcc / clang there (None when there is none)."""
    words = shlex.split(os.environ.get("CC", ""))
    if words and shutil.which(words[0]):
        return shlex.join([shutil.which(words[0]), *words[1:]])
    for name in ("cc", "gcc", "clang"):
        if shutil.which(name):
            if words:  # said, not silently replaced
                warnings.warn(f"CC={os.environ['CC']!r}: {words[0]!r} is not on the PATH; the native kernels "
                              f"are built with {shutil.which(name)}")
            return shutil.which(name)
    return None


# /proc/cpuinfo fields that change while the machine runs or name one core: not the CPU's kind
_VOLATILE_CPU_FIELDS = ("processor", "cpu mhz", "bogomips", "core id", "physical id", "apicid", "initial apicid",
                        "siblings", "cpu cores")


def _cpu_signature(cpuinfo: Optional[str] = None) -> str:
    """What identifies this CPU's kind for ``-march=native``: every distinct line of /proc/cpuinfo
    but the volatile ones (x86 names its model and flags; ARM its implementer, part and features)."""
    try:
        if cpuinfo is None:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
    except OSError:
        return platform.processor()
    lines = {line.strip() for line in cpuinfo.splitlines()
             if line.strip() and line.split(":", 1)[0].strip().lower() not in _VOLATILE_CPU_FIELDS}
    return "\n".join(sorted(lines))


def cache_dir() -> Optional[Path]:
    """``$NEOREC_KERNEL_CACHE``, else ``~/.cache/neorec/kernels``; None without a home folder
    (no HOME and no passwd entry: containers run as an unnamed user)."""
    root = os.environ.get("NEOREC_KERNEL_CACHE")
    if root:  # absolute: dlopen searches the system's folders for a name without a slash
        return Path(root).expanduser().absolute()
    try:
        return Path.home() / ".cache" / "neorec" / "kernels"
    except (RuntimeError, KeyError):
        return None


def _writable_cache() -> Path:
    """``cache_dir()``, or when that cannot be created a per-user folder under the shared temp
    directory, if it is this user's alone (``_private``), else a fresh private temporary folder."""
    folder = cache_dir()
    try:
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
            if os.access(folder, os.W_OK):
                return folder
    except OSError:
        pass
    folder = Path(tempfile.gettempdir()) / f"neorec-kernels-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        if _private(folder):
            return folder
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix="neorec-kernels-"))  # mode 0700, a name no one could foresee


def _private(folder: Path) -> bool:
    """A real folder (not a link) owned by this user that no one else may write to: nothing in it
    can have been put there by another user of the machine."""
    info = os.lstat(folder)
    owner = info.st_uid == os.getuid() if hasattr(os, "getuid") else True
    return stat.S_ISDIR(info.st_mode) and owner and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _build(compiler: str) -> Path:
    """The cached library for this source, compiler command and CPU (compiled now when missing). A
    compiler without OpenMP support (e.g. clang without libomp) gets a single-threaded build, said
    by a warning; once cached, later processes load it without trying OpenMP again."""
    compiler_words = shlex.split(compiler)
    version = subprocess.run([*compiler_words, "--version"], capture_output=True, text=True, timeout=60).stdout
    # the command's own words too: `gcc -fsanitize=address` prints gcc's version but builds another library
    inputs = [*(s.read_text() for s in SOURCES + HEADERS), shlex.join(compiler_words), version, _cpu_signature(),
              platform.machine()]
    builds = []  # (flags, file name): with OpenMP, then without
    for flags in (FLAGS, [f for f in FLAGS if f != "-fopenmp"] + ["-Wno-unknown-pragmas"]):
        digest = hashlib.sha256("\0".join(inputs + [" ".join(flags)]).encode()).hexdigest()[:16]
        builds.append((flags, f"neorec_cpu-{digest}.so"))
    folder = _writable_cache()
    for index, (_, name) in enumerate(builds):
        for place in (cache_dir(), folder):  # a read-only cache may hold it
            if place is not None and (place / name).exists():
                if index:
                    _warn_single_threaded(place / name)
                return place / name
    errors = []
    for index, (flags, name) in enumerate(builds):
        target = folder / name
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            command = [*compiler_words, *flags, *map(str, SOURCES), "-o", str(built), "-lm"]
            result = subprocess.run(command, capture_output=True, text=True, timeout=300)
            if result.returncode == 0:
                os.replace(built, target)  # atomic: concurrent builders (ranks) each rename a complete file
                if index:
                    _warn_single_threaded(target, errors[0])
                return target
        said = (result.stderr.strip() + "\n" + result.stdout.strip()).strip()
        errors.append(f"exit code {result.returncode}" + (f":\n{said}" if said else
                      f", without a message; the command was: {shlex.join(command)}"))
    raise NativeUnavailable(f"compiling {[s.name for s in SOURCES]} with {compiler} failed, {errors[0]}"
                            + (f"\nwithout -fopenmp: {errors[1]}" if errors[1] != errors[0] else ""))


def _warn_single_threaded(library: Path, why: str = "") -> None:
    warnings.warn(f"the native kernels are built without OpenMP: they run on one thread ({library}; "
                  f"{'-fopenmp failed, ' + ' '.join(why.split())[:300] + '; ' if why else ''}"
                  "with a compiler that supports -fopenmp, remove that file to build them again)")


def _load_library(path: Path) -> ctypes.CDLL:
    try:
        return ctypes.CDLL(str(path))
    except OSError as error:
        if "failed to map segment" in str(error):  # built but not mappable executable: a folder mounted noexec
            raise OSError(f"{error} (is {path.parent} on a noexec mount? set NEOREC_KERNEL_CACHE to another "
                          "folder)") from None
        raise


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
            library = _load_library(_build(compiler))
            for name, (restype, argtypes) in SIGNATURES.items():
                function = getattr(library, name)
                function.restype, function.argtypes = restype, argtypes
        except (NativeUnavailable, OSError, subprocess.SubprocessError, RuntimeError, ValueError) as error:
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
