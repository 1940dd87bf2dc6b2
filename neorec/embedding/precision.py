"""Low-precision embedding storage: fp16/bf16 rows with seeded stochastic rounding.

Updates are always computed in fp32 on the touched rows and then rounded back to the storage
dtype. Stochastic rounding (SR) is unbiased: a value ``x`` between the two neighbouring
representable values ``lo <= x <= hi`` becomes ``hi`` with probability ``(x - lo) / (hi - lo)``,
so ``E[round(x)] = x`` and small updates are not systematically lost (round-to-nearest would drop
any update below half an ulp). The random draws come from a ``torch.Generator`` seeded by
``StorageConfig.seed``; given the same seed and the same sequence of calls the result repeats bit
for bit.

    rounder = Rounder(torch.bfloat16, stochastic=True, seed=0, device="cpu")
    stored = rounder.round(updated_rows_fp32)        # [R, D] fp32 -> [R, D] bf16
"""

from __future__ import annotations

from typing import Optional, Union

import torch

STORAGE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def storage_dtype(precision: str) -> torch.dtype:
    """The torch dtype of a ``StorageConfig.precision`` name ("fp32", "fp16", "bf16")."""
    try:
        return STORAGE_DTYPES[precision]
    except KeyError:
        raise ValueError(f"precision must be one of {sorted(STORAGE_DTYPES)}, got {precision!r}") from None


def first_overflow(values: torch.Tensor, rounded: torch.Tensor) -> Optional[int]:
    """Flat index of the first finite value of ``values`` that ``rounded`` (its copy in a narrower
    type) holds as inf, None when there is none: a value beyond fp16's range became inf without a
    word when fp32 rows were copied into fp16 storage). ``values`` may lie on another device (a
    resume hands host rows to a GPU's tables)."""
    if rounded.dtype not in (torch.float16, torch.bfloat16):
        return None
    overflow = torch.isinf(rounded) & torch.isfinite(values).to(rounded.device)
    return int(overflow.reshape(-1).to(torch.uint8).argmax()) if bool(overflow.any()) else None


def overflow_message(where: str, value: float, dtype: torch.dtype) -> str:
    name = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    return (f"{where} holds {value:.6g}, beyond the largest {name} value ({torch.finfo(dtype).max:.6g}); "
            "refusing to store it as inf (keep this table's rows in fp32)")


