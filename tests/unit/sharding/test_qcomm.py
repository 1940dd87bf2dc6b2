"""Codecs of the quantized pooled-embedding exchange: round trips within the stated error bounds,
encoded sizes, edge cases (empty blocks, constant rows, zeros, tiny gradients for fp16), config
validation.

    python -m pytest tests/unit/sharding/test_qcomm.py -q
"""

from __future__ import annotations

import pytest
import torch

from neorec.config import load_config
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
        bound = relative * block.abs() + (2.0 ** -40) * largest
        assert bool(((got - block).abs() <= bound).all()), (name, float(((got - block).abs() - bound).max()))


def test_fp16_scaling_keeps_tiny_gradients_that_plain_fp16_loses():
    gradients = blocks()[1]  # ~1e-7: most are subnormal or zero in plain fp16
    plain_error = (gradients.to(torch.float16).float() - gradients).abs().max() / gradients.abs().max()
    scaled_error = (round_trip("fp16", gradients) - gradients).abs().max() / gradients.abs().max()
    assert plain_error > 1e-3 and scaled_error < 2.0 ** -11


def test_fp16_large_values_do_not_overflow():
    block = torch.tensor([[1e6, -3e7, 5.0], [0.0, 1.0, 2e5]])
    got = round_trip("fp16", block)
    assert bool(torch.isfinite(got).all())
    torch.testing.assert_close(got, block, rtol=2.0 ** -11, atol=0.0)


def test_int8_within_half_a_step_of_each_row_range():
    for block in blocks():
        got = round_trip("int8", block)
        low, high = block.aminmax(dim=1)
        bound = (high - low)[:, None] / 510.0 * (1 + 1e-4) + 1e-6 * block.abs().max(dim=1, keepdim=True).values
        assert bool(((got - block).abs() <= bound).all())
        assert not torch.equal(got, block)  # it did quantize


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


def test_encoded_sizes_against_fp32():
    rows, dim = 128, 16
    fp32 = make_codec("fp32").num_bytes(rows, dim)
    assert make_codec("bf16").num_bytes(rows, dim) * 2 == fp32
    assert make_codec("fp16").num_bytes(rows, dim) == fp32 // 2 + 4
    assert make_codec("int8").num_bytes(rows, dim) == rows * (dim + 8)


def test_fp16_refuses_non_finite_values():
    with pytest.raises(ValueError, match="non-finite"):
        make_codec("fp16").encode(torch.tensor([[1.0, float("nan")]]))


def test_config_keys_and_errors():
    cfg = load_config(None, ['embedding.comm.forward="int8"', 'embedding.comm.backward="bf16"'])
    assert cfg.embedding.comm == CommConfig("int8", "bf16") and cfg.embedding.comm.quantized
    assert not CommConfig().quantized
    with pytest.raises(ValueError, match=r"embedding.comm.forward must be one of .*'fp8'"):
        load_config(None, ['embedding.comm.forward="fp8"'])
    with pytest.raises(ValueError, match="unknown communication codec"):
        make_codec("int4")
