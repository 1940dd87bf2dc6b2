"""The SSD row store: rows of a cached embedding table in a file, read and written with
``pread``/``pwrite``, so that a table larger than memory trains through a cache with bounded
resident memory.

    store = SsdRowStore.create("runs/ssd/t_user", num_rows=10**8, dim=64, precision="fp16",
                               state={"momentum1": 1})
    store = SsdRowStore.open("runs/ssd/t_user")       # reopen after close()

Record layout, precisions and the read/write API are those of ``RowStore`` (``storage.py``).

SSD store files: ``<path>/rows.bin`` (the records) and ``<path>/meta.json`` (format, shape,
precision, fields, whether the rows were flushed, and as of the last flush the trainer's
``training_state`` (the optimizer step) and the stochastic-rounding generator's state). Creation is atomic (built in a temporary
directory, fsynced, renamed) and allocates the whole file up front (``posix_fallocate``), so a
full disk is an error at creation, not a SIGBUS when a row is first written. One process at a time:
an open store holds an exclusive lock (``flock`` on ``<parent>/.<name>.lock``, released by the
kernel when the process ends), and creating or opening a store another process holds is refused.
The file is the table's working storage, not a checkpoint: after
``flush()`` it is durable; a store written after its last flush is marked unclean and reopening it
is refused unless ``allow_unclean=True``.

Resident memory is bounded: rows are read and written with ``preadv``/``pwritev`` (one call per run
of consecutive ids), so the process holds only the rows it asked for; the page cache keeps what
the kernel chooses, reclaimable. Reading rows through a memory map instead (as this store first
did) mapped up to the kernel's fault-around window (64 KiB) per row read from cached pages, past
its memory budget (2048 random 256-byte rows read and written per operation, 2M rows, 256 MiB
budget: 11.0-11.6 ms with 473 MiB mapped; 22 ms mapped once the budget was kept; pread/pwrite
12.6-13.5 ms with nothing mapped). A mapping is
still used to initialise the file (``write_range``: sequential), its pages released
(``madvise(MADV_DONTNEED)``) whenever about ``resident_budget_bytes`` have been written.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import shutil
from pathlib import Path
from typing import Callable, Dict, Mapping, Optional

import numpy as np
import torch

from neorec.embedding.storage import RowFormat, RowStore, row_format
from neorec.files import LockHeld, lock_file, write_atomic
from neorec.signals import signals_held

_FORMAT = "neorec-row-store"
_VERSION = 1


class SsdRowStore(RowStore):
    """Rows in a memory-mapped file ``<path>/rows.bin`` described by ``<path>/meta.json``.

    Build with ``SsdRowStore.create(path, ...)`` (atomic; fails if ``path`` exists unless
    ``overwrite``) or reopen with ``SsdRowStore.open(path)``.
    """

    kind = "ssd"
    DEFAULT_RESIDENT_BUDGET = 256 << 20

    def __init__(self, path: Path, meta: Dict, resident_budget_bytes: int, name: str = "",
                 lock: Optional[int] = None) -> None:
        fmt = RowFormat.from_json(meta["format"])
        num_rows = int(meta["num_rows"])
        self.path = Path(path)
        self._meta = meta
        self._lock: Optional[int] = None  # the flock's descriptor: owned once construction succeeded
        self.resident_budget_bytes = int(resident_budget_bytes)
        self._file = open(self.path / "rows.bin", "r+b")
        size = os.fstat(self._file.fileno()).st_size
        if size != num_rows * fmt.record_bytes:
            self._file.close()
            raise ValueError(f"row store {str(path)!r}: rows.bin holds {size} bytes, expected "
                             f"{num_rows} rows x {fmt.record_bytes} bytes = {num_rows * fmt.record_bytes}")
        self._map = mmap.mmap(self._file.fileno(), size, access=mmap.ACCESS_WRITE)  # write_range only
        array = np.frombuffer(self._map, dtype=np.uint8).reshape(num_rows, fmt.record_bytes)
        super().__init__(torch.from_numpy(array), fmt, bool(meta["stochastic_rounding"]), meta["seed"],
                         name or self.path.name)
        self._clean = bool(meta["clean"])
        self.training_state = dict(meta.get("training", {}))
        if meta.get("rounding_state"):  # go on with the noise where the last flush left it
            self._generator.set_state(torch.tensor(list(bytes.fromhex(meta["rounding_state"])), dtype=torch.uint8))
        self._touched_bytes = 0
        self.releases = 0
        self._lock = lock  # None for a store being built (its creator holds the lock)

    # ------------------------------------------------------------------------------ create / open
    @classmethod
    def create(cls, path: str | os.PathLike, num_rows: int, dim: int, precision: str = "fp32",
               state: Optional[Mapping[str, int]] = None, with_counts: bool = False,
               stochastic_rounding: bool = True, seed: Optional[int] = 0,
               fill: Optional[Callable[["SsdRowStore"], None]] = None, overwrite: bool = False,
               resident_budget_bytes: int = DEFAULT_RESIDENT_BUDGET) -> "SsdRowStore":
        """Create the store at ``path`` (a directory). ``fill(store)`` initialises the rows (e.g.
        with ``store.fill(...)``) before the store is published; without it rows and state are 0."""
        path = Path(path)
        if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows <= 0:
            raise ValueError(f"row store {str(path)!r}: num_rows must be a positive integer, got {num_rows!r}")
        fmt = row_format(dim, precision, state, with_counts)
        if path.exists() and not overwrite:
            raise ValueError(f"row store {str(path)!r} already exists; open it with SsdRowStore.open or pass overwrite=True")
        lock = _lock(path)  # before anything is replaced: another process may be using the store
        tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
        for stale in path.parent.iterdir():  # left by creators killed mid-way: under the lock, none is live
            if stale.name.startswith(f".{path.name}.tmp-") and stale != tmp:
                shutil.rmtree(stale, ignore_errors=True)
        meta = {"format_name": _FORMAT, "version": _VERSION, "num_rows": num_rows, "format": fmt.to_json(),
                "stochastic_rounding": bool(stochastic_rounding), "seed": seed, "clean": True}
        try:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
            _allocate(tmp / "rows.bin", num_rows * fmt.record_bytes, path)
            _write_json(tmp / "meta.json", meta)
            store = cls(tmp, meta, resident_budget_bytes, name=path.name)
            if fill is not None:
                fill(store)
            store.flush()
            store._close_map()
            _fsync_dir(tmp)
            if path.exists():
                shutil.rmtree(path)
            os.replace(tmp, path)
            _fsync_dir(path.parent)
        except BaseException:
            with signals_held():  # (a second Ctrl-C cut the removal short: a file of the table's size was left)
                shutil.rmtree(tmp, ignore_errors=True)
                os.close(lock)
            raise
        return cls.open(path, resident_budget_bytes=resident_budget_bytes, _lock_fd=lock)

    @classmethod
    def open(cls, path: str | os.PathLike, allow_unclean: bool = False,
             resident_budget_bytes: int = DEFAULT_RESIDENT_BUDGET, _lock_fd: Optional[int] = None) -> "SsdRowStore":
        """Reopen a store made by ``create``. Refuses one written after its last flush (a crash
        or a missing ``close()``) unless ``allow_unclean``, and one another process has open."""
        path = Path(path)
        lock = _lock(path) if _lock_fd is None else _lock_fd
        try:
            return cls(path, cls._read_meta(path, allow_unclean), resident_budget_bytes, lock=lock)
        except BaseException:
            os.close(lock)
            raise

    @staticmethod
    def _read_meta(path: Path, allow_unclean: bool) -> Dict:
        meta_path = path / "meta.json"
        if not meta_path.is_file():
            raise ValueError(f"row store {str(path)!r}: no meta.json there (not a row store, or never created)")
        try:
            meta = json.loads(meta_path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"row store {str(path)!r}: meta.json is not valid JSON: {exc}") from None
        if meta.get("format_name") != _FORMAT or meta.get("version") != _VERSION:
            raise ValueError(f"row store {str(path)!r}: unknown format {meta.get('format_name')!r} "
                             f"version {meta.get('version')!r}; expected {_FORMAT!r} version {_VERSION}")
        missing = [key for key in ("format", "num_rows", "stochastic_rounding", "seed", "clean") if key not in meta]
        if missing:
            raise ValueError(f"row store {str(path)!r}: meta.json lacks {', '.join(missing)} (damaged or edited)")
        if not meta["clean"] and not allow_unclean:
            raise ValueError(f"row store {str(path)!r} was written after its last flush (crash or missing "
                             f"close()); its rows may mix old and new values. Pass allow_unclean=True to open it anyway")
        return meta

    # ------------------------------------------------------------------------------ access
    def _runs(self, ids: torch.Tensor):
        """(order that sorts ``ids``, sorted ids, [(start, end)] runs of consecutive sorted ids)."""
        values = ids.numpy()
        order = np.argsort(values, kind="stable")
        ordered = values[order]
        cuts = (np.flatnonzero(np.diff(ordered) != 1) + 1).tolist()
        return order, ordered, list(zip([0] + cuts, cuts + [len(ordered)])) if len(ordered) else []

    def _gather(self, ids: torch.Tensor, start: int = 0, end: Optional[int] = None) -> torch.Tensor:
        end = self.format.record_bytes if end is None else end
        size, fd = self.format.record_bytes, self._file.fileno()
        order, ordered, runs = self._runs(ids)
        records = np.empty((len(ordered), size), dtype=np.uint8)
        for first, last in runs:  # whole records, one call per run of consecutive ids
            view = records[first:last].reshape(-1)
            if os.preadv(fd, [view], int(ordered[first]) * size) != view.nbytes:
                raise OSError(errno.EIO, f"{self._where()}: short read of rows.bin", str(self.path / "rows.bin"))
        out = np.empty((len(ordered), end - start), dtype=np.uint8)
        out[order] = records[:, start:end]
        self.rows_read += len(ordered)
        self.bytes_read += out.size
        return torch.from_numpy(out) if len(ordered) else torch.empty(0, end - start, dtype=torch.uint8)  # (strides)

    def _scatter(self, ids: torch.Tensor, records: torch.Tensor, start: int = 0) -> None:
        self._before_write()
        size, fd = self.format.record_bytes, self._file.fileno()
        data = np.ascontiguousarray(records.numpy())
        if start == 0 and data.shape[1] == size:  # whole records: one call per run of consecutive ids
            order, ordered, runs = self._runs(ids)
            data = data[order]
            for first, last in runs:
                view = data[first:last].reshape(-1)
                if os.pwritev(fd, [view], int(ordered[first]) * size) != view.nbytes:
                    raise OSError(errno.EIO, f"{self._where()}: short write of rows.bin", str(self.path / "rows.bin"))
        else:  # a field of each record (counts, state)
            for row, target in zip(data, ids.tolist()):
                if os.pwrite(fd, row, target * size + start) != row.nbytes:
                    raise OSError(errno.EIO, f"{self._where()}: short write of rows.bin", str(self.path / "rows.bin"))
        self.rows_written += data.shape[0]
        self.bytes_written += data.size

    # ------------------------------------------------------------------------------ hooks
    def _touched(self, num_records: int) -> None:  # write_range's sequential writes through the mapping
        self._touched_bytes += num_records * self.format.record_bytes
        if self._touched_bytes >= self.resident_budget_bytes:
            self.release_pages()

    def release_pages(self) -> None:
        """Drop this process's mapped pages (RSS; the mapping serves ``write_range`` only); written
        data stays in the page cache."""
        if not self.closed and hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED)
            self.releases += 1
        self._touched_bytes = 0

    def _before_write(self) -> None:
        if self._clean:  # the mark first: one that failed to be written (a full disk) is tried again
            _write_json(self.path / "meta.json", dict(self._meta, clean=False))
            self._clean = False
            self._meta["clean"] = False

    # ------------------------------------------------------------------------------ lifecycle
    def flush(self) -> None:
        """msync the mapping (``write_range``'s writes), fsync the file (``pwrite``'s), then mark the
        store clean, with its ``training_state`` and the stochastic-rounding generator's state (a
        reopened store goes on with both)."""
        self._check_open()
        self._map.flush()
        os.fsync(self._file.fileno())
        meta = dict(self._meta, clean=True, training=dict(self.training_state),
                    rounding_state=bytes(self._generator.get_state().tolist()).hex())
        if meta != self._meta:
            self._clean = True
            self._meta = meta
            _write_json(self.path / "meta.json", self._meta)

    def _close_map(self) -> None:
        self.records = torch.empty(0, self.format.record_bytes, dtype=torch.uint8)
        self._map.close()
        self._file.close()
        self._release_lock()
        self.closed = True

    def _release_lock(self) -> None:
        lock, self._lock = getattr(self, "_lock", None), None
        if lock is not None:
            os.close(lock)  # closing the descriptor drops the flock

    def close(self) -> None:
        if not self.closed:
            self.flush()
            self._close_map()

    def __del__(self) -> None:
        # dropped without close(): like a crash, the rows written since the last flush reach the
        # file (page cache) but the store stays marked unclean; just release the descriptor
        file = getattr(self, "_file", None)
        if file is not None and not file.closed:
            file.close()
        self._release_lock()


def _lock(path: Path) -> int:
    """The store's exclusive lock, on ``<parent>/.<name>.lock`` (beside the store, so that it
    outlives the store directory being replaced); the descriptor holds it. Refused while another
    process holds it."""
    real = path.resolve()  # (a symlink to the store had a lock file of its own: two writers)
    try:
        return lock_file(real.parent / f".{real.name}.lock")
    except LockHeld as held:
        if held.holder == str(os.getpid()):
            raise ValueError(f"row store {str(path)!r} is already open in this process; close() it before opening "
                             f"it again, or give each table its own store") from None
        raise ValueError(f"row store {str(path)!r} is in use by another process (pid {held.holder}); two runs "
                         f"must not share an SSD store: give this one another embedding.location.ssd_dir "
                         f"(or train.output_dir)") from None


def _allocate(file: Path, size: int, store: Path) -> None:
    """Create ``file`` with ``size`` bytes of zeros, its blocks reserved where the file system
    can (a sparse file otherwise): no space left is an error naming the store, now."""
    with open(file, "wb") as f:
        try:
            if size and hasattr(os, "posix_fallocate"):
                os.posix_fallocate(f.fileno(), 0, size)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise OSError(exc.errno, f"no space left for row store {str(store)!r}: it needs {size:,} bytes "
                                         f"on {str(store.parent)!r}") from None
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
        f.truncate(size)  # reads as zeros; a file system without fallocate leaves it sparse


def _write_json(path: Path, data: Dict) -> None:
    """Atomic and durable (the rename synced with its folder): after a power loss the store is not
    found marked clean while its "unclean" mark had been written."""
    write_atomic(path, json.dumps(data, indent=1, sort_keys=True))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