def _uniform_16_bits(shape: torch.Size, device: torch.device, generator: Optional[torch.Generator]) -> torch.Tensor:
    """int32 tensor of ``shape`` with independent uniform values in [0, 2^16).

    Draws full-range 64-bit words and splits each into four 16-bit fields (one generator draw per
    four values instead of one per value: the CPU Mersenne twister is the cost of SR)."""
    count = 1
    for size in shape:
        count *= size
    words = torch.empty((count + 3) // 4, dtype=torch.int64, device=device)
    words.random_(-(2**63), None, generator=generator)  # all 64 bits uniform
    fields = words.view(torch.int16)[:count].to(torch.int32)  # [-2^15, 2^15)
    return fields.bitwise_and_(0xFFFF).view(shape)


def stochastic_round_bf16(values: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
    """Unbiased stochastic rounding of fp32 ``values`` (any shape) to bf16.

    bf16 is the upper 16 bits of an fp32 bit pattern. Adding a uniform random integer in
    [0, 2^16) to the pattern and clearing the low 16 bits carries into the kept bits with
    probability (low bits) / 2^16, i.e. rounds the magnitude up with probability proportional to
    the distance from the lower neighbour. Works for both signs (sign-magnitude layout); inf stays
    inf, NaN stays NaN, values just under the largest finite bf16 may round to inf.
    """
    if values.dtype != torch.float32:
        raise TypeError(f"stochastic_round_bf16 expects fp32 values, got {values.dtype}")
    bits = values.contiguous().view(torch.int32)
    noise = _uniform_16_bits(bits.shape, bits.device, generator)
    rounded = noise.add_(bits).bitwise_and_(-65536).view(torch.float32)  # -65536 == 0xFFFF0000 as int32
    # a NaN's payload can carry into the sign or clear to an infinity's or zero's pattern: keep NaN
    return torch.where(values.isnan(), values, rounded).to(torch.bfloat16)  # exact: the low 16 bits are zero


_FP16_MIN_NORMAL = 2.0**-14


def stochastic_round_fp16(values: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
    """Unbiased stochastic rounding of fp32 ``values`` (any shape) to fp16.

    In fp16's normal range the bit trick of bf16 applies to the 13 fp32 mantissa bits that fp16
    lacks: add a uniform integer in [0, 2^13) to the bit pattern of ``|x|`` and clear those bits;
    the result is exactly representable in fp16. Below 2^-14 (fp16 subnormals, spacing 2^-24)
    ``|x| + 2^-14`` lies in [2^-14, 2^-13), whose spacing is also 2^-24: round that the same way
    and subtract 2^-14 again (the fp32 add is exact up to 2^-37, i.e. 2^-13 of an fp16 step).
    The sign is put back at the end. Beyond 65504, fp16's largest value, the result may be inf
    (round-to-nearest gives inf from 65520 on); NaN stays NaN. Branch-free (no data-dependent
    indexing).
    """
    if values.dtype != torch.float32:
        raise TypeError(f"stochastic_round_fp16 expects fp32 values, got {values.dtype}")
    magnitude = values.abs()
    tiny = magnitude < _FP16_MIN_NORMAL
    magnitude = torch.where(tiny, magnitude + _FP16_MIN_NORMAL, magnitude)
    noise = _uniform_16_bits(values.shape, values.device, generator).bitwise_right_shift_(3)  # [0, 2^13)
    rounded = noise.add_(magnitude.view(torch.int32)).bitwise_and_(-8192).view(torch.float32)  # ~0x1FFF
    rounded = torch.where(tiny, rounded - _FP16_MIN_NORMAL, rounded).copysign_(values)
    return torch.where(values.isnan(), values, rounded).to(torch.float16)  # NaN payloads could round to 0 or inf


class Rounder:
    """Rounds fp32 rows to the storage dtype: identity for fp32, seeded SR or round-to-nearest for
    fp16/bf16. Owns the ``torch.Generator`` of the SR draws so that a run repeats bit for bit.

    The generator is created on first use, on the device of the values being rounded, seeded with
    ``seed``; moving the module to another device restarts the sequence from the seed.

    Args:
        dtype: storage dtype (torch.float32, torch.float16 or torch.bfloat16).
        stochastic: stochastic rounding on (otherwise round to nearest even).
        seed: generator seed; None draws a non-deterministic seed.
    """

    def __init__(self, dtype: torch.dtype, stochastic: bool = True, seed: Optional[int] = 0) -> None:
        if dtype not in STORAGE_DTYPES.values():
            raise ValueError(f"storage dtype must be one of {list(STORAGE_DTYPES.values())}, got {dtype}")
        self.dtype = dtype
        self.stochastic = bool(stochastic) and dtype != torch.float32
        self.seed = seed
        self._generator: Optional[torch.Generator] = None
        self._pending_state: Optional[torch.Tensor] = None

    def generator(self, device: Union[torch.device, str]) -> torch.Generator:
        """The SR generator on ``device`` (created and seeded on first use)."""
        device = torch.device(device)
        if self._generator is None or self._generator.device.type != device.type:
            self._generator = torch.Generator(device=device)
            if self.seed is None:
                self._generator.seed()
            else:
                self._generator.manual_seed(int(self.seed))
            if self._pending_state is not None:
                if self._pending_state.numel() == self._generator.get_state().numel():  # else: another device's
                    self._generator.set_state(self._pending_state)
                self._pending_state = None
        return self._generator

    def round(self, values: torch.Tensor) -> torch.Tensor:
        """fp32 ``values`` (any shape) -> same shape in ``self.dtype``."""
        if self.dtype == torch.float32:
            return values
        if not self.stochastic:
            return values.to(self.dtype)
        generator = self.generator(values.device)
        if self.dtype == torch.bfloat16:
            return stochastic_round_bf16(values, generator)
        return stochastic_round_fp16(values, generator)

    def get_state(self) -> torch.Tensor:
        """The generator state as a CPU uint8 tensor; empty while no draw has been made."""
        if self._generator is not None:
            return self._generator.get_state()
        if self._pending_state is not None:
            return self._pending_state.clone()
        return torch.zeros(0, dtype=torch.uint8)

    def set_state(self, state: torch.Tensor) -> bool:
        """Restore a state from ``get_state`` (empty: start again from the seed). False, and nothing
        restored, for the state of another kind of device's generator (a CPU generator's state is
        5056 bytes, a CUDA one's 16: a checkpoint saved on a GPU resumed on the CPU, or back). A
        Rounder that has not made its generator yet (its device is not known before its first use)
        keeps the state and returns True; its first generator takes it only if it is of that
        device's kind, else starts from the seed (a fused module makes its generator when built,
        so a checkpoint's restore always gets the answer above)."""
        state = state.detach().to("cpu", torch.uint8)
        if state.numel() == 0:
            self._generator, self._pending_state = None, None
        elif self._generator is not None:
            if state.numel() != self._generator.get_state().numel():
                return False
            self._generator.set_state(state)
        else:
            self._pending_state = state.clone()
        return True
