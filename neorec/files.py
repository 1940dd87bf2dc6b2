"""Small file helpers shared by the package: atomic writes (temp file, fsync, rename, fsync of the
directory: a crash leaves the old file or the new one), JSON files read with errors that name the
file, and exclusive locks between processes (``flock`` on a lock file)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import stat
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Tuple


NAME_MAX = 255  # bytes in one file name on Linux file systems
TEMPORARY = re.compile(r"\..+\.(\d+)\.tmp")  # what temporary_name gives, whatever the pid


def temporary_name(name: str, pid: Optional[int] = None) -> str:
    """The name ``write_atomic`` writes ``name`` under first: ``.<name>.<pid>.tmp``, with ``name``
    shortened (its start and a digest of the whole) where that would pass ``NAME_MAX`` bytes, so
    that any name the file system takes can be written atomically."""
    suffix = f".{os.getpid() if pid is None else pid}.tmp"
    if len(f".{name}{suffix}".encode()) <= NAME_MAX:
        return f".{name}{suffix}"
    digest = "~" + hashlib.sha256(name.encode()).hexdigest()[:16]
    room = NAME_MAX - len(f".{digest}{suffix}".encode())
    start = name.encode()[:room].decode(errors="ignore")  # whole characters only
    return f".{start}{digest}{suffix}"


STALE_TEMPORARY_SECONDS = 60.0


def process_alive(pid: int) -> bool:
    """Whether ``pid`` names a live process of this host (one this process may not signal, or a
    number no signal can name, counts as alive: its files are left alone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):
        return True
    return True


def sweep_temporaries(folder: str | os.PathLike) -> list[Path]:
    """Remove the temporaries a killed ``write_atomic`` left in ``folder`` (not its subfolders): those
    whose writer is no longer a process of this host and that were not written to for a minute (a
    writer outside the run holding the folder, ``neorec plan --out`` say, or one on another host of
    a shared file system, keeps its file). Returns the files removed."""
    removed = []
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return removed
    now = time.time()
    for p in entries:
        match = TEMPORARY.fullmatch(p.name)
        if not match or int(match.group(1)) == os.getpid() or process_alive(int(match.group(1))):
            continue
        try:
            info = os.lstat(p)
            if stat.S_ISREG(info.st_mode) and now - info.st_mtime > STALE_TEMPORARY_SECONDS:
                p.unlink()
                removed.append(p)
        except OSError:
            pass
    return removed


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Write ``data`` (text as UTF-8, or bytes) to ``path`` atomically; creates the parent folder."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory; give a file name")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(temporary_name(path.name))
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:  # named by the file being written, not by its temporary
        tmp.unlink(missing_ok=True)
        raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from None
    except BaseException:
        tmp.unlink(missing_ok=True)  # no half-written temporary left behind
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_json_file(path: str | os.PathLike, what: str) -> Any:
    """The parsed JSON of ``path``; ValueError naming ``what`` and the file if it is missing or
    not valid JSON."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{what} {str(p)!r} is a directory; give a .json file")
    if not p.is_file():
        raise ValueError(f"{what} {str(p)!r} not found")
    try:
        return json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{what} {p}: not valid JSON: {exc}") from None


def ensure_writable_dir(path: str | os.PathLike, what: str) -> Path:
    """Create the directory ``path`` if needed and check that a file can be written in it, so that
    a run learns at its start, not at its first save, that its output cannot be kept. ValueError
    naming ``what`` (the setting) otherwise."""
    p = Path(path)
    if p.is_symlink() and not p.exists():
        raise ValueError(f"{what} {str(p)!r} is a symbolic link to {os.readlink(p)!r}, which does not exist")
    if p.exists() and not p.is_dir():
        raise ValueError(f"{what} {str(p)!r} is a file, not a directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / f".neorec-write-test.{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ValueError(f"{what} {str(p)!r} is not a writable directory: {exc.strerror or exc}") from None
    return p


class LockHeld(Exception):
    """``lock_file``: another process holds the lock; ``holder`` is its pid as it wrote it."""

    def __init__(self, path: Path, holder: str) -> None:
        super().__init__(f"{path} is locked by process {holder}")
        self.holder = holder


DIR_LOCK = ".neorec.lock"


def hold_dir(path: str | os.PathLike, what: str) -> Optional[int]:
    """Lock the folder ``path`` for this run (``lock_file`` on ``<path>/.neorec.lock``): the
    descriptor to close when done, or None on a file system without locks. Held by another process:
    ValueError naming ``what`` (the setting) and that process."""
    try:
        fd = lock_file(Path(path) / DIR_LOCK)
    except LockHeld as exc:
        raise ValueError(f"{what} {str(path)!r} is in use by another run (process {exc.holder}): give this run "
                         f"another {what}, or wait for that one to end") from None
    except OSError:  # no locks on this file system: go on without (and sweep nothing: not known to be ours)
        return None
    sweep_temporaries(path)  # the half-written files of writers killed here (see sweep_temporaries)
    return fd


@contextlib.contextmanager
def holding_dirs(dirs: Iterable[Tuple[str | os.PathLike, str]]) -> Iterator[None]:
    """Hold ``hold_dir`` on each ``(path, what)`` of ``dirs`` (empty paths skipped, a folder named
    twice held once) while inside; released on leaving, also when taking one of them failed."""
    with contextlib.ExitStack() as stack:
        held = set()
        for path, what in dirs:
            if path and Path(path).resolve() not in held:
                held.add(Path(path).resolve())
                fd = hold_dir(path, what)
                if fd is not None:
                    stack.callback(os.close, fd)
        yield


def lock_file(path: str | os.PathLike, on_wait: Optional[Callable[[str], None]] = None) -> int:
    """Take an exclusive ``flock`` on ``path`` (created, with its folder); returns the descriptor
    that holds it (``os.close`` releases it; the kernel does when the process ends) and writes this
    process's pid into the file. Held by another process: raise ``LockHeld``, or with ``on_wait``
    call ``on_wait(holder pid)`` and wait for it. Other failures (a file system without locks) are
    ``OSError``s."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            if on_wait is None:
                raise LockHeld(path, holder) from None
            on_wait(holder)
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return fd
