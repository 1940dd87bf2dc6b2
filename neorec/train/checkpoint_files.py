"""Checkpoint files: atomic writes, checksums, tensor files read without unpickling, and per-row
quantization of embedding rows (Check-N-Run).

Files are written with ``neorec.files.write_atomic`` (temp file, fsync, rename, fsync of the
directory): a crash leaves either the old file or the new one, never a torn one.

- ``save_tensors(path, tensors)``: a flat ``{name: tensor}`` dict written with ``torch.save`` (to
  memory, then atomically); ``load_tensors`` reads it back with ``torch.load(weights_only=True)``
  (no arbitrary objects are unpickled) and returns the dict.
- ``MappedFiles``: the files a restore reads, at most ``MAPPED_BYTES`` of them mapped at once.
- ``sha256_file(path)``: hex digest, read in 1 MiB blocks.
- ``quantize_rows(x, bits)`` / ``dequantize_rows``: per-row asymmetric min/max quantization of
  x [R, C] fp32 to ``bits`` in {8, 4, 2}: ``scale = (max - min) / (2^bits - 1)``,
  ``q = round((x - min) / scale)``; 4- and 2-bit codes are packed 2 and 4 per byte. Stored:
  codes uint8 [R, ceil(C * bits / 8)], ``scale`` and ``minimum`` fp32 [R]. The reconstruction
  error of an element is at most ``scale / 2`` plus the fp32 rounding of ``q * scale + min`` (an ulp
  of the value: it shows only for rows whose span is a few ulps); a span of subnormals whose
  ``scale`` would round to 0 gets the next representable one (its rows were decoded as constant).
"""

from __future__ import annotations

import hashlib
import io
import math
from collections import OrderedDict
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch

from neorec.files import write_atomic

ROW_BITS = (32, 8, 4, 2)


def save_tensors(path: Path, tensors: Dict[str, torch.Tensor]) -> int:
    """Write a flat ``{name: tensor}`` dict atomically; returns the bytes written."""
    buffer = io.BytesIO()
    torch.save({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, buffer)
    data = buffer.getvalue()
    write_atomic(path, data)
    return len(data)


def load_tensors(path: Path) -> Dict[str, torch.Tensor]:
    """The dict ``save_tensors`` wrote (``torch.load(weights_only=True)``, CPU tensors memory-mapped
    from the file: only what is used is read)."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # a torn or foreign file: zip or unpickler errors of many kinds
        raise ValueError(f"checkpoint file {str(path)!r} cannot be read: {exc}") from exc
    if not isinstance(data, dict) or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise ValueError(f"checkpoint file {str(path)!r} does not hold a flat dict of tensors")
    return data


MAPPED_BYTES = 64 << 20  # of checkpoint files mapped at once by a restore (MappedFiles)


class MappedFiles:
    """The tensor files a restore reads (``load_tensors``: memory-mapped), at most ``budget`` bytes
    of them mapped at once, the least recently used unmapped first. Their mappings are private:
    they count toward the process's data size (``RLIMIT_DATA``, VmData), so a restore of a table
    larger than memory, saved in chunk files, must not keep every file mapped. A file is mapped
    again when needed again (a read of its zip index, not of its data)."""

    def __init__(self, budget: Optional[int] = None) -> None:
        self.budget = MAPPED_BYTES if budget is None else budget
        self.mapped: "OrderedDict[Path, Tuple[int, Dict[str, torch.Tensor]]]" = OrderedDict()
        self.loads = 0

    def tensors(self, path: Path) -> Dict[str, torch.Tensor]:
        if path in self.mapped:
            self.mapped.move_to_end(path)
            return self.mapped[path][1]
        size = path.stat().st_size
        while self.mapped and sum(s for s, _ in self.mapped.values()) + size > self.budget:
            self.mapped.popitem(last=False)
        self.mapped[path] = (size, load_tensors(path))
        self.loads += 1
        return self.mapped[path][1]

    def close(self) -> None:
        self.mapped.clear()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_row_bits(bits: int, where: str = "checkpoint.row_bits") -> None:
    if bits not in ROW_BITS:
        raise ValueError(f"{where} must be one of {ROW_BITS} (32 = no quantization), got {bits!r}")


class UnquantizableRowError(ValueError):
    """A row holding NaN or inf (or values spanning more than the fp32 range) cannot be quantized."""

    def __init__(self, row: int, bits: int, table: Optional[str] = None) -> None:
        where = f"table {table!r} row {row}" if table is not None else f"quantize_rows: row {row}"
        super().__init__(f"{where} holds NaN or inf, or values spanning more than the fp32 range; it cannot be "
                         f"stored in {bits} bits (save this table's rows unquantized)")
        self.row, self.bits = row, bits


def quantize_rows(x: torch.Tensor, bits: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [R, C] -> (codes uint8 [R, ceil(C * bits / 8)], scale fp32 [R], minimum fp32 [R])."""
    check_row_bits(bits)
    if bits == 32:
        raise ValueError("quantize_rows: bits = 32 means no quantization")
    x = x.to(torch.float32)
    rows, cols = x.shape
    levels = (1 << bits) - 1
    per_byte = 8 // bits
    if cols == 0 or rows == 0:  # nothing to pack (an incremental piece with no modified row)
        return torch.zeros(rows, -(-cols // per_byte), dtype=torch.uint8), torch.zeros(rows), torch.zeros(rows)
    minimum, maximum = x.aminmax(dim=1)
    scale = (maximum - minimum) / levels
    # a span of a few subnormals: the scale rounded down (or to 0) would not reach the row's max
    scale = torch.where(scale * levels < maximum - minimum, torch.nextafter(scale, torch.full_like(scale, math.inf)),
                        scale)
    if not bool(torch.isfinite(scale).all()):
        row = int((~torch.isfinite(scale)).nonzero()[0])
        raise UnquantizableRowError(row, bits)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((x - minimum[:, None]) / safe[:, None]).clamp_(0, levels).to(torch.uint8)
    pad = (-cols) % per_byte
    if per_byte > 1:
        if pad:
            codes = torch.cat([codes, codes.new_zeros(rows, pad)], dim=1)
        codes = codes.view(rows, -1, per_byte)
        packed = codes[:, :, 0].clone()
        for i in range(1, per_byte):
            packed |= codes[:, :, i] << (bits * i)
        codes = packed
    return codes.contiguous(), scale, minimum


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int,
                    cols: int) -> torch.Tensor:
    """Inverse of ``quantize_rows``: fp32 [R, cols]."""
    check_row_bits(bits)
    per_byte = 8 // bits
    rows = codes.shape[0]
    if per_byte > 1:
        mask = (1 << bits) - 1
        parts = [(codes >> (bits * i)) & mask for i in range(per_byte)]
        codes = torch.stack(parts, dim=2).reshape(rows, codes.shape[1] * per_byte)[:, :cols]
    return codes.to(torch.float32) * scale[:, None] + minimum[:, None]
