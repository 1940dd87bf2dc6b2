"""The raw Criteo TSV layout: a vectorised chunk parser, the categorical hash, and a writer of
learnable synthetic data in that layout.

    from neorec.data.criteo_tsv import write_criteo_tsv, categorical_id
    write_criteo_tsv("/tmp/day_0.tsv", num_lines=100_000, seed=0)

One sample per line, 40 tab-separated columns: the label (0 or 1), 13 integer columns I1..I13
(counts; may be negative) and 26 categorical columns C1..C26 (hexadecimal strings); an empty field
is a missing value. ``neorec.data.criteo`` turns such files into memory-mapped arrays.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np

from neorec.data.config import CRITEO_CATEGORICAL, SyntheticConfig
from neorec.data.source import GOLDEN64, splitmix64, splitmix64_int
from neorec.data.synthetic import SPLIT_EVAL, SPLIT_TRAIN, SampleBlock, SyntheticSource

NUM_INTEGER = 13
NUM_CATEGORICAL = CRITEO_CATEGORICAL
NUM_COLUMNS = 1 + NUM_INTEGER + NUM_CATEGORICAL
MAX_INTEGER_DIGITS = 18  # |x| < 10^18 fits int64
MAX_HEX_DIGITS = 16  # fits uint64

_HEX_LUT = np.full(256, -1, dtype=np.int16)
for _i, _c in enumerate(b"0123456789"):
    _HEX_LUT[_c] = _i
for _i, _c in enumerate(b"abcdef"):
    _HEX_LUT[_c] = 10 + _i
    _HEX_LUT[_c - 32] = 10 + _i
_POW10 = np.array([10**k for k in range(MAX_INTEGER_DIGITS + 2)], dtype=np.uint64)
_POW16 = np.array([16**k for k in range(MAX_HEX_DIGITS)] + [0] * 4, dtype=np.uint64)


def _column_salt(column: int) -> int:
    return splitmix64_int((column + 1) * GOLDEN64)


_SALTS = np.array([_column_salt(c) for c in range(NUM_CATEGORICAL)], dtype=np.uint64)


def categorical_id(text: str, column: int, num_embeddings: int) -> int:
    """Row of hex string ``text`` in categorical column ``column`` (0..25): the scalar reference
    of the hash used by ``preprocess_criteo``; "" (missing) -> 0, else in [1, num_embeddings)."""
    if text == "":
        return 0
    return 1 + splitmix64_int(int(text, 16) ^ _column_salt(column)) % (num_embeddings - 1)


def _hash_categorical(values: np.ndarray, missing: np.ndarray, num_embeddings: int) -> np.ndarray:
    """values [G, 26] uint64 parsed hex -> rows [G, 26] int64 (missing -> 0)."""
    rows = splitmix64(values ^ _SALTS[None, :]) % np.uint64(num_embeddings - 1) + np.uint64(1)
    rows = rows.astype(np.int64)
    rows[missing] = 0
    return rows


# ------------------------------------------------------------------------------- parsing
@dataclass
class ParsedChunk:
    dense: np.ndarray  # [G, 13] float32
    categorical: np.ndarray  # [G, 26] int64
    labels: np.ndarray  # [G] uint8
    errors: List[Tuple[int, str]]  # (1-based line number, reason) of the malformed lines


def _column_name(column: int) -> str:
    if column == 0:
        return "label (column 1)"
    if column <= NUM_INTEGER:
        return f"integer column I{column} (column {column + 1})"
    return f"categorical column C{column - NUM_INTEGER} (column {column + 1})"


def parse_chunk(buf: bytes, first_line: int, num_embeddings: int) -> ParsedChunk:
    """Parse complete lines (``first_line`` = 1-based number of the first); malformed lines are
    left out and listed in ``errors``. A fast path covers well-formed chunks whose categorical
    values are all 8 hex digits or empty (the real logs); anything else takes the careful path."""
    a = np.frombuffer(buf, dtype=np.uint8)
    if a.size and a[-1] != 10:
        a = np.append(a, np.uint8(10))
    parsed = _parse_regular(a, num_embeddings)
    return parsed if parsed is not None else _parse_careful(a, first_line, num_embeddings)


def _parse_regular(a: np.ndarray, num_embeddings: int) -> Optional[ParsedChunk]:
    sep = np.flatnonzero((a == 9) | (a == 10))
    num = sep.size // NUM_COLUMNS
    if num == 0 or sep.size != num * NUM_COLUMNS:
        return None
    ends = sep.reshape(num, NUM_COLUMNS)
    newline = ends[:, -1]
    if (a[newline] != 10).any() or (a[ends[:, :-1]] != 9).any() or (a[newline - 1] == 13).any():
        return None  # some line has another number of columns, or CRLF line ends
    starts = np.empty_like(ends)
    starts.flat[0] = 0
    starts.flat[1:] = sep[:-1] + 1
    length = ends - starts
    present = length[:, 1 + NUM_INTEGER :] == 8
    if not (present | (length[:, 1 + NUM_INTEGER :] == 0)).all():
        return None
    # the categorical part of every line, tabs included, goes through bytes.fromhex (C speed)
    hex_start = starts[:, 1 + NUM_INTEGER]
    segments = np.empty(2 * num, dtype=np.int64)
    segments[0::2] = hex_start - starts[:, 0]
    segments[1::2] = newline + 1 - hex_start
    in_hex = np.repeat(np.tile(np.array([False, True]), num), segments)
    try:
        raw = bytes.fromhex(a[in_hex].tobytes().decode("latin-1"))
    except ValueError:
        return None
    if len(raw) != 4 * int(present.sum()):
        return None
    hex_values = np.zeros((num, NUM_CATEGORICAL), dtype=np.uint64)
    hex_values[present] = np.frombuffer(raw, dtype=">u4")
    # label and integers: each field followed by one tab in the remaining bytes
    head = a[~in_hex]
    head_length = length[:, : 1 + NUM_INTEGER].ravel()
    head_start = np.cumsum(head_length + 1) - (head_length + 1)
    values, bad, negative = _parse_fields(head, head_start, head_length, None)
    values = values.reshape(num, 1 + NUM_INTEGER)
    if bad.any() or (head_length.reshape(num, -1)[:, 0] != 1).any() or (values[:, 0] > 1).any():
        return None
    return _assemble(values, negative.reshape(num, -1)[:, 1:], hex_values, ~present, num_embeddings, [])


def _parse_careful(a: np.ndarray, first_line: int, num_embeddings: int) -> ParsedChunk:
    newline = np.flatnonzero(a == 10)
    line_start = np.zeros(newline.size, dtype=np.int64)
    line_start[1:] = newline[:-1] + 1
    has_cr = (newline > line_start) & (a[newline - 1] == 13)
    tabs_before = np.zeros(a.size + 1, dtype=np.int32)
    np.cumsum(a == 9, out=tabs_before[1:])
    num_tabs = tabs_before[newline] - tabs_before[line_start]
    del tabs_before
    bad_shape = num_tabs != NUM_COLUMNS - 1
    empty = newline - line_start == has_cr  # a blank line is an error too: a Criteo log has none
    errors = [(first_line + int(i), ("the line is empty; " if empty[i] else "") + f"expected {NUM_COLUMNS} "
               f"tab-separated columns (label, {NUM_INTEGER} integer, {NUM_CATEGORICAL} categorical), "
               f"found {int(num_tabs[i]) + 1}")
              for i in np.flatnonzero(bad_shape)]
    kept_lines = np.flatnonzero(~bad_shape)
    if bad_shape.any() or has_cr.any():
        keep = np.repeat(~bad_shape, newline - line_start + 1)
        keep[newline[has_cr] - 1] = False
        a = a[keep]
        del keep
    num = kept_lines.size
    if num == 0:
        return _assemble(np.zeros((0, 1 + NUM_INTEGER), np.uint64), np.zeros((0, NUM_INTEGER), bool),
                         np.zeros((0, NUM_CATEGORICAL), np.uint64), np.zeros((0, NUM_CATEGORICAL), bool),
                         num_embeddings, errors)
    sep = np.flatnonzero((a == 9) | (a == 10))
    starts = np.empty(sep.size, dtype=np.int64)
    starts[0] = 0
    starts[1:] = sep[:-1] + 1
    length = sep - starts
    hexadecimal = np.tile(np.arange(NUM_COLUMNS) > NUM_INTEGER, num)
    values, bad, negative = _parse_fields(a, starts, length, hexadecimal)
    shape = (num, NUM_COLUMNS)
    values, bad, negative, length, starts = (x.reshape(shape) for x in (values, bad, negative, length, starts))
    bad[:, 0] |= (length[:, 0] != 1) | (values[:, 0] > 1)
    line_bad = bad.any(axis=1)
    for i in np.flatnonzero(line_bad):
        c = int(np.flatnonzero(bad[i])[0])
        text = bytes(a[starts[i, c] : starts[i, c] + min(int(length[i, c]), 40)]).decode("utf-8", "replace")
        what = "0 or 1" if c == 0 else (
            f"an integer of at most {MAX_INTEGER_DIGITS} digits" if c <= NUM_INTEGER
            else f"a hexadecimal string of at most {MAX_HEX_DIGITS} digits")
        errors.append((first_line + int(kept_lines[i]), f"{_column_name(c)} holds {text!r}, expected {what}"))
    errors.sort()
    good = ~line_bad
    head = slice(0, 1 + NUM_INTEGER)
    cats = slice(1 + NUM_INTEGER, NUM_COLUMNS)
    return _assemble(values[good, head], negative[good, 1 : 1 + NUM_INTEGER], values[good, cats],
                     length[good, cats] == 0, num_embeddings, errors)


def _parse_fields(a: np.ndarray, start: np.ndarray, length: np.ndarray,
                  hexadecimal: Optional[np.ndarray]) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Parse fields a[start[f] : start[f] + length[f]] as decimal integers (optionally with a
    leading '-') or, where ``hexadecimal[f]`` (None = nowhere), as hex. Returns the magnitudes
    [F] uint64 (0 when empty), ``bad`` [F] and ``negative`` [F]."""
    num_fields = start.size
    fid = np.repeat(np.arange(num_fields, dtype=np.int32), length)
    first = (np.cumsum(length) - length).astype(np.int64)  # content index of each field's first byte
    offset = (np.arange(fid.size, dtype=np.int64) - first[fid]).astype(np.int32)
    ch = a[start[fid] + offset]
    field_length = length[fid]
    rest = (field_length - 1 - offset).astype(np.int32)  # digits after this one
    del field_length
    decimal = ch - np.uint8(48)
    is_decimal = decimal < 10
    minus = (ch == 45) & (offset == 0) & (length[fid] >= 2)
    if hexadecimal is not None:
        hex_byte = hexadecimal[fid]
        hex_digit = _HEX_LUT[ch]
        ok = np.where(hex_byte, hex_digit >= 0, is_decimal | minus)
        digit = np.where(hex_byte, hex_digit, np.where(is_decimal, decimal, 0)).astype(np.uint64)
        power = np.where(hex_byte, _POW16[np.minimum(rest, MAX_HEX_DIGITS + 3)],
                         _POW10[np.minimum(rest, MAX_INTEGER_DIGITS + 1)])
        del hex_byte, hex_digit
    else:
        ok = is_decimal | minus
        digit = np.where(is_decimal, decimal, 0).astype(np.uint64)
        power = _POW10[np.minimum(rest, MAX_INTEGER_DIGITS + 1)]
    del decimal, is_decimal, rest, ch, offset
    with np.errstate(over="ignore"):
        digit *= power
    del power
    sums = np.add.reduceat(np.append(digit, np.uint64(0)), first)  # the appended 0 keeps indices valid
    sums[length == 0] = 0
    negative = np.zeros(num_fields, dtype=bool)
    negative[fid[minus]] = True
    limit = MAX_INTEGER_DIGITS + negative  # a minus sign and 18 digits
    if hexadecimal is not None:
        limit = np.where(hexadecimal, MAX_HEX_DIGITS, limit)
    bad = length > limit
    bad[fid[~ok]] = True
    return sums, bad, negative


