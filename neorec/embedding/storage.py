"""Row stores: where the rows of a cached embedding table live, in host DRAM or in a memory-mapped
SSD file, at fp32, fp16, bf16 or int8 (per-row scale and bias) precision, with the optimizer state
kept in fp32 beside each row.

    store = DramRowStore(num_rows=1000, dim=16, precision="int8", state={"momentum1": 1})
    store = SsdRowStore.create("runs/ssd/t_user", num_rows=10**8, dim=64, precision="fp16",
                               state={"momentum1": 1})    # neorec.embedding.ssd_store
    store = SsdRowStore.open("runs/ssd/t_user")       # reopen after close()
    rows, state = store.read(ids)          # [n, dim] fp32, {"momentum1": [n] fp32}
    store.write(ids, rows, state)          # rounds rows to the storage precision
    store.flush(); store.close()

Every row is one fixed-size record of ``record_bytes`` bytes (``RowFormat``): the row payload, for
int8 the row's fp32 scale and bias, then each state field (fp32, ``width`` values), then an
optional int32 access count (LFU replacement keeps a row's count with the row). A read or write of
a row touches one record, i.e. usually one page of the SSD file.

Rounding. Writes to fp16/bf16/int8 use seeded stochastic rounding (unbiased, so that small
optimizer updates survive on average) unless ``stochastic_rounding`` is off; ``write_range`` (used
to initialise a store) rounds to nearest. fp16/bf16 use ``neorec.embedding.precision``; int8 rounds
``q = (x - min) / scale`` on the 0..255 grid with ``floor(q + u)``, ``u ~ U[0, 1)``.
Error bounds per value (``x`` in fp32, ``s`` = (row max - row min) / 255):

    fp32: exact.  fp16: |err| <= 2^-11 |x| nearest, < 2^-10 |x| stochastic (normal range).
    bf16: |err| <= 2^-8 |x| nearest, < 2^-7 |x| stochastic.
    int8: |err| <= s / 2 nearest, < s stochastic (plus fp32 rounding of the dequantisation).

The SSD store (``SsdRowStore``) lives in ``ssd_store.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, Mapping, Optional, Tuple

import torch

from neorec.embedding.precision import stochastic_round_bf16, stochastic_round_fp16

ROW_PRECISIONS = ("fp32", "fp16", "bf16", "int8")
_PAYLOAD_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.uint8}


class NonFiniteRowError(ValueError):
    """A row to store holds NaN or inf: refused (a cache writing back a row that a diverged update
    left so; the trainer turns it into its divergence error). ``store`` names the store, ``row``
    the first such row's id (None when not known)."""

    def __init__(self, store: str, row: Optional[int], where: str) -> None:
        what = f"row {row} holds" if row is not None else "rows hold"
        super().__init__(f"{where}: {what} NaN or inf; refusing to store {'it' if row is not None else 'them'}")
        self.store, self.row = store, row


# the largest magnitude each payload precision holds (beyond it a row would be stored as inf)
_FINITE_LIMIT = {"fp16": float(torch.finfo(torch.float16).max), "bf16": float(torch.finfo(torch.bfloat16).max)}
_INIT_ROWS_BYTES = 1 << 24  # rows per write_range chunk when filling a store: about this many bytes


def _align4(n: int) -> int:
    return (n + 3) // 4 * 4


