"""A folder in which files cannot be created, for tests that run as root (which permission bits do
not stop): ``refuse_writes_in(monkeypatch, folder)`` makes ``open`` and ``os.open`` refuse to create
or write files directly inside ``folder`` with EACCES, as a read-only folder would."""

import builtins
import errno
import os


def refuse_writes_in(monkeypatch, folder) -> None:
    """Files cannot be created in ``folder`` (a read-only folder, as root sees none)."""
    real_open, real_os_open = builtins.open, os.open
    folder = os.path.abspath(folder)

    def inside(path) -> bool:
        return isinstance(path, (str, os.PathLike)) and os.path.dirname(os.path.abspath(path)) == folder

    def guarded_open(file, mode="r", *args, **kwargs):
        if inside(file) and any(c in mode for c in "wax+"):
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return real_open(file, mode, *args, **kwargs)

    def guarded_os_open(path, flags, *args, **kwargs):
        if inside(path) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_os_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", guarded_open)
    monkeypatch.setattr(os, "open", guarded_os_open)