def _assemble(head: np.ndarray, negative: np.ndarray, hex_values: np.ndarray, hex_missing: np.ndarray,
              num_embeddings: int, errors: List[Tuple[int, str]]) -> ParsedChunk:
    """head [G, 14] label and integer magnitudes, negative [G, 13], hex_values [G, 26]."""
    integers = head[:, 1:].astype(np.int64)
    integers[negative] *= -1
    dense = np.log1p(np.maximum(integers, 0)).astype(np.float32)
    categorical = _hash_categorical(hex_values, hex_missing, num_embeddings)
    return ParsedChunk(dense, categorical, head[:, 0].astype(np.uint8), errors)


# ------------------------------------------------------------------------------- writer
def write_criteo_tsv(
    path: str | os.PathLike,
    num_lines: int,
    seed: int = 0,
    num_embeddings: int = 100_000,
    zipf_alpha: float = 1.05,
    missing_rate: float = 0.1,
    held_out: bool = False,
) -> int:
    """Write ``num_lines`` lines of learnable synthetic click data in the raw Criteo layout.

    ``seed`` chooses the dataset (the hidden teacher that labels it, the ids' permutations, the
    columns' missing rates): a file of another seed is another dataset. ``held_out`` writes lines
    of the same dataset that no file written without it holds (its eval split), for
    ``--eval-tsv``; without it the file is the dataset's first ``num_lines`` training lines.

    The synthetic generator (26 one-id tables of ``num_embeddings`` rows, 13 dense features) is
    turned into Criteo-like values: dense x -> the count floor(exp(1.2 x + 1.5)) - 1 (column I2 may
    go down to -3, as in the real data), ids -> 8-digit hex strings, and each column has its own
    missing rate averaging ``missing_rate``. Returns the number of lines; the file is written
    atomically.
    """
    if num_lines < 0:
        raise ValueError(f"num_lines must be >= 0, got {num_lines}")
    if seed < 0:  # (said here, not as the synthetic source's data.synthetic.seed)
        raise ValueError(f"seed must be >= 0, got {seed}")
    if not 0.0 <= missing_rate < 0.5:
        raise ValueError(f"missing_rate must be in [0, 0.5), got {missing_rate}")
    source = SyntheticSource(SyntheticConfig(
        num_tables=NUM_CATEGORICAL, num_embeddings=[num_embeddings], pooling=1.0, zipf_alpha=zipf_alpha,
        num_dense=NUM_INTEGER, num_train_samples=max(num_lines, 1), num_eval_samples=0, seed=seed))
    rng = np.random.default_rng([seed, 0xC817E0])
    rates = missing_rate * rng.uniform(0.0, 2.0, NUM_COLUMNS - 1)
    rates[[0, 1, NUM_INTEGER]] = 0.0  # a few columns are never missing, as in the real data
    split = SPLIT_EVAL if held_out else SPLIT_TRAIN
    if held_out:  # the same rates, its own missing values
        rng = np.random.default_rng([seed, 0xC817E0, SPLIT_EVAL])
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory; give the .tsv file to write")
    folder = path.parent
    if not folder.is_dir():  # said of the path given, not of the hidden temporary written first
        what = "is not a directory" if folder.exists() else "does not exist"
        raise FileNotFoundError(f"cannot write {path}: its directory {folder} {what}")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        try:
            f = open(tmp, "w", newline="\n")
        except OSError as exc:  # e.g. a folder without write permission
            error = type(exc)(f"cannot write {path}: {exc.strerror or exc}")
            error.errno = exc.errno
            raise error from None
        with f:
            blocks = source.blocks(split, 0, num_lines, 4096) if num_lines else []
            for block in blocks:
                f.write("".join(_criteo_lines(block, rates, rng)))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return num_lines


