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
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_json_file(path: str | os.PathLike, what: str) -> Any:
    """The parsed JSON of ``path``; ValueError naming ``what`` and the file if it is missing or
    not valid JSON."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{what} {str(p)!r} not found")
    try:
        return json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{what} {p}: not valid JSON: {exc}") from None
