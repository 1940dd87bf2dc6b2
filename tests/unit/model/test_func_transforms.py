"""torch.func transforms (grad, vmap for per-sample gradients, jacrev) and forward-mode AD through
the model's own autograd functions (AlignedLinear's padded backward, the torch dot interaction's
pair products), against nn.Linear and a naive interaction: their old form was refused by every
transform ("must override the setup_context staticmethod", "must implement the jvp function").

    python -m pytest tests/unit/model/test_func_transforms.py -q
"""

import pytest
import torch
import torch.autograd.forward_ad as forward_ad
from torch.func import functional_call, grad, jacrev, vmap

from neorec.model import DenseArch, DotInteraction
from neorec.model.aligned_linear import AlignedLinear

from test_interaction import naive_dot

CLOSE = dict(rtol=1e-5, atol=1e-6)  # the padded products may sum in another order than nn.Linear's


def arch_and_reference():
    torch.manual_seed(0)
    arch = DenseArch(13, [7, 5])  # widths 13 and 7: both layers take the aligned path
    assert isinstance(arch.mlp[0], AlignedLinear) and isinstance(arch.mlp[2], AlignedLinear)
    reference = torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.ReLU(), torch.nn.Linear(7, 5), torch.nn.ReLU())
    reference.load_state_dict({k.removeprefix("mlp."): v for k, v in arch.state_dict().items()})
    params = {k: v.detach() for k, v in arch.named_parameters()}
    return arch, reference, params


def test_grad_and_per_sample_gradients_through_aligned_linear():
    arch, reference, params = arch_and_reference()
    x = torch.randn(6, 13)
    ref_params = {k.removeprefix("mlp."): v for k, v in params.items()}

    def loss(module, p, xb):
        return functional_call(module, p, (xb,)).square().sum()

    got = grad(lambda p, xb: loss(arch, p, xb))(params, x)
    want = grad(lambda p, xb: loss(reference, p, xb))(ref_params, x)
    for name, value in got.items():
        torch.testing.assert_close(value, want[name.removeprefix("mlp.")], **CLOSE)
    per_sample = vmap(grad(lambda p, xb: loss(arch, p, xb)), in_dims=(None, 0))(params, x.unsqueeze(1))
    for i in range(x.shape[0]):  # each sample's gradient, by plain autograd on the reference
        reference.zero_grad()
        reference(x[i : i + 1]).square().sum().backward()
        for name, value in per_sample.items():
            module_param = dict(reference.named_parameters())[name.removeprefix("mlp.")]
            torch.testing.assert_close(value[i], module_param.grad, **CLOSE)


def test_jacobian_and_forward_mode_through_aligned_linear():
    arch, reference, _ = arch_and_reference()
    x = torch.randn(4, 13, dtype=torch.float32)
    torch.testing.assert_close(jacrev(arch)(x), jacrev(reference)(x), **CLOSE)
    tangent = torch.randn(4, 13)
    with forward_ad.dual_level():
        got = forward_ad.unpack_dual(arch(forward_ad.make_dual(x, tangent))).tangent
    with forward_ad.dual_level():
        want = forward_ad.unpack_dual(reference(forward_ad.make_dual(x, tangent))).tangent
    torch.testing.assert_close(got, want, **CLOSE)
    weight_tangent = torch.randn_like(arch.mlp[0].weight)  # a tangent of the weight too
    with forward_ad.dual_level():
        layer = AlignedLinear(13, 7)
        layer.load_state_dict(reference[0].state_dict())
        dual_weight = forward_ad.make_dual(layer.weight.detach(), weight_tangent)
        out = torch.func.functional_call(layer, {"weight": dual_weight, "bias": layer.bias.detach()},
                                         (forward_ad.make_dual(x, tangent),))
        got = forward_ad.unpack_dual(out).tangent
    torch.testing.assert_close(got, tangent @ layer.weight.detach().t() + x @ weight_tangent.t(), **CLOSE)


@pytest.mark.parametrize("self_interaction", [False, True])
def test_transforms_through_the_torch_dot_interaction(self_interaction):
    torch.manual_seed(2)
    layer = DotInteraction(3, self_interaction=self_interaction, embedding_dim=4, kernel="torch")
    dense, sparse = torch.randn(5, 4), torch.randn(5, 3, 4)
    for argnums in (0, 1):
        got = jacrev(layer, argnums=argnums)(dense, sparse)
        want = jacrev(lambda d, s: naive_dot(d, s, self_interaction), argnums=argnums)(dense, sparse)
        torch.testing.assert_close(got, want, **CLOSE)
    per_sample = vmap(grad(lambda d, s: layer(d, s).square().sum(), argnums=1))(dense.unsqueeze(1), sparse.unsqueeze(1))
    for b in range(5):
        s = sparse[b : b + 1].clone().requires_grad_()
        naive_dot(dense[b : b + 1], s, self_interaction).square().sum().backward()
        torch.testing.assert_close(per_sample[b], s.grad, **CLOSE)
    tangent = torch.randn_like(sparse)
    with forward_ad.dual_level():
        got = forward_ad.unpack_dual(layer(dense, forward_ad.make_dual(sparse, tangent))).tangent
    _, want = torch.func.jvp(lambda s: naive_dot(dense, s, self_interaction), (sparse,), (tangent,))
    torch.testing.assert_close(got, want, **CLOSE)