def _criteo_lines(block: SampleBlock, rates: np.ndarray, rng: np.random.Generator) -> List[str]:
    num = len(block)
    counts = np.floor(np.exp(1.2 * block.dense.astype(np.float64) + 1.5)).astype(np.int64) - 1
    counts[:, 1] -= 2  # I2 holds small negative values in the real logs
    others = np.arange(NUM_INTEGER) != 1
    counts[:, others] = np.maximum(counts[:, others], 0)
    missing = rng.random((num, NUM_COLUMNS - 1)) < rates
    columns = [[str(int(v)) for v in block.labels]]
    for c in range(NUM_INTEGER):
        texts = [str(v) for v in counts[:, c].tolist()]
        for i in np.flatnonzero(missing[:, c]).tolist():
            texts[i] = ""
        columns.append(texts)
    for t in range(NUM_CATEGORICAL):
        hashed = splitmix64(block.values[t].astype(np.uint64) ^ _SALTS[t]) & np.uint64(0xFFFFFFFF)
        texts = [f"{v:08x}" for v in hashed.tolist()]
        for i in np.flatnonzero(missing[:, NUM_INTEGER + t]).tolist():
            texts[i] = ""
        columns.append(texts)
    return ["\t".join(fields) + "\n" for fields in zip(*columns)]
