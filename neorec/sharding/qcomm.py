"""Quantized communication of pooled embeddings (Neo, section 4.4): the output all-to-all of the
forward and its gradient in the backward, each direction with its own codec.

    [embedding.comm]
    forward = "fp16"      # fp32 | fp16 | bf16 | int8
    backward = "bf16"

Codecs (a block = the [rows, dim] fp32 rows one rank sends to one other rank; a block is encoded
into bytes, the all-to-all moves uint8, the receiver decodes back to fp32):

- ``fp32``: the bytes as they are (4 per value).
- ``fp16``: 2 bytes per value plus one fp32 scale per block: a power of two chosen from the
  block's largest finite magnitude so that it lands in [2^14, 2^15). This is automatic loss
  scaling done per message: small gradients (of a loss averaged over a large batch) are lifted out
  of fp16's subnormal range, large values do not overflow (except finite values within 2^-11 of
  fp32's largest, about 3.4e38, which may round up to +-inf: only a diverged run holds them), and
  the scaling is exact (a power of two), so no step is ever skipped. Relative error <= 2^-11 for every value of magnitude >= 2^-28
  of the block's largest (those land on fp16 normals); smaller ones (fp16 subnormals after
  scaling): absolute error <= 2^-39 times the largest.
- ``bf16``: 2 bytes per value (fp32's exponent range: no scaling needed). Relative error <= 2^-8
  for values of magnitude >= 2^-126; smaller ones (subnormals, where bf16 keeps fewer bits):
  absolute error <= 2^-133 (finite values beyond bf16's largest, about +-3.39e38, become +-inf).
- ``int8``: row-wise: each row's min and step (max - min) / 255 (rounded up to the next fp32 where
  255 steps would fall short of the span: rows of subnormals), two fp32 per row, then one uint8
  per value rounded to nearest. Absolute error <= (max - min) / 510 + ulp(max |x|) per row (half a
  step, plus one fp32 ulp of the row's largest magnitude, at least the subnormal spacing 2^-149,
  for the fp32 arithmetic of the step and of the decoding, which matters for rows whose spread is
  only a few hundred ulps; a constant row is exact). Bytes per row: dim + 8.

Non-finite values (NaN, +-inf) are passed on, never refused, by every codec: fp32, fp16 and bf16
element by element (NaN as NaN, +-inf as +-inf), int8 row by row (a row holding one, or whose
values span more than fp32's range (e.g. -3e38 .. 3e38, a diverged run), decodes as all NaN). So a quantized run fails as the fp32 one does: non-finite forward values reach the loss,
whose check (``Trainer._check_finite``, on the all-reduced loss) stops every rank at the same
step; a non-finite gradient reaches the embedding update as an fp32 one would (and the next
step's loss check stops the run). Raising on the sending rank instead would leave the other ranks
blocked in this all-to-all until the sender's process exits or the collective times out, then
failing with a lost-connection error that hides the cause.

Sharding types: every sharding type returns its pooled rows with ONE all-to-all
(``output_dist.py``): table-, column- and table-column-wise pieces are placed by column; row-wise
and table-row-wise partial sums (a reduce-scatter in effect) are summed by the receiver AFTER
decoding, in fp32 (all-to-all, then local sum). Ids (input all-to-all) and replica all-reduces
are never quantized.

Bytes on the wire: ``CommStats`` counts the encoded bytes sent to other ranks, so fp16 and bf16
show about half of fp32 (plus 4 bytes per block for fp16) and int8 (dim + 8) / (4 dim). Every
block is padded to a multiple of 4 bytes (at most 3 bytes per block), so that the next one starts
aligned for its fp32 scale or header whatever the rows and widths.
Codecs are deterministic: the same inputs give the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from neorec.sharding.comm import Awaitable, CommStats

CODECS = ("fp32", "fp16", "bf16", "int8")
Shape = Tuple[int, int]  # (rows, dim) of one block


@dataclass
class CommConfig:
    """``[embedding.comm]``: codecs of the sharded pooled-embedding exchange.

    forward: codec of the pooled embeddings' all-to-all: fp32, fp16, bf16 or int8 (row-wise scale).
    backward: codec of their gradient's all-to-all, the same choices.
    """

    forward: str = "fp32"
    backward: str = "fp32"

    def __post_init__(self) -> None:
        for direction in ("forward", "backward"):
            value = getattr(self, direction)
            if value not in CODECS:
                raise ValueError(f"embedding.comm.{direction} must be one of {CODECS}, got {value!r}")

    @property
    def quantized(self) -> bool:
        return self.forward != "fp32" or self.backward != "fp32"


def _bytes_of(values: torch.Tensor) -> torch.Tensor:
    """The bytes of ``values`` in row-major order, as uint8 (a view where they lie contiguous). A
    one-value block cut from a strided column (output_dist's model-parallel columns of width 1 next
    to replica columns) keeps its stride through ``.to()`` and ``.contiguous()``, and
    ``view(torch.uint8)`` refused it: the exchange of a one-sample batch failed."""
    flat = values.reshape(-1)
    if flat.numel() and flat.stride(0) != 1:
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8)


class Codec:
    """Encodes fp32 blocks [rows, dim] to uint8 bytes and back."""

    name = "fp32"

    def num_bytes(self, rows: int, dim: int) -> int:
        return 4 * rows * dim

    def encode(self, block: torch.Tensor) -> torch.Tensor:
        """[rows, dim] float -> uint8 [num_bytes(rows, dim)]."""
        return _bytes_of(block.to(torch.float32))

    def decode(self, payload: torch.Tensor, rows: int, dim: int) -> torch.Tensor:
        """uint8 [num_bytes(rows, dim)] -> fp32 [rows, dim]."""
        return payload.view(torch.float32).view(rows, dim)


class HalfCodec(Codec):
    """fp16 with one power-of-two scale per block (see the module docstring)."""

    name = "fp16"
    _TARGET_EXPONENT = 14  # the largest magnitude lands in [2^14, 2^15)

    def num_bytes(self, rows: int, dim: int) -> int:
        return 4 + 2 * rows * dim if rows * dim else 0

    def encode(self, block: torch.Tensor) -> torch.Tensor:
        block = block.to(torch.float32).reshape(-1)
        if block.numel() == 0:
            return torch.zeros(0, dtype=torch.uint8, device=block.device)
        # NaN / +-inf do not choose the scale and go through as they are (module docstring)
        largest = block.abs().nan_to_num_(0.0, posinf=0.0, neginf=0.0).max()
        exponent = torch.frexp(largest)[1]  # 0 for an all-zero block: any scale encodes it exactly
        scale = torch.ldexp(torch.ones(1, device=block.device),
                            (self._TARGET_EXPONENT + 1 - exponent).clamp(-126, 127).reshape(1))
        half = (block * scale).to(torch.float16)
        return torch.cat([scale.view(torch.uint8), half.view(torch.uint8)])

    def decode(self, payload: torch.Tensor, rows: int, dim: int) -> torch.Tensor:
        if rows * dim == 0:
            return torch.zeros(rows, dim, device=payload.device)
        scale = payload[:4].view(torch.float32)
        return (payload[4:].view(torch.float16).to(torch.float32) / scale).view(rows, dim)


class BFloat16Codec(Codec):
    name = "bf16"

    def num_bytes(self, rows: int, dim: int) -> int:
        return 2 * rows * dim

    def encode(self, block: torch.Tensor) -> torch.Tensor:
        return _bytes_of(block.to(torch.bfloat16))

    def decode(self, payload: torch.Tensor, rows: int, dim: int) -> torch.Tensor:
        return payload.view(torch.bfloat16).to(torch.float32).view(rows, dim)


class Int8RowwiseCodec(Codec):
    """Per row: fp32 min and step, then dim uint8 codes (row-major: all headers, then all codes)."""

    name = "int8"

    def num_bytes(self, rows: int, dim: int) -> int:
        return rows * (8 + dim) if dim else 0

    def encode(self, block: torch.Tensor) -> torch.Tensor:
        block = block.to(torch.float32)
        rows, dim = block.shape
        if rows * dim == 0:
            return torch.zeros(self.num_bytes(rows, dim), dtype=torch.uint8, device=block.device)
        low, high = block.aminmax(dim=1)
        step = (high - low) / 255.0
        # a span of a few subnormals: the step rounded down (or to 0) would not reach the row's max
        step = torch.where(step * 255.0 < high - low, torch.nextafter(step, torch.full_like(step, float("inf"))), step)
        # NaN / +-inf in the row, or a span beyond fp32's range (the step is inf): all NaN decoded
        finite = torch.isfinite(step)
        step = torch.where(step > 0, step, torch.ones_like(step))
        codes = ((block - low[:, None]) / step[:, None]).round_().clamp_(0, 255)
        codes = codes.masked_fill_(~finite[:, None], 0).to(torch.uint8)
        header = torch.stack([low, step], dim=1).masked_fill_(~finite[:, None], float("nan"))
        return torch.cat([header.reshape(-1).view(torch.uint8), codes.reshape(-1)])

    def decode(self, payload: torch.Tensor, rows: int, dim: int) -> torch.Tensor:
        if rows * dim == 0:
            return torch.zeros(rows, dim, device=payload.device)
        header = payload[: 8 * rows].view(torch.float32).view(rows, 2)
        codes = payload[8 * rows :].view(rows, dim).to(torch.float32)
        return torch.addcmul(header[:, :1], codes, header[:, 1:])


def make_codec(name: str) -> Codec:
    """The codec called ``name`` (one of ``CODECS``)."""
    codecs = {"fp32": Codec, "fp16": HalfCodec, "bf16": BFloat16Codec, "int8": Int8RowwiseCodec}
    if name not in codecs:
        raise ValueError(f"unknown communication codec {name!r}; codecs are {CODECS}")
    return codecs[name]()


def block_bytes(codec: Codec, rows: int, dim: int) -> int:
    """Bytes a block takes in a payload: the codec's, padded to a multiple of 4 so that every
    block starts 4-byte aligned (its fp32 scale or header is read in place)."""
    return (codec.num_bytes(rows, dim) + 3) & ~3


def encode_blocks(codec: Codec, flat: torch.Tensor, shapes: Sequence[Shape]) -> Tuple[torch.Tensor, List[int]]:
    """1-D fp32 ``flat`` cut into blocks of ``shapes`` -> (uint8 payload, bytes per block, padded)."""
    sizes = [rows * dim for rows, dim in shapes]
    if flat.numel() != sum(sizes):
        raise ValueError(f"encode_blocks: {flat.numel()} values for blocks {list(shapes)}")
    parts: List[torch.Tensor] = []
    splits = []
    for block, (rows, dim) in zip(flat.split(sizes), shapes):
        part = codec.encode(block.view(rows, dim))
        parts.append(part)
        splits.append(block_bytes(codec, rows, dim))
        if splits[-1] > part.numel():
            parts.append(torch.zeros(splits[-1] - part.numel(), dtype=torch.uint8, device=flat.device))
    payload = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8, device=flat.device)
    return payload, splits


def decode_blocks(codec: Codec, payload: torch.Tensor, shapes: Sequence[Shape]) -> torch.Tensor:
    """uint8 payload of blocks ``shapes`` (as ``encode_blocks`` lays them out) -> 1-D fp32 of
    sum(rows * dim) values."""
    splits = [block_bytes(codec, rows, dim) for rows, dim in shapes]
    blocks = [codec.decode(part[: codec.num_bytes(rows, dim)], rows, dim).reshape(-1)
              for part, (rows, dim) in zip(payload.split(splits), shapes)]
    return torch.cat(blocks) if blocks else torch.zeros(0, device=payload.device)


def _exchange(codec: Codec, flat: torch.Tensor, send_shapes: Sequence[Shape], recv_shapes: Sequence[Shape],
              group: Optional[dist.ProcessGroup], stats: Optional[CommStats], name: str, async_op: bool):
    payload, send_bytes = encode_blocks(codec, flat, send_shapes)
    recv_bytes = [block_bytes(codec, rows, dim) for rows, dim in recv_shapes]
    received = torch.empty(sum(recv_bytes), dtype=torch.uint8, device=flat.device)
    if stats is not None:
        rank = dist.get_rank(group)
        stats.record(name, sum(n for r, n in enumerate(send_bytes) if r != rank))
    work = dist.all_to_all_single(received, payload, recv_bytes, send_bytes, group=group, async_op=async_op)
    return work, payload, received


class _Decode(torch.autograd.Function):
    """Forward: the decoded received blocks (the exchange is complete). Backward: the gradient
    goes back the reverse way, encoded with the backward codec, and is decoded for the sender."""

    @staticmethod
    def forward(ctx, anchor, tensor, received, exchange):  # type: ignore[override]
        ctx.exchange = exchange
        return decode_blocks(exchange["forward"], received, exchange["recv_shapes"])

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        e = ctx.exchange
        grad = grad_output.contiguous().to(torch.float32)
        start = e["stats"].now() if e["stats"] is not None else 0.0
        _, _, received = _exchange(e["backward"], grad, e["recv_shapes"], e["send_shapes"], e["group"], e["stats"],
                                   e["name"] + ".backward", async_op=False)
        if e["stats"] is not None:
            e["stats"].add_blocked(e["name"] + ".backward", e["stats"].now() - start)
        return None, decode_blocks(e["backward"], received, e["send_shapes"]), None, None


def quantized_all_to_all(tensor: torch.Tensor, send_shapes: Sequence[Shape], recv_shapes: Sequence[Shape],
                         group: Optional[dist.ProcessGroup], comm: CommConfig, stats: Optional[CommStats] = None,
                         name: str = "all_to_all") -> Awaitable[torch.Tensor]:
    """Differentiable all-to-all of the fp32 1-D ``tensor``: block r (``send_shapes[r]`` = (rows,
    dim), back to back) goes to rank r encoded with ``comm.forward``; ``wait()`` gives the decoded
    blocks received from ranks 0..W-1 (``recv_shapes``), 1-D fp32. Backward sends the gradient back
    encoded with ``comm.backward``. Under ``torch.no_grad`` no backward."""
    send_shapes = [(int(r), int(d)) for r, d in send_shapes]
    recv_shapes = [(int(r), int(d)) for r, d in recv_shapes]
    exchange = {"forward": make_codec(comm.forward), "backward": make_codec(comm.backward), "group": group,
                "stats": stats, "name": name, "send_shapes": send_shapes,
                "recv_shapes": recv_shapes}
    with torch.no_grad():
        work, payload, received = _exchange(exchange["forward"], tensor.detach().reshape(-1), send_shapes,
                                            recv_shapes, group, stats, name, async_op=True)
    differentiable = torch.is_grad_enabled()
    anchor = torch.zeros((), device=tensor.device, requires_grad=True) if differentiable else None

    def finish() -> torch.Tensor:
        assert payload is not None  # the sent buffer lives until the transfer is complete
        if not differentiable:
            return decode_blocks(exchange["forward"], received, recv_shapes)
        return _Decode.apply(anchor, tensor, received, exchange)

    return Awaitable([work], finish, stats, name)
