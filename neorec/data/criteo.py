"""Criteo click logs: a streaming preprocessor from the raw TSV layout to memory-mapped binary
arrays, and a source that batches from the memory maps.

    neorec data write-criteo /tmp/day_0.tsv --lines 100000
    neorec data preprocess-criteo /tmp/day_0.tsv /tmp/criteo_bin --num-embeddings 100000

    from neorec.data.criteo import write_criteo_tsv, preprocess_criteo, CriteoSource

Raw layout: see ``neorec.data.criteo_tsv`` (label, 13 integer, 26 hexadecimal columns).

Processed layout (a directory; see ``preprocess_criteo``): ``dense.f32`` [N, 13] float32 =
log(1 + max(x, 0)) with missing = 0; ``categorical.i32`` (or ``.i64``) [N, 26] = a stable hash of
each hex value into [1, num_embeddings), missing = 0; ``labels.u8`` [N]; ``meta.json`` with the
counts, the format version and the source file's size, mtime and ``source_fingerprint`` (a changed
TSV is reprocessed).

Processes that preprocess the same directory (the ranks of a ``--nproc`` run, two runs on one TSV)
take turns on an exclusive lock beside the directory (``PROCESSED_DIR/train.lock`` for
``PROCESSED_DIR/train``): the first builds the copy,
the others wait and then use it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, List, Tuple

import numpy as np
import torch
from tqdm import tqdm

from neorec.data.batch import Batch
from neorec.data.config import (PROCESSED_DIR_SETTING, CriteoConfig, check_criteo_tsv, check_processed_dir,
                                no_rows_reason, processed_dir_error)
from neorec.data.criteo_tsv import (NUM_CATEGORICAL, NUM_COLUMNS, NUM_INTEGER, categorical_id,
                                    parse_chunk, write_criteo_tsv)
from neorec.data.source import EpochOrder, batch_ranges, check_batch_args, one_table_per_feature
from neorec.embedding.config import TableConfig
from neorec.files import lock_file, process_alive
from neorec.sparse.jagged import KeyedJaggedTensor

__all__ = ["CriteoSource", "CriteoArrays", "PreprocessStats", "preprocess_criteo", "load_or_preprocess",
           "open_processed", "cache_is_fresh", "preprocessing_lock", "remove_stale_temporaries",
           "write_criteo_tsv", "categorical_id", "NUM_COLUMNS"]

FORMAT_VERSION = 1
META_FILE = "meta.json"
SHUFFLE_BLOCK_ROWS = 256
DEFAULT_CHUNK_LINES = 2048
PROGRESS_BYTES = 64 << 20  # files at least this large announce their preprocessing and show a bar
MAX_LINE_BYTES = 1 << 20  # a Criteo line is a few hundred bytes; a longer one is not read whole
CHUNK_BYTES = 16 << 20  # a chunk also ends at this many bytes: parsing takes ~10x a chunk's bytes
# compressed files read as they are (the Terabyte logs ship as day_N.gz) and those that are refused
_COMPRESSED = {b"\x1f\x8b": "gzip", b"BZh": "bz2", b"\xfd7zXZ\x00": "xz"}
_UNREADABLE = {b"\x28\xb5\x2f\xfd": ("zstd", "unzstd"), b"PK\x03\x04": ("zip", "unzip")}
OUTPUT_NAMES = ("dense.f32", "categorical.i32", "categorical.i64", "labels.u8", META_FILE)
_TEMPORARY = re.compile(r"\.(.+)\.tmp-(\d+)")  # ".<name>.tmp-<pid>", see preprocess_criteo
_held_locks = threading.local()  # the lock files this thread holds (the lock is reentrant)


# ------------------------------------------------------------------------------- preprocessing
@dataclass
class PreprocessStats:
    """What ``preprocess_criteo`` did."""

    num_lines: int = 0
    num_rows: int = 0
    num_skipped: int = 0
    num_bytes: int = 0
    seconds: float = 0.0
    lines_per_second: float = 0.0
    skipped_examples: List[str] = field(default_factory=list)


def preprocess_criteo(
    tsv_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    num_embeddings: int,
    skip_malformed: bool = False,
    chunk_lines: int = DEFAULT_CHUNK_LINES,
    where: str = PROCESSED_DIR_SETTING,
) -> PreprocessStats:
    """Stream a raw Criteo TSV into the processed layout in ``out_dir`` (see the module docstring).

    Reads ``chunk_lines`` lines (at most ``CHUNK_BYTES``) at a time, so memory stays bounded
    whatever the file and its lines; a gzip, bz2 or xz file is read through its decompressor. A
    malformed line raises ``ValueError("<file>:<line>: <reason>")`` or, with ``skip_malformed``, is
    counted and left out. Files are written under temporary names (``.<name>.tmp-<pid>``) and
    renamed when complete; ``meta.json`` is written last, so a crash never leaves a cache that
    looks valid. Runs under ``out_dir``'s lock (see ``preprocessing_lock``), and first removes the
    temporaries that a killed preprocessing of ``out_dir`` left (those whose process is gone). A
    failed write raises ``OSError`` naming the file (a full disk, most likely). An ``out_dir`` that
    cannot be made or written in is refused first (``check_processed_dir``; ``where`` names what
    chose the folder).
    """
    if num_embeddings < 2:
        raise ValueError(f"num_embeddings must be >= 2 (row 0 holds missing values), got {num_embeddings}")
    if chunk_lines < 1:
        raise ValueError(f"chunk_lines must be >= 1, got {chunk_lines}")
    tsv_path, out_dir = Path(tsv_path), Path(out_dir)
    check_criteo_tsv(tsv_path, "the file to preprocess")
    check_processed_dir(out_dir, where)
    made = []  # the folders this call makes (out_dir and missing parents), deepest first
    folder = out_dir.absolute()
    while not folder.exists():
        made.append(folder)
        folder = folder.parent
    with preprocessing_lock(tsv_path, out_dir):
        try:
            return _preprocess(tsv_path, out_dir, num_embeddings, skip_malformed, chunk_lines)
        except BaseException:  # (a refused input left an empty folder): still under the lock, and only
            for folder in made:  # empty folders, so no other process's build is touched; the lock file
                try:             # stays (unlinked, a process waiting on it would build beside a newcomer)
                    folder.rmdir()
                except OSError:
                    break
            raise


def _preprocess(tsv_path: Path, out_dir: Path, num_embeddings: int, skip_malformed: bool,
                chunk_lines: int) -> PreprocessStats:
    out_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out_dir)
    stat = tsv_path.stat()
    fingerprint = source_fingerprint(tsv_path)
    cat_dtype = np.int32 if num_embeddings <= 2**31 - 1 else np.int64
    names = _data_files(cat_dtype)
    tmp = {k: out_dir / f".{name}.tmp-{os.getpid()}" for k, name in names.items()}
    stats = PreprocessStats()
    start = time.perf_counter()
    large = stat.st_size >= PROGRESS_BYTES
    if large:  # minutes of work: say so (a log file gets this line; a terminal also gets the bar)
        _notice(f"criteo: preprocessing {tsv_path} ({stat.st_size / 2**20:,.0f} MiB) into {out_dir}")
    bar = tqdm(total=stat.st_size, unit="B", unit_scale=True, desc=f"preprocessing {tsv_path.name}",
               disable=None if large else True, file=sys.stderr, leave=False)  # None: only on a terminal
    files = {k: open(p, "wb") for k, p in tmp.items()}
    try:
        with open_tsv(tsv_path) as (f, position):
            while True:
                lines = _read_chunk(f, chunk_lines)
                if not lines:
                    break
                _refuse_long_line(tsv_path, lines, stats.num_lines)
                buf = b"".join(lines)
                del lines
                parsed = parse_chunk(buf, stats.num_lines + 1, num_embeddings)
                stats.num_lines += buf.count(b"\n") + (0 if buf.endswith(b"\n") else 1)
                stats.num_bytes += len(buf)
                bar.update(position() - bar.n)  # bytes of the file (compressed ones: before decompressing)
                del buf
                if parsed.errors:
                    line, reason = parsed.errors[0]
                    if not skip_malformed:
                        raise ValueError(f"{tsv_path}:{line}: {reason} (malformed Criteo line; "
                                         f"data.criteo.skip_malformed = true, or --skip-malformed, counts "
                                         f"and skips such lines)")
                    stats.num_skipped += len(parsed.errors)
                    room = 5 - len(stats.skipped_examples)
                    stats.skipped_examples += [f"line {n}: {r}" for n, r in parsed.errors[:room]]
                with _writing(out_dir / names["dense"]):
                    parsed.dense.tofile(files["dense"])
                with _writing(out_dir / names["categorical"]):
                    parsed.categorical.astype(cat_dtype).tofile(files["categorical"])
                with _writing(out_dir / names["labels"]):
                    parsed.labels.tofile(files["labels"])
                stats.num_rows += parsed.labels.size
        for k, fh in files.items():
            with _writing(out_dir / names[k]):
                fh.flush()
                os.fsync(fh.fileno())
                fh.close()
        stats.seconds = time.perf_counter() - start
        stats.lines_per_second = stats.num_lines / max(stats.seconds, 1e-9)
        (out_dir / META_FILE).unlink(missing_ok=True)
        for k, name in names.items():
            os.replace(tmp[k], out_dir / name)
        for name in set(OUTPUT_NAMES) - set(names.values()) - {META_FILE}:  # another id width's copy
            (out_dir / name).unlink(missing_ok=True)
        meta = {
            "format": "neorec-criteo", "version": FORMAT_VERSION, "num_rows": stats.num_rows,
            "num_dense": NUM_INTEGER, "num_categorical": NUM_CATEGORICAL,
            "num_embeddings": num_embeddings, "categorical_dtype": np.dtype(cat_dtype).name,
            "files": names, "skip_malformed": skip_malformed,
            "source": {"path": str(tsv_path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                       "sample_sha256": fingerprint},
            "stats": asdict(stats),
        }
        with _writing(out_dir / META_FILE):
            _write_json_atomic(out_dir / META_FILE, meta)
    finally:
        bar.close()
        for fh in files.values():
            try:
                fh.close()
            except OSError:  # a failed flush of a file being given up: the first error is raised
                pass
        for p in tmp.values():
            p.unlink(missing_ok=True)
    return stats


@contextmanager
def open_tsv(path: Path) -> Iterator[Tuple[BinaryIO, Callable[[], int]]]:
    """``path`` opened for reading its text in binary, through its decompressor when it starts with
    a gzip, bz2 or xz header, with a function that gives how many bytes of the file were read (for
    progress). A zstd or zip file is refused with how to decompress it."""
    import bz2
    import gzip
    import lzma
    import zlib

    with open(path, "rb") as raw:
        head = raw.read(6)
        raw.seek(0)
        for magic, (kind, tool) in _UNREADABLE.items():
            if head.startswith(magic):
                raise ValueError(f"{path} is a {kind} file; decompress it first (e.g. `{tool} {path}`) and give "
                                 f"the uncompressed file (gzip, bz2 and xz files are read as they are)")
        kind = next((kind for magic, kind in _COMPRESSED.items() if head.startswith(magic)), None)
        if kind is None:
            yield raw, raw.tell
            return
        opener = {"gzip": lambda: gzip.GzipFile(fileobj=raw, mode="rb"), "bz2": lambda: bz2.BZ2File(raw, "rb"),
                  "xz": lambda: lzma.LZMAFile(raw, "rb")}[kind]
        with opener() as f:  # (closing it leaves raw to its own `with`)
            try:
                yield f, raw.tell
            except EOFError:
                raise ValueError(f"{path}: the {kind} stream ends early: the file is truncated (an interrupted "
                                 f"download or copy?)") from None
            except (zlib.error, gzip.BadGzipFile, lzma.LZMAError) as exc:
                raise ValueError(f"{path}: the {kind} data is corrupt ({exc})") from None


def _read_chunk(f: BinaryIO, chunk_lines: int) -> List[bytes]:
    """Up to ``chunk_lines`` lines of ``f`` (each at most MAX_LINE_BYTES: see _refuse_long_line),
    fewer when they reach CHUNK_BYTES."""
    lines: List[bytes] = []
    size = 0
    while len(lines) < chunk_lines and size < CHUNK_BYTES:
        line = f.readline(MAX_LINE_BYTES)
        if not line:
            break
        lines.append(line)
        size += len(line)
    return lines


def _refuse_long_line(tsv_path: Path, lines: List[bytes], lines_before: int) -> None:
    """A line of MAX_LINE_BYTES or more (read in pieces of that size, so a file without newlines
    never sits in memory whole) is no Criteo line: stop with its number, whatever skip_malformed."""
    for i, line in enumerate(lines):
        if len(line) == MAX_LINE_BYTES and not line.endswith(b"\n"):
            raise ValueError(f"{tsv_path}:{lines_before + i + 1}: a line of {MAX_LINE_BYTES:,} bytes or more "
                             "(a Criteo line has a few hundred): not a Criteo TSV file?")


@contextmanager
def _writing(path: Path) -> Iterator[None]:
    """Turn a failed write into an error naming ``path`` (numpy's own says only "26624 requested
    and 20480 written")."""
    try:
        yield
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise OSError(f"writing {path} failed ({reason}): the disk may be full; free space there or "
                      "put the processed copy on another disk (data.criteo.processed_dir, or the output directory of "
                      "preprocess-criteo)") from exc


def remove_empty_copy(tsv_path: str | os.PathLike, out_dir: str | os.PathLike) -> bool:
    """Remove the processed copy ``out_dir`` if it holds no rows (a TSV that is empty, or whose
    every line was skipped as malformed: training on it cannot run, so it is not kept); whether it
    did. Under the copy's lock, whose file stays (unlinked, a process waiting on it would build
    beside a newcomer), as a failed ``preprocess_criteo`` leaves it."""
    out_dir = Path(out_dir)
    with preprocessing_lock(tsv_path, out_dir):
        try:
            if int(json.loads((out_dir / META_FILE).read_text())["num_rows"]) != 0:
                return False
        except (OSError, ValueError, KeyError, TypeError):
            return False
        shutil.rmtree(out_dir, ignore_errors=True)
    return True


@contextmanager
def preprocessing_lock(tsv_path: str | os.PathLike, out_dir: str | os.PathLike) -> Iterator[None]:
    """Hold the exclusive lock of processed directory ``out_dir`` (``fcntl.flock`` on
    ``<out_dir>.lock``, beside it), waiting for another process that holds it, with one line
    printed. Reentrant within a thread. Where no lock file can be made (a read-only location) or
    the file system has no locks, goes on without one: nothing can be built there anyway."""
    out_dir = Path(out_dir).resolve()
    lock_path = out_dir.with_name(f"{out_dir.name}.lock")
    held = getattr(_held_locks, "paths", None)
    if held is None:
        held = _held_locks.paths = set()
    if str(lock_path) in held:
        yield
        return
    try:
        lock = lock_file(lock_path, on_wait=lambda holder: _notice(
            f"criteo: waiting for another process preprocessing {tsv_path} into {out_dir} "
            f"(it holds {lock_path})"))
    except OSError:  # a read-only location, or a file system without locks
        lock = None
    held.add(str(lock_path))
    try:
        yield
    finally:
        held.discard(str(lock_path))
        if lock is not None:
            os.close(lock)  # releases the lock


def remove_stale_temporaries(out_dir: str | os.PathLike) -> List[Path]:
    """Remove the temporary files (``.<name>.tmp-<pid>``, name one of ``OUTPUT_NAMES``) in
    ``out_dir`` whose process is gone (a killed preprocessing); returns them. Call it under the
    directory's lock: temporaries of live processes are kept."""
    removed = []
    for path in Path(out_dir).iterdir():
        match = _TEMPORARY.fullmatch(path.name)
        if match is None or match.group(1) not in OUTPUT_NAMES:
            continue
        pid = int(match.group(2))
        if pid != os.getpid() and not process_alive(pid):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _notice(text: str) -> None:
    """One line for the user on stdout (where ``neorec train`` prints)."""
    print(text, file=sys.stdout, flush=True)


def _data_files(cat_dtype) -> dict:
    suffix = "i32" if np.dtype(cat_dtype) == np.int32 else "i64"
    return {"dense": "dense.f32", "categorical": f"categorical.{suffix}", "labels": "labels.u8"}


def _write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    try:
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:  # pragma: no cover - directories cannot be fsynced on some systems
        pass


@dataclass
class CriteoArrays:
    """Memory maps of a processed directory: dense [N, 13], categorical [N, 26], labels [N]."""

    dense: np.ndarray
    categorical: np.ndarray
    labels: np.ndarray
    meta: dict

    @property
    def num_rows(self) -> int:
        return int(self.meta["num_rows"])


FINGERPRINT_BYTES = 1 << 20


def source_fingerprint(path: Path) -> str:
    """sha256 of the file's first and last MiB: with its size and mtime, what tells a changed TSV
    from the one processed (a same-size file copied with its mtime kept, ``cp -p``, passed the size
    and mtime check alone); two MiB read, whatever the file's size."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        spans = [(0, min(size, FINGERPRINT_BYTES))]
        if size > FINGERPRINT_BYTES:
            tail = max(FINGERPRINT_BYTES, size - FINGERPRINT_BYTES)
            spans.append((tail, size - tail))
        for start, length in spans:
            f.seek(start)
            while length > 0:  # in 64 KiB pieces: the preprocessing's memory stays chunk-sized
                piece = f.read(min(length, 1 << 16))
                if not piece:
                    break
                digest.update(piece)
                length -= len(piece)
    return digest.hexdigest()


def cache_is_fresh(tsv_path: str | os.PathLike, out_dir: str | os.PathLike, num_embeddings: int,
                   skip_malformed: bool = False) -> bool:
    """Whether ``out_dir`` holds a complete processed copy of the current ``tsv_path`` (same size,
    mtime and, for caches that recorded it, ``source_fingerprint``)."""
    tsv_path, out_dir = Path(tsv_path), Path(out_dir)
    try:
        meta = json.loads((out_dir / META_FILE).read_text())
        stat = tsv_path.stat()
        n = int(meta["num_rows"])
        sizes = {"dense": 4 * NUM_INTEGER * n, "labels": n,
                 "categorical": np.dtype(meta["categorical_dtype"]).itemsize * NUM_CATEGORICAL * n}
        return (
            meta.get("format") == "neorec-criteo" and meta.get("version") == FORMAT_VERSION
            and meta["num_embeddings"] == num_embeddings
            and meta["source"]["size"] == stat.st_size and meta["source"]["mtime_ns"] == stat.st_mtime_ns
            and (meta["source"].get("sample_sha256") is None  # written before the fingerprint: not read
                 or meta["source"]["sample_sha256"] == source_fingerprint(tsv_path))
            and (skip_malformed or meta["stats"]["num_skipped"] == 0)
            and all((out_dir / meta["files"][k]).stat().st_size == sizes[k] for k in sizes)
        )
    except (OSError, ValueError, KeyError, TypeError):
        return False


def open_processed(out_dir: str | os.PathLike) -> CriteoArrays:
    """Memory-map a directory written by ``preprocess_criteo`` (read-only)."""
    out_dir = Path(out_dir)
    meta = json.loads((out_dir / META_FILE).read_text())
    n, files = int(meta["num_rows"]), meta["files"]

    def load(key: str, dtype, shape) -> np.ndarray:
        if n == 0:
            return np.zeros(shape, dtype=dtype)
        return np.memmap(out_dir / files[key], dtype=dtype, mode="r", shape=shape)

    return CriteoArrays(load("dense", np.float32, (n, NUM_INTEGER)),
                        load("categorical", np.dtype(meta["categorical_dtype"]), (n, NUM_CATEGORICAL)),
                        load("labels", np.uint8, (n,)), meta)


def load_or_preprocess(tsv_path: str | os.PathLike, out_dir: str | os.PathLike, num_embeddings: int,
                       skip_malformed: bool = False, chunk_lines: int = DEFAULT_CHUNK_LINES,
                       where: str = PROCESSED_DIR_SETTING) -> CriteoArrays:
    """The processed arrays of ``tsv_path``, (re)building ``out_dir`` when missing or stale (a
    fresh copy is used where nothing can be written, a read-only one; see ``preprocess_criteo`` for
    ``where``).

    The check and the build run under ``out_dir``'s lock: of several processes asking at once, one
    preprocesses and the others wait for it and then map its copy."""
    check_criteo_tsv(tsv_path, "the file to preprocess")
    with preprocessing_lock(tsv_path, out_dir):
        if not cache_is_fresh(tsv_path, out_dir, num_embeddings, skip_malformed):
            preprocess_criteo(tsv_path, out_dir, num_embeddings, skip_malformed, chunk_lines, where)
        return open_processed(out_dir)


# ------------------------------------------------------------------------------- source
def _remove_empty(tsv_path: str, out_dir: Path, arrays: CriteoArrays) -> str:
    """Remove the copy of no rows ``out_dir`` (see ``remove_empty_copy``) and say why it has none."""
    remove_empty_copy(tsv_path, out_dir)
    stats = arrays.meta.get("stats", {})
    return no_rows_reason(stats.get("num_lines", 0), stats.get("num_skipped", 0))


def _report_skipped(tsv_path: str, arrays: CriteoArrays) -> None:
    """Say (once per run: on rank 0 or a single process) how many malformed lines the copy left out."""
    stats = arrays.meta.get("stats", {})
    if not stats.get("num_skipped") or os.environ.get("RANK", "0") != "0":
        return
    first = stats.get("skipped_examples") or ["?"]
    _notice(f"criteo: {tsv_path}: {stats['num_skipped']:,} of {stats['num_lines']:,} lines were malformed and "
            f"skipped (data.criteo.skip_malformed = true; first: {first[0]})")


class CriteoSource:
    """Batches of processed Criteo data: 13 dense features, 26 one-id bags ``cat_0..cat_25``."""

    name = "criteo"

    def __init__(self, cfg: CriteoConfig) -> None:
        if not cfg.train_path:
            raise ValueError("data.criteo.train_path is empty: set it to a raw Criteo TSV file "
                             f"(label, {NUM_INTEGER} integer and {NUM_CATEGORICAL} hexadecimal columns)")
        self.cfg = cfg
        self.num_dense = NUM_INTEGER
        self.feature_names = cfg.feature_names()
        processed = Path(cfg.processed_dir or f"{cfg.train_path}.neorec")
        for key in ("train_path", "eval_path"):  # before making the processed copy's folder beside train_path
            if getattr(cfg, key):
                check_criteo_tsv(getattr(cfg, key), f"data.criteo.{key}", held_out=key == "eval_path")
        where = PROCESSED_DIR_SETTING + ("" if cfg.processed_dir else ", by default beside train_path")
        try:
            processed.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise processed_dir_error(processed, where, exc.strerror or str(exc)) from None
        args = (cfg.num_embeddings, cfg.skip_malformed, cfg.chunk_lines, where)
        self._train = load_or_preprocess(cfg.train_path, processed / "train", *args)
        _report_skipped(cfg.train_path, self._train)
        if self._train.num_rows == 0:  # (before preprocessing the eval file)
            why = _remove_empty(cfg.train_path, processed / "train", self._train)
            raise ValueError(f"Criteo data {cfg.train_path} holds no rows ({why}): nothing to train on "
                             "(data.criteo.train_path)")
        if cfg.eval_path:
            self._eval = load_or_preprocess(cfg.eval_path, processed / "eval", *args)
            _report_skipped(cfg.eval_path, self._eval)
            if self._eval.num_rows == 0:
                why = _remove_empty(cfg.eval_path, processed / "eval", self._eval)
                raise ValueError(f"Criteo eval data {cfg.eval_path} holds no rows ({why}): give data.criteo.eval_path "
                                 "a non-empty TSV file, or leave it empty to hold out the last eval_fraction of "
                                 "the training file")
            self._train_rows = (0, self._train.num_rows)
            self._eval_rows = (0, self._eval.num_rows)
        else:
            self._eval = self._train
            n = self._train.num_rows
            num_eval = int(round(n * cfg.eval_fraction))
            self._train_rows, self._eval_rows = (0, n - num_eval), (n - num_eval, n)
        if self.num_train_samples() == 0:  # (rows, all held out)
            raise ValueError(f"Criteo data {cfg.train_path}: eval_fraction {cfg.eval_fraction} of its "
                             f"{self._train.num_rows:,} rows leaves no training rows: lower data.criteo.eval_fraction "
                             "or set data.criteo.eval_path to a held-out TSV file")
        if self.num_eval_samples() == 0 and cfg.eval_fraction > 0:  # 0: no eval asked for
            raise ValueError(f"Criteo data {cfg.train_path}: eval_fraction {cfg.eval_fraction} of its "
                             f"{self._train.num_rows:,} rows leaves no eval rows: raise data.criteo.eval_fraction "
                             "or set data.criteo.eval_path to a held-out TSV file")

    def tables(self, embedding_dim: int, pooling: str = "sum") -> List[TableConfig]:
        return one_table_per_feature(self.feature_names, [self.cfg.num_embeddings] * NUM_CATEGORICAL,
                                     embedding_dim, pooling)

    def num_train_samples(self) -> int:
        return self._train_rows[1] - self._train_rows[0]

    def num_eval_samples(self) -> int:
        return self._eval_rows[1] - self._eval_rows[0]

    def train_batches(self, batch_size: int, epoch: int = 0, start_batch: int = 0) -> Iterator[Batch]:
        check_batch_args(batch_size, epoch, start_batch)
        order = EpochOrder(self.num_train_samples(), self.cfg.shuffle, self.cfg.seed, epoch, SHUFFLE_BLOCK_ROWS)
        yield from self._batches(self._train, self._train_rows[0], order, batch_size, start_batch)

    def eval_batches(self, batch_size: int) -> Iterator[Batch]:
        check_batch_args(batch_size)
        order = EpochOrder(self.num_eval_samples(), False, 0, 0)
        yield from self._batches(self._eval, self._eval_rows[0], order, batch_size, 0)

    def _batches(self, arrays: CriteoArrays, first_row: int, order: EpochOrder, batch_size: int,
                 start_batch: int) -> Iterator[Batch]:
        for start, stop in batch_ranges(order.num_rows, batch_size, start_batch):
            rows = order.rows(start, stop)
            if isinstance(rows, slice):
                rows = slice(rows.start + first_row, rows.stop + first_row)
            else:
                rows = rows + first_row
            yield self.make_batch(arrays.dense[rows], arrays.categorical[rows], arrays.labels[rows])

    def make_batch(self, dense: np.ndarray, categorical: np.ndarray, labels: np.ndarray) -> Batch:
        """Batch from dense [B, 13], categorical [B, 26] rows and labels [B] (copied)."""
        num = labels.shape[0]
        sparse = KeyedJaggedTensor(
            self.feature_names,
            torch.from_numpy(np.ascontiguousarray(categorical.T, dtype=np.int64).reshape(-1)),
            torch.ones(NUM_CATEGORICAL * num, dtype=torch.int64),
            batch_size=num,
            validate=False,
        )
        return Batch(torch.from_numpy(np.array(dense, dtype=np.float32)), sparse,
                     torch.from_numpy(np.asarray(labels, dtype=np.float32)))


