"""``AlignedLinear`` (neorec/model/aligned_linear.py): nn.Linear with the backward products on an
input width padded to a multiple of 8.

    python -m pytest tests/unit/model/test_aligned_linear.py -q
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from neorec.model.aligned_linear import AlignedLinear


@pytest.mark.parametrize("in_features", [13, 415, 5, 16])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("input_grad", [True, False])
def test_matches_nn_linear_forward_and_gradients(in_features, bias, input_grad):
    generator = torch.Generator().manual_seed(in_features)
    layer = AlignedLinear(in_features, 24, bias=bias)
    plain = nn.Linear(in_features, 24, bias=bias)
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(40, in_features + 2, generator=generator)[:, 1:-1]  # strided rows
    x.requires_grad_(input_grad)
    out, expected = layer(x), plain(x)
    aligned = in_features % 8 != 0
    assert (type(out.grad_fn).__name__ == "_AlignedLinearFunctionBackward") == aligned
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    upstream = torch.randn(out.shape, generator=generator)
    wrt = [t for t in (x, layer.weight, layer.bias) if t is not None and t.requires_grad]
    wrt_plain = [t for t in (x, plain.weight, plain.bias) if t is not None and t.requires_grad]
    mine = torch.autograd.grad(out, wrt, upstream)
    reference = torch.autograd.grad(expected, wrt_plain, upstream)
    for a, b in zip(mine, reference):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    again = torch.autograd.grad(layer(x), wrt, upstream)
    assert all(torch.equal(a, b) for a, b in zip(mine, again))  # deterministic


def test_is_an_nn_linear_with_the_same_state_and_plain_path_elsewhere():
    layer = AlignedLinear(13, 8)
    assert isinstance(layer, nn.Linear)
    assert {k: v.shape for k, v in layer.state_dict().items()} == {"weight": (8, 13), "bias": (8,)}
    x = torch.randn(4, 13)
    with torch.no_grad():  # no backward to speed up: nn.Linear's own path
        assert layer(x).grad_fn is None
    batched = layer(torch.randn(2, 3, 13))  # not 2-D: nn.Linear's path
    assert batched.shape == (2, 3, 8) and type(batched.grad_fn).__name__ != "_AlignedLinearFunctionBackward"


def test_optimizer_step_through_padded_gradients():
    """The weight gradient is a column slice of a padded product; optimizers take it as usual."""
    torch.manual_seed(0)
    layer = AlignedLinear(415, 16)
    plain = nn.Linear(415, 16)
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(32, 415)
    for module in (layer, plain):
        optimizer = torch.optim.Adagrad(module.parameters(), lr=0.1)
        for _ in range(3):
            optimizer.zero_grad()
            module(x).square().mean().backward()
            optimizer.step()
    torch.testing.assert_close(layer.weight, plain.weight, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.bias, plain.bias, rtol=1e-5, atol=1e-6)


def test_cpu_autocast_takes_nn_linears_own_path():
    """Under CPU autocast the aligned backward multiplied a bf16 gradient with fp32 weights and failed
    (a DLRM's backward under autocast raised "expected m1 and m2 to have the same dtype")."""
    torch.manual_seed(0)
    layer, reference = AlignedLinear(13, 5), nn.Linear(13, 5)
    reference.load_state_dict(layer.state_dict())
    x = torch.randn(4, 13, requires_grad=True)
    grads = []
    for module in (layer, reference):
        module.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = module(x)
        assert out.dtype == torch.bfloat16
        out.float().sum().backward()
        grads.append(module.weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1])
