"""Codecs of the quantized pooled-embedding exchange: round trips within the stated error bounds,
the stated bounds on targeted inputs at their edges, encoded sizes, edge cases (empty blocks,
constant rows, zeros, tiny gradients for fp16, rows spanning more than fp32's range, NaN / inf passed
on by every codec), config validation.

    python -m pytest tests/unit/sharding/test_qcomm.py -q
"""

from __future__ import annotations

import pytest
import torch

from neorec.config import load_config
from neorec.sharding import qcomm
from neorec.sharding.qcomm import CODECS, CommConfig, block_bytes, decode_blocks, encode_blocks, make_codec


def blocks(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    embeddings = torch.randn(64, 16, generator=generator) * 0.05  # pooled rows
    gradients = torch.randn(64, 16, generator=generator) * 1e-7  # gradient of a mean loss over a big batch
    mixed = torch.randn(32, 8, generator=generator) * torch.logspace(-3, 3, 8)  # columns of very different size
    return [embeddings, gradients, mixed]


def round_trip(name: str, block: torch.Tensor) -> torch.Tensor:
    codec = make_codec(name)
    payload = codec.encode(block)
    assert payload.dtype == torch.uint8 and payload.numel() == codec.num_bytes(*block.shape)
    return codec.decode(payload, *block.shape)


def test_fp32_is_exact():
    for block in blocks():
        assert torch.equal(round_trip("fp32", block), block)


@pytest.mark.parametrize("name,relative", [("fp16", 2.0 ** -11), ("bf16", 2.0 ** -8)])
def test_half_formats_within_relative_bound(name, relative):
    for block in blocks():
        got = round_trip(name, block)
        largest = block.abs().max()
        bound = relative * block.abs() + (2.0 ** -39) * largest
        assert bool(((got - block).abs() <= bound).all()), (name, float(((got - block).abs() - bound).max()))


def test_fp16_scaling_keeps_tiny_gradients_that_plain_fp16_loses():
    gradients = blocks()[1]  # ~1e-7: most are subnormal or zero in plain fp16
    plain_error = (gradients.to(torch.float16).float() - gradients).abs().max() / gradients.abs().max()
    scaled_error = (round_trip("fp16", gradients) - gradients).abs().max() / gradients.abs().max()
    assert plain_error > 1e-3 and scaled_error < 2.0 ** -11


def fp16_bound(block: torch.Tensor) -> torch.Tensor:
    """The documented fp16 bound: relative 2^-11 down to 2^-28 of the block's largest magnitude,
    absolute 2^-39 of the largest below."""
    largest = block.abs().max()
    return torch.where(block.abs() >= 2.0 ** -28 * largest, 2.0 ** -11 * block.abs(), 2.0 ** -39 * largest)


def test_the_documented_bounds_are_the_tested_ones():
    doc = " ".join(qcomm.__doc__.split())
    assert "Relative error <= 2^-11 for every value of magnitude >= 2^-28 of the block's largest" in doc
    assert "absolute error <= 2^-39 times the largest" in doc
    assert "Absolute error <= (max - min) / 510 + ulp(max |x|) per row" in doc
    assert "Non-finite values (NaN, +-inf) are passed on, never refused, by every codec" in doc


def test_fp16_bounds_hold_at_their_edges():
    # largest 1.0: scale 2^14, the bottom of [2^14, 2^15); fp16 normals start at 2^-14, i.e. 2^-28 here
    edge = [2.0 ** -28 * (1 + 2.0 ** -11 + 2.0 ** -12),  # the smallest scaled normals: worst relative error
            2.0 ** -29 * (1 + 2.0 ** -10),  # fp16 subnormal after scaling: relative error 2^-10
            2.0 ** -39, 1.5 * 2.0 ** -39, 2.0 ** -40 * 3]  # half a subnormal spacing away: error 2^-39
    for largest in (1.0, 2.0 ** 20, 2.0 ** -60, 1.999):
        block = torch.tensor([[1.0] + edge]) * largest
        error = (round_trip("fp16", block) - block).abs()
        assert bool((error <= fp16_bound(block)).all()), (largest, (error - fp16_bound(block)).tolist())
    block = torch.tensor([[1.0] + edge])
    error = (round_trip("fp16", block) - block).abs()
    assert float(error[0, 3]) == 2.0 ** -39  # 2^-39 -> 0: the small-value bound is attained
    assert float(error[0, 2] / block[0, 2]) > 2.0 ** -11  # below 2^-28 the relative bound no longer holds
    generator = torch.Generator().manual_seed(1)
    for exponent in range(-140, 120, 7):  # blocks of every magnitude, values spread over 40 binades
        block = 2.0 ** exponent * torch.rand(8, 33, generator=generator) * 2.0 ** -torch.randint(0, 40, (8, 33),
                                                                                               generator=generator)
        error = (round_trip("fp16", block) - block).abs()
        assert bool((error <= fp16_bound(block)).all()), exponent


def test_fp16_large_values_do_not_overflow():
    block = torch.tensor([[1e6, -3e7, 5.0], [0.0, 1.0, 2e5]])
    got = round_trip("fp16", block)
    assert bool(torch.isfinite(got).all())
    torch.testing.assert_close(got, block, rtol=2.0 ** -11, atol=0.0)


def ulp(values: torch.Tensor) -> torch.Tensor:
    """fp32's unit in the last place of each of ``values`` (2^-149 among subnormals)."""
    return torch.ldexp(torch.ones_like(values), (torch.frexp(values)[1] - 24).clamp_min(-149))


def int8_bound(block: torch.Tensor) -> torch.Tensor:
    """The documented int8 bound per row: (max - min) / 510 + ulp(max |x|)."""
    low, high = block.aminmax(dim=1)
    return (high / 510.0 - low / 510.0 + ulp(block.abs().amax(dim=1)))[:, None]


def test_int8_within_half_a_step_of_each_row_range():
    for block in blocks():
        got = round_trip("int8", block)
        low, high = block.aminmax(dim=1)
        bound = (high - low)[:, None] / 510.0 * (1 + 1e-4) + 1e-6 * block.abs().max(dim=1, keepdim=True).values
        assert bool(((got - block).abs() <= bound).all())
        assert bool(((got - block).abs() <= int8_bound(block)).all())
        assert not torch.equal(got, block)  # it did quantize


def test_int8_bound_on_rows_of_subnormals():
    """A span of a few hundred subnormals: the step (span / 255) rounded down to the subnormal grid
    (or to 0) did not reach the row's max: 300 ulps came back as 255 (45x the bound)."""
    tiny = 2.0 ** -149
    spans = torch.tensor([1, 7, 254, 255, 256, 300, 511, 1000, 70000])
    block = torch.stack([torch.linspace(0, 1, 9) * float(n) * tiny for n in spans])
    block[:, -1] = spans.float() * tiny  # the exact max
    error = (round_trip("int8", block) - block).abs()
    assert bool((error <= int8_bound(block)).all()), (error / int8_bound(block)).max()


def test_int8_bound_on_rows_spread_over_a_few_hundred_ulps():
    # rows far from zero whose spread is a few hundred fp32 ulps: the fp32 arithmetic of the step
    # and of the decoding adds up to one ulp of the largest magnitude to the half step
    generator = torch.Generator().manual_seed(2)
    offsets = torch.tensor([-136.5, 1000.0, 3.0e5, -7.0e-3, 2.5e20])[:, None]
    spread = torch.randint(1, 600, (5, 1), generator=generator).float() * ulp(offsets.abs())
    block = (offsets + torch.rand(5, 16, generator=generator) * spread).repeat(40, 1)
    block = block + torch.randint(0, 300, (200, 1), generator=generator).float() * ulp(offsets.abs().repeat(40, 1))
    error = (round_trip("int8", block) - block).abs()
    assert bool((error <= int8_bound(block)).all())
    low, high = block.aminmax(dim=1)
    assert bool((error > ((high - low) / 510.0)[:, None]).any())  # half a step alone is not a bound here
    audit = torch.tensor([[-136.499496, -136.499207, -136.495499, -136.4975]])  # exceeded half a step 1.9x
    assert bool(((round_trip("int8", audit) - audit).abs() <= int8_bound(audit)).all())


def test_int8_rows_spanning_more_than_fp32_decode_as_nan_like_non_finite_ones():
    """Such a row (a diverged run) is passed on as NaN, as a row holding NaN is, so the loss check
    stops every rank; the other rows of the block are unaffected."""
    for largest in (2e38, 3.39e38, torch.finfo(torch.float32).max):
        block = torch.tensor([[largest, -largest, 1.0, 0.0, largest / 3, -largest / 7],
                              [largest, largest / 2, 0.0, 2.0, 1.0, 3.0]])
        got = round_trip("int8", block)
        assert bool(got[0].isnan().all()), got
        assert bool(((got[1] - block[1]).abs() <= int8_bound(block[1:])).all())


def test_int8_constant_and_zero_rows_are_exact():
    block = torch.tensor([[0.25] * 5, [0.0] * 5, [-3.0] * 5])
    assert torch.equal(round_trip("int8", block), block)
    assert torch.equal(round_trip("fp16", torch.zeros(3, 4)), torch.zeros(3, 4))


@pytest.mark.parametrize("name", CODECS)
def test_blocks_round_trip_with_empty_blocks_and_sizes(name):
    codec = make_codec(name)
    shapes = [(3, 5), (0, 4), (5, 0), (1, 3), (2, 7)]  # odd sizes: fp16 / int8 blocks of 34 and 39 bytes
    flat = torch.randn(sum(r * d for r, d in shapes))
    payload, splits = encode_blocks(codec, flat, shapes)
    assert splits == [block_bytes(codec, r, d) for r, d in shapes] and payload.numel() == sum(splits)
    assert all(n % 4 == 0 and codec.num_bytes(r, d) <= n < codec.num_bytes(r, d) + 4
               for n, (r, d) in zip(splits, shapes))  # padded so that every block starts aligned
    assert splits[1] == splits[2] == 0
    decoded = decode_blocks(codec, payload, shapes)
    assert decoded.shape == flat.shape
    tolerance = {"fp32": 0.0, "fp16": 1e-3, "bf16": 1e-2, "int8": 0.05}[name]
    torch.testing.assert_close(decoded, flat, atol=tolerance * flat.abs().max(), rtol=0.0)
    again, _ = encode_blocks(codec, flat, shapes)
    assert torch.equal(again, payload)  # deterministic


@pytest.mark.parametrize("name", CODECS)
def test_blocks_cut_from_a_strided_column_encode_one_value_blocks_too(name):
    """What output_dist hands the codecs when a rank's model-parallel output is 1 column wide beside
    replica columns: pooled[:, :1].reshape(-1), a strided view; its one-value blocks (a rank with
    one sample) kept their stride, and the fp32 and bf16 codecs' view(torch.uint8) refused them."""
    codec = make_codec(name)
    pooled = torch.randn(4, 3)
    flat = pooled[:, :1].reshape(-1)
    shapes = [(1, 1), (3, 1)]
    payload, _ = encode_blocks(codec, flat, shapes)
    expected, _ = encode_blocks(codec, flat.contiguous(), shapes)
    assert torch.equal(payload, expected)
    tolerance = {"fp32": 0.0, "fp16": 1e-3, "bf16": 1e-2, "int8": 0.05}[name]
    torch.testing.assert_close(decode_blocks(codec, payload, shapes), flat, atol=tolerance * flat.abs().max(), rtol=0.0)


def test_encoded_sizes_against_fp32():
    rows, dim = 128, 16
    fp32 = make_codec("fp32").num_bytes(rows, dim)
    assert make_codec("bf16").num_bytes(rows, dim) * 2 == fp32
    assert make_codec("fp16").num_bytes(rows, dim) == fp32 // 2 + 4
    assert make_codec("int8").num_bytes(rows, dim) == rows * (dim + 8)


@pytest.mark.parametrize("name", CODECS)
def test_non_finite_values_are_passed_on_by_every_codec(name):
    # refusing them on the sending rank would leave the other ranks blocked in the all-to-all; passed
    # on, they reach the all-reduced loss, whose check stops every rank at once
    nan, inf = float("nan"), float("inf")
    block = torch.tensor([[1.0, nan, 2.0, -0.5], [1.0, inf, 3.0, 0.25], [-inf, 2.0, 3.0, 0.5], [1.0, 2.0, 3.0, -1.0]])
    got = round_trip(name, block)
    clean = torch.tensor([[1.0, 2.0, 3.0, -1.0]])
    assert torch.equal(got[3:], round_trip(name, clean))  # the other rows as without them
    if name == "int8":
        assert bool(torch.isnan(got[:3]).all())  # row-wise: the row holding one decodes as all NaN
    else:
        assert torch.isnan(got[0, 1]) and float(got[1, 1]) == inf and float(got[2, 0]) == -inf
        finite = torch.isfinite(block)
        assert torch.equal(got[finite], round_trip(name, torch.where(finite, block, 0.0))[finite])
    payload = make_codec(name).encode(block)
    assert torch.equal(payload, make_codec(name).encode(block))  # still deterministic


def test_config_keys_and_errors():
    cfg = load_config(None, ['embedding.comm.forward="int8"', 'embedding.comm.backward="bf16"'])
    assert cfg.embedding.comm == CommConfig("int8", "bf16") and cfg.embedding.comm.quantized
    assert not CommConfig().quantized
    with pytest.raises(ValueError, match=r"embedding.comm.forward must be one of .*'fp8'"):
        load_config(None, ['embedding.comm.forward="fp8"'])
    with pytest.raises(ValueError, match="unknown communication codec"):
        make_codec("int4")
