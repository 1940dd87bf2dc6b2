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
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device, generator=generator)
    rounded = noise.add_(bits).bitwise_and_(-65536)  # -65536 == 0xFFFF0000 as int32
    return rounded.view(torch.float32).to(torch.bfloat16)  # exact: the low 16 bits are zero


def stochastic_round_fp16(values: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
    """Unbiased stochastic rounding of fp32 ``values`` (any shape) to fp16.

    ``near`` is the round-to-nearest fp16 value, ``other`` its neighbour on the far side of the
    input (``torch.nextafter``); the result is ``other`` with probability
    ``|x - near| / |other - near|``. Exactly representable values are unchanged; values beyond the
    fp16 range become inf as with round-to-nearest; NaN stays NaN.
    """
    if values.dtype != torch.float32:
        raise TypeError(f"stochastic_round_fp16 expects fp32 values, got {values.dtype}")
    near = values.to(torch.float16)
    near32 = near.float()
    distance = values - near32
    toward = torch.where(distance > 0, float("inf"), float("-inf")).to(torch.float16)
    other = torch.nextafter(near, toward)
    probability = distance.abs_().div_((other.float() - near32).abs_())
    draw = torch.rand(values.shape, device=values.device, generator=generator)
    return torch.where(draw < probability, other, near)


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

    def set_state(self, state: torch.Tensor) -> None:
        """Restore a state from ``get_state`` (empty: start again from the seed)."""
        state = state.detach().to("cpu", torch.uint8)
        if state.numel() == 0:
            self._generator, self._pending_state = None, None
        elif self._generator is not None:
            self._generator.set_state(state)
        else:
            self._pending_state = state.clone()