@dataclass(frozen=True)
class RowFormat:
    """Byte layout of one record.

    dim: values per row. precision: "fp32", "fp16", "bf16" or "int8".
    state: optimizer state fields, name -> fp32 values per row (1 for row-wise, dim for per-element).
    with_counts: one int32 access count per row (LFU replacement).
    """

    dim: int
    precision: str
    state: Tuple[Tuple[str, int], ...] = ()
    with_counts: bool = False
    payload_used: int = field(init=False)
    payload_bytes: int = field(init=False)
    scale_offset: int = field(init=False)
    state_start: int = field(init=False)
    state_offsets: Tuple[Tuple[str, int, int], ...] = field(init=False)
    count_offset: int = field(init=False)
    record_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim <= 0:
            raise ValueError(f"row store: dim must be a positive integer, got {self.dim!r}")
        if self.precision not in ROW_PRECISIONS:
            raise ValueError(f"row store: precision must be one of {ROW_PRECISIONS}, got {self.precision!r}")
        item = torch.empty(0, dtype=_PAYLOAD_DTYPES[self.precision]).element_size()
        offset = _align4(self.dim * item)
        object.__setattr__(self, "payload_used", self.dim * item)
        object.__setattr__(self, "payload_bytes", offset)
        object.__setattr__(self, "scale_offset", offset)
        if self.precision == "int8":
            offset += 8  # fp32 scale, fp32 bias
        object.__setattr__(self, "state_start", offset)
        offsets = []
        for name, width in self.state:
            if width not in (1, self.dim):
                raise ValueError(f"row store: state field {name!r} must have width 1 or dim={self.dim}, got {width}")
            offsets.append((name, offset, width))
            offset += 4 * width
        object.__setattr__(self, "state_offsets", tuple(offsets))
        object.__setattr__(self, "count_offset", offset)
        if self.with_counts:
            offset += 4
        object.__setattr__(self, "record_bytes", offset)

    @property
    def state_names(self) -> Tuple[str, ...]:
        return tuple(name for name, _ in self.state)

    def to_json(self) -> Dict:
        return {"dim": self.dim, "precision": self.precision, "state": [list(s) for s in self.state],
                "with_counts": self.with_counts, "record_bytes": self.record_bytes}

    @staticmethod
    def from_json(data: Dict) -> "RowFormat":
        fmt = RowFormat(int(data["dim"]), str(data["precision"]),
                        tuple((str(n), int(w)) for n, w in data["state"]), bool(data["with_counts"]))
        if fmt.record_bytes != int(data["record_bytes"]):
            raise ValueError(f"row store: record_bytes {data['record_bytes']} does not match the layout "
                             f"({fmt.record_bytes}); written by another version?")
        return fmt


