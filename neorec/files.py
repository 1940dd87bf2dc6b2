"""Small file helpers shared by the package: atomic writes (temp file, fsync, rename, fsync of the
directory: a crash leaves the old file or the new one) and JSON files read with errors that name
the file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Write ``data`` (text as UTF-8, or bytes) to ``path`` atomically; creates the parent folder."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory; give a file name")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
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
