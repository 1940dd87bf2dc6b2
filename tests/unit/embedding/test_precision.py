"""Stochastic rounding to fp16/bf16: unbiased, seeded, repeatable.

    python -m pytest tests/unit/embedding/test_precision.py -q
"""

from __future__ import annotations

import pytest
import torch

from neorec.embedding.precision import Rounder, stochastic_round_bf16, stochastic_round_fp16, storage_dtype

ROUNDERS = {torch.bfloat16: stochastic_round_bf16, torch.float16: stochastic_round_fp16}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("value", [1.0 + 0.3 * 2**-7, -3.3 + 1e-3, 1e-3 + 7e-7, 5.0e-6, -3.01e-5, 6.1e-5])
def test_stochastic_rounding_is_unbiased_and_lands_on_neighbours(dtype, value):
    x = torch.full((200_000,), value, dtype=torch.float32)
    out = ROUNDERS[dtype](x, torch.Generator().manual_seed(0))
    assert out.dtype == dtype
    nearest = x[:1].to(dtype)
    toward = torch.tensor([float("inf") if value > float(nearest) else float("-inf")], dtype=dtype)
    neighbours = {float(nearest), float(torch.nextafter(nearest, toward))}
    assert set(out.float().unique().tolist()) == neighbours  # both neighbours, nothing else
    low, high = sorted(neighbours)
    spread = high - low
    # mean of n Bernoulli draws: standard error spread * sqrt(p(1-p)/n) <= spread * 0.0012
    assert abs(out.float().double().mean().item() - value) < 6 * 0.0012 * spread


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stochastic_rounding_keeps_representable_values(dtype):
    x = torch.tensor([0.0, -0.0, 1.0, -2.5, 0.125, float("inf"), float("-inf")]).to(dtype).float()
    out = ROUNDERS[dtype](x, torch.Generator().manual_seed(1))
    assert torch.equal(out.float(), x)
    assert torch.isnan(ROUNDERS[dtype](torch.tensor([float("nan")]), None)).all()


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_rounder_is_seeded_and_repeatable(precision):
    x = torch.randn(1000, 8, generator=torch.Generator().manual_seed(2))
    first = Rounder(storage_dtype(precision), stochastic=True, seed=7)
    second = Rounder(storage_dtype(precision), stochastic=True, seed=7)
    other = Rounder(storage_dtype(precision), stochastic=True, seed=8)
    a1, a2 = first.round(x), first.round(x)
    assert torch.equal(a1, second.round(x)) and torch.equal(a2, second.round(x))
    assert not torch.equal(a1, a2)  # the sequence moves on
    assert not torch.equal(a1, other.round(x))
    # state save/restore replays the same draws
    state = first.get_state()
    b1 = first.round(x)
    first.set_state(state)
    assert torch.equal(first.round(x), b1)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_rounder_without_stochastic_rounding_rounds_to_nearest(precision):
    x = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    out = Rounder(storage_dtype(precision), stochastic=False).round(x)
    assert torch.equal(out, x.to(storage_dtype(precision)))


def test_fp32_rounder_is_identity_and_bad_precision_is_rejected():
    x = torch.randn(10)
    assert Rounder(torch.float32).round(x) is x
    with pytest.raises(ValueError, match="precision must be one of"):
        storage_dtype("int4")


@pytest.mark.parametrize("round_", [stochastic_round_fp16, stochastic_round_bf16])
def test_stochastic_rounding_keeps_every_nan_a_nan(round_):
    """The random carry went into a NaN's payload: 0x7FFFFFFF became 0 (or -0), 0x7F800001 +inf,
    so a diverged row could be stored as zeros."""
    patterns = torch.tensor([0x7FFFFFFF, -1, 0x7F800001, 0x7FC00000, -0x00400000, 0x7FBFFFFF], dtype=torch.int32)
    values = patterns.view(torch.float32).repeat(200)  # many draws of the noise
    assert values.isnan().all()
    rounded = round_(values, torch.Generator().manual_seed(1))
    assert rounded.isnan().all()
    ordinary = torch.tensor([1.0, -2.5, float("inf"), float("-inf"), 0.0])
    assert torch.equal(round_(ordinary, torch.Generator().manual_seed(1)).float()[2:], ordinary[2:])