def _float_view(records: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """[n, count] fp32 view of bytes [start, start + 4 count) of every record."""
    return records[:, start : start + 4 * count].view(torch.float32)


class RowStore:
    """Fixed-size records in a uint8 tensor ``records`` [num_rows, record_bytes] (host memory or a
    memory map). Use ``DramRowStore`` or ``SsdRowStore``; this class holds what they share.

    All ids are 1-D integer tensors (any device; moved to CPU) with values in [0, num_rows); ids of
    one write must be unique. Rows and state come back as fp32 CPU tensors.

    Statistics: ``rows_read``, ``rows_written``, ``bytes_read``, ``bytes_written`` (record bytes
    moved between this store and the caller by ``read*`` / ``write*`` of ids; not the initial
    fill, ``write_range``, which a DRAM store counted and a reopened SSD store did not).
    """

    kind = "memory"

    def __init__(self, records: torch.Tensor, row_format: RowFormat, stochastic_rounding: bool = True,
                 seed: Optional[int] = 0, name: str = "") -> None:
        self.format = row_format
        self.records = records
        self.num_rows = int(records.shape[0])
        self.dim = row_format.dim
        self.precision = row_format.precision
        self.name = name
        self.stochastic_rounding = bool(stochastic_rounding)
        self._generator = torch.Generator()
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(int(seed))
        self.rows_read = self.rows_written = self.bytes_read = self.bytes_written = 0
        self.closed = False
        # kept with the rows by their trainer (the optimizer step); an SSD store saves it on flush
        self.training_state: Dict[str, int] = {}

    # ------------------------------------------------------------------------------ checks
    def _where(self) -> str:
        return f"row store {self.name!r}" if self.name else "row store"

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError(f"{self._where()} is closed")

    def _ids(self, ids: torch.Tensor) -> torch.Tensor:
        self._check_open()
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise TypeError(f"{self._where()}: ids must be a 1-D integer tensor, got "
                            f"{type(ids).__name__}{'' if not isinstance(ids, torch.Tensor) else f' {ids.dtype} {tuple(ids.shape)}'}")
        ids = ids.to("cpu", torch.int64)
        if ids.numel():
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= self.num_rows:
                bad = low if low < 0 else high
                raise ValueError(f"{self._where()}: id {bad} is outside the rows [0, {self.num_rows})")
        return ids

    def _rows(self, rows: torch.Tensor, count: int, ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        if not isinstance(rows, torch.Tensor) or tuple(rows.shape) != (count, self.dim):
            shape = tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__
            raise ValueError(f"{self._where()}: rows must be [{count}, {self.dim}], got {shape}")
        rows = rows.to("cpu", torch.float32)
        largest = float(rows.abs().amax()) if rows.numel() else 0.0
        if not math.isfinite(largest):
            first = int((~torch.isfinite(rows).all(dim=1)).to(torch.uint8).argmax())
            raise NonFiniteRowError(self.name, int(ids[first]) if ids is not None else None, self._where())
        limit = _FINITE_LIMIT.get(self.precision)
        if limit is not None and largest > limit:
            raise ValueError(f"{self._where()}: a row holds {largest:.6g}, beyond the largest {self.precision} value "
                             f"({limit:.6g}); refusing to store it as inf (keep this table's rows in fp32)")
        if self.precision == "int8" and largest > 1e38 and \
                not bool(torch.isfinite(rows.amax(dim=1) - rows.amin(dim=1)).all()):
            raise ValueError(f"{self._where()}: a row's values span more than the fp32 range, so its int8 "
                             "scale would be inf; refusing to store it (keep this table's rows in fp32)")
        return rows

    def _state(self, state: Mapping[str, torch.Tensor], count: int) -> Dict[str, torch.Tensor]:
        names = set(self.format.state_names)
        if set(state) != names:
            raise ValueError(f"{self._where()}: state must have fields {sorted(names)}, got {sorted(state)}")
        out = {}
        for name, width in self.format.state:
            value = state[name].to("cpu", torch.float32)
            expected = (count,) if width == 1 else (count, width)
            if tuple(value.shape) != expected and not (width == 1 and tuple(value.shape) == (count, 1)):
                raise ValueError(f"{self._where()}: state {name!r} must be {list(expected)}, got {list(value.shape)}")
            out[name] = value.reshape(count, width)
        return out

    # ------------------------------------------------------------------------------ codec
    def _encode(self, out: torch.Tensor, rows: torch.Tensor, state: Optional[Dict[str, torch.Tensor]],
                counts: Optional[torch.Tensor], stochastic: bool) -> None:
        """Encode into ``out`` [n, width]: the first ``width`` bytes of each record (width is
        ``state_start``, ``count_offset`` or ``record_bytes``)."""
        fmt, dim = self.format, self.dim
        if self.precision == "fp32":
            _float_view(out, 0, dim).copy_(rows)
        elif self.precision in ("fp16", "bf16"):
            if stochastic:
                round_fn = stochastic_round_fp16 if self.precision == "fp16" else stochastic_round_bf16
                half = round_fn(rows, self._generator)
            else:
                half = rows.to(_PAYLOAD_DTYPES[self.precision])
            out[:, : 2 * dim].view(half.dtype).copy_(half)
        else:
            low, high = rows.aminmax(dim=1)
            scale = (high - low) / 255.0
            # a span of a few subnormals: the scale rounded down (or to 0) would not reach the row's max
            scale = torch.where(scale * 255.0 < high - low, torch.nextafter(scale, torch.full_like(scale, math.inf)),
                                scale)
            q = (rows - low.unsqueeze(1)).div_(torch.where(scale > 0, scale, 1.0).unsqueeze(1))
            if stochastic:
                q.add_(torch.rand(q.shape, generator=self._generator)).floor_()
            else:
                q.round_()
            out[:, :dim].copy_(q.clamp_(0, 255).to(torch.uint8))
            scale_bias = _float_view(out, fmt.scale_offset, 2)
            scale_bias[:, 0] = scale
            scale_bias[:, 1] = low
        if fmt.payload_bytes > fmt.payload_used:
            out[:, fmt.payload_used : fmt.payload_bytes] = 0
        if state is not None:
            for name, offset, width in fmt.state_offsets:
                _float_view(out, offset, width).copy_(state[name])
        if counts is not None:
            self._count_view(out).copy_(counts.to("cpu").clamp(0, 2**31 - 1).to(torch.int32).view(-1, 1))

    def _decode_payload(self, records: torch.Tensor) -> torch.Tensor:
        dim = self.dim
        if self.precision == "fp32":
            return _float_view(records, 0, dim).clone()
        if self.precision in ("fp16", "bf16"):
            return records[:, : 2 * dim].view(_PAYLOAD_DTYPES[self.precision]).float()
        scale_bias = _float_view(records, self.format.scale_offset, 2)
        return torch.addcmul(scale_bias[:, 1:2], records[:, :dim].float(), scale_bias[:, 0:1])

    def _decode_state(self, records: torch.Tensor) -> Dict[str, torch.Tensor]:
        out = {}
        for name, offset, width in self.format.state_offsets:
            value = _float_view(records, offset, width)
            out[name] = value[:, 0].clone() if width == 1 else value.clone()
        return out

    def _count_view(self, records: torch.Tensor) -> torch.Tensor:
        return records[:, self.format.count_offset : self.format.count_offset + 4].view(torch.int32)

    # ------------------------------------------------------------------------------ access
    def _gather(self, ids: torch.Tensor, start: int = 0, end: Optional[int] = None) -> torch.Tensor:
        end = self.format.record_bytes if end is None else end
        source = self.records if (start, end) == (0, self.format.record_bytes) else self.records[:, start:end]
        records = source.index_select(0, ids)
        self.rows_read += ids.numel()
        self.bytes_read += records.numel()
        self._touched(ids.numel())
        return records

    def _scatter(self, ids: torch.Tensor, records: torch.Tensor, start: int = 0) -> None:
        self._before_write()
        if start == 0 and records.shape[1] == self.format.record_bytes:
            self.records.index_copy_(0, ids, records)
        else:
            self.records[:, start : start + records.shape[1]].index_copy_(0, ids, records)
        self.rows_written += ids.numel()
        self.bytes_written += records.numel()
        self._touched(ids.numel())

    def read(self, ids: torch.Tensor) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """(rows [n, dim] fp32, state {name: [n] or [n, dim] fp32}) of ``ids`` [n]."""
        records = self._gather(self._ids(ids), 0, self.format.count_offset)
        return self._decode_payload(records), self._decode_state(records)

    def read_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """[n, dim] fp32 rows of ``ids`` [n]."""
        return self._decode_payload(self._gather(self._ids(ids), 0, self.format.state_start))

    def read_state(self, ids: torch.Tensor) -> Dict[str, torch.Tensor]:
        """{name: [n] or [n, dim] fp32} optimizer state of ``ids`` [n]."""
        return self.read(ids)[1]

    def read_counts(self, ids: torch.Tensor) -> torch.Tensor:
        """[n] int64 access counts of ``ids`` (zeros when the store keeps no counts)."""
        ids = self._ids(ids)
        if not self.format.with_counts:
            return torch.zeros(ids.numel(), dtype=torch.int64)
        start = self.format.count_offset
        return self._gather(ids, start, start + 4).view(torch.int32)[:, 0].long()

    def write(self, ids: torch.Tensor, rows: torch.Tensor, state: Optional[Mapping[str, torch.Tensor]] = None,
              counts: Optional[torch.Tensor] = None) -> None:
        """Store ``rows`` [n, dim] fp32 (rounded to the storage precision) and, when given,
        ``state`` (every field: [n] or [n, dim] fp32) and access ``counts`` [n] of the unique
        ``ids`` [n]. What is not given stays as it was."""
        ids = self._ids(ids)
        n = ids.numel()
        rows = self._rows(rows, n, ids)
        fmt = self.format
        if state is not None:
            state = self._state(state, n)
        if counts is not None and fmt.with_counts:
            if tuple(counts.shape) != (n,):
                raise ValueError(f"{self._where()}: counts must be [{n}], got {list(counts.shape)}")
        else:
            counts = None
        if state is None:
            width = fmt.state_start
        else:
            width = fmt.record_bytes if counts is not None else fmt.count_offset
        out = torch.empty(n, width, dtype=torch.uint8)
        self._encode(out, rows, state, counts if width == fmt.record_bytes else None, self.stochastic_rounding)
        self._scatter(ids, out)
        if counts is not None and width != fmt.record_bytes:
            self.write_counts(ids, counts)

    def write_rows(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Store ``rows`` [n, dim] fp32 for the unique ``ids`` [n]; state and counts unchanged."""
        self.write(ids, rows)

    def write_state(self, ids: torch.Tensor, state: Mapping[str, torch.Tensor]) -> None:
        """Store the optimizer ``state`` (all fields) of the unique ``ids`` [n]; rows unchanged."""
        ids = self._ids(ids)
        state = self._state(state, ids.numel())
        fmt = self.format
        if not fmt.state:
            return
        out = torch.empty(ids.numel(), fmt.count_offset - fmt.state_start, dtype=torch.uint8)
        for name, offset, width in fmt.state_offsets:
            _float_view(out, offset - fmt.state_start, width).copy_(state[name])
        self._scatter(ids, out, fmt.state_start)

    def write_counts(self, ids: torch.Tensor, counts: torch.Tensor) -> None:
        """Store access ``counts`` [n] of the unique ``ids`` [n] (no-op without counts)."""
        ids = self._ids(ids)
        if not self.format.with_counts:
            return
        if tuple(counts.shape) != tuple(ids.shape):
            raise ValueError(f"{self._where()}: counts must be [{ids.numel()}], got {list(counts.shape)}")
        out = counts.to("cpu").clamp(0, 2**31 - 1).to(torch.int32).contiguous().view(torch.uint8).view(-1, 4)
        self._scatter(ids, out, self.format.count_offset)

    def write_range(self, start: int, rows: torch.Tensor, state: Optional[Mapping[str, torch.Tensor]] = None) -> None:
        """Fill rows ``start .. start + n`` with ``rows`` [n, dim] (rounded to nearest) and
        ``state`` (all fields; zeros when None); counts become 0. Used to initialise a store."""
        self._check_open()
        n = int(rows.shape[0]) if isinstance(rows, torch.Tensor) and rows.dim() == 2 else -1
        if n < 0 or start < 0 or start + n > self.num_rows:
            raise ValueError(f"{self._where()}: write_range({start}, rows {tuple(getattr(rows, 'shape', ()))}) "
                             f"does not fit the rows [0, {self.num_rows}) of dim {self.dim}")
        rows = self._rows(rows, n)
        if state is None:
            state = {name: torch.zeros(n, width) for name, width in self.format.state}
        state = self._state(state, n)
        self._before_write()
        target = self.records[start : start + n]
        self._encode(target, rows, state, torch.zeros(n, dtype=torch.int32) if self.format.with_counts else None,
                     stochastic=False)
        self._touched(n)

    def fill(self, make_rows: Callable[[int, int], torch.Tensor], state_value: float = 0.0) -> None:
        """Initialise every row: ``make_rows(start, count)`` -> [count, dim] fp32, called for
        consecutive chunks; every state field is set to ``state_value``."""
        chunk = max(1, _INIT_ROWS_BYTES // max(self.format.record_bytes, 4 * self.dim))
        for start in range(0, self.num_rows, chunk):
            count = min(chunk, self.num_rows - start)
            state = {name: torch.full((count, width), float(state_value)) for name, width in self.format.state}
            self.write_range(start, make_rows(start, count), state)

    # ------------------------------------------------------------------------------ lifecycle
    def _touched(self, num_records: int) -> None:
        """Hook: the SSD store releases mapped pages after enough records were touched."""

    def _before_write(self) -> None:
        """Hook: the SSD store marks itself unclean before its first write after a flush."""

    def flush(self) -> None:
        """Make all writes durable (no-op in memory)."""
        self._check_open()

    def close(self) -> None:
        """Flush and release the rows; the store cannot be used afterwards."""
        if not self.closed:
            self.flush()
            self.records = torch.empty(0, self.format.record_bytes, dtype=torch.uint8)
            self.closed = True

    def stats(self) -> Dict[str, int]:
        return {"rows_read": self.rows_read, "rows_written": self.rows_written,
                "bytes_read": self.bytes_read, "bytes_written": self.bytes_written}

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(name={self.name!r}, rows={self.num_rows}, dim={self.dim}, "
                f"precision={self.precision}, state={list(self.format.state_names)}, record_bytes={self.format.record_bytes})")

    def __enter__(self) -> "RowStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def row_format(dim: int, precision: str, state: Optional[Mapping[str, int]], with_counts: bool) -> RowFormat:
    return RowFormat(dim, precision, tuple((str(k), int(v)) for k, v in (state or {}).items()), bool(with_counts))


class DramRowStore(RowStore):
    """Rows in host memory (one uint8 tensor, zero-initialised).

    Args: num_rows, dim, precision ("fp32", "fp16", "bf16", "int8"), state (name -> width),
    with_counts, stochastic_rounding, seed, name (used in error messages).
    """

    kind = "dram"

    def __init__(self, num_rows: int, dim: int, precision: str = "fp32", state: Optional[Mapping[str, int]] = None,
                 with_counts: bool = False, stochastic_rounding: bool = True, seed: Optional[int] = 0,
                 name: str = "") -> None:
        if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows <= 0:
            raise ValueError(f"row store {name!r}: num_rows must be a positive integer, got {num_rows!r}")
        fmt = row_format(dim, precision, state, with_counts)
        super().__init__(torch.zeros(num_rows, fmt.record_bytes, dtype=torch.uint8), fmt, stochastic_rounding, seed, name)
