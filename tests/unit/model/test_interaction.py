"""DotInteraction and DCNInteraction against naive per-sample loops."""

import pytest
import torch

from neorec.model import DCNInteraction, DotInteraction


def naive_dot(dense, sparse, self_interaction):
    out = []
    for b in range(dense.shape[0]):
        vectors = [dense[b]] + [sparse[b, f] for f in range(sparse.shape[1])]
        pairs = [
            torch.dot(vectors[i], vectors[j])
            for i in range(len(vectors))
            for j in range(i if self_interaction else i + 1, len(vectors))
        ]
        out.append(torch.cat([dense[b], torch.stack(pairs) if pairs else dense.new_zeros(0)]))
    return torch.stack(out)


@pytest.mark.parametrize("kernel", ["torch", "native"])
@pytest.mark.parametrize("self_interaction", [False, True])
@pytest.mark.parametrize("num_features", [0, 1, 4])
def test_dot_matches_naive_loop(num_features, self_interaction, kernel):
    torch.manual_seed(0)
    batch, dim = 5, 3
    dense, sparse = torch.randn(batch, dim), torch.randn(batch, num_features, dim)
    layer = DotInteraction(num_features, self_interaction=self_interaction, embedding_dim=dim, kernel=kernel)
    out = layer(dense, sparse)
    n = num_features + 1
    num_pairs = n * (n + 1) // 2 if self_interaction else n * (n - 1) // 2
    assert out.shape == (batch, dim + num_pairs) and layer.output_dim == dim + num_pairs
    torch.testing.assert_close(out, naive_dot(dense, sparse, self_interaction))


@pytest.mark.parametrize("self_interaction", [False, True])
def test_dot_gradient_matches_naive_loop(self_interaction):
    torch.manual_seed(1)
    batch, dim, num_features = 4, 3, 5
    dense, sparse = torch.randn(batch, dim, dtype=torch.float64), torch.randn(batch, num_features, dim,
                                                                               dtype=torch.float64)
    layer = DotInteraction(num_features, self_interaction=self_interaction, embedding_dim=dim)
    upstream = torch.randn(batch, layer.output_dim, dtype=torch.float64)
    grads = []
    for fn in (layer, lambda d, s: naive_dot(d, s, self_interaction)):
        d, s = dense.clone().requires_grad_(), sparse.clone().requires_grad_()
        (fn(d, s) * upstream).sum().backward()
        grads.append((d.grad, s.grad))
    torch.testing.assert_close(grads[0], grads[1])
    torch.autograd.gradcheck(lambda d, s: layer(d, s), (dense.clone().requires_grad_(),
                                                         sparse.clone().requires_grad_()))


# 16 / 64: widths compiled as constants; 64 / 96: multiples of 32, the AVX2 backward (two rows at
# a time: an odd and an even number of vectors n = F + 1); 3 / 40: the plain loops
@pytest.mark.parametrize("dim", [3, 16, 64, 40, 96])
@pytest.mark.parametrize("num_features", [5, 6])
@pytest.mark.parametrize("self_interaction", [False, True])
def test_native_dot_forward_and_gradients_match_naive_loop(dim, num_features, self_interaction):
    """The C kernel (fp32) on a batch large enough to be split over threads, with the sparse
    vectors taken from a wider [B, F * D] tensor (a view, as the DLRM passes them)."""
    generator = torch.Generator().manual_seed(2)
    batch = 300
    dense = torch.randn(batch, dim, generator=generator, requires_grad=True)
    pooled = torch.randn(batch, num_features * dim, generator=generator, requires_grad=True)
    layer = DotInteraction(num_features, self_interaction=self_interaction, embedding_dim=dim, kernel="native")
    out = layer(dense, pooled.view(batch, num_features, dim))
    expected = naive_dot(dense, pooled.view(batch, num_features, dim), self_interaction)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    upstream = torch.randn(out.shape, generator=generator)
    mine = torch.autograd.grad(out, (dense, pooled), upstream)
    reference = torch.autograd.grad(expected, (dense, pooled), upstream)
    for a, b in zip(mine, reference):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    again = torch.autograd.grad(layer(dense, pooled.view(batch, num_features, dim)), (dense, pooled), upstream)
    assert all(torch.equal(a, b) for a, b in zip(mine, again))  # deterministic
    padded = torch.zeros(batch, out.shape[1] + 5)  # an upstream gradient with padded rows (AlignedLinear's)
    padded[:, : out.shape[1]] = upstream
    strided_grad = torch.autograd.grad(layer(dense, pooled.view(batch, num_features, dim)), (dense, pooled),
                                       padded[:, : out.shape[1]])
    assert all(torch.equal(a, b) for a, b in zip(mine, strided_grad))
    strided = torch.randn(num_features, batch, dim, generator=generator).transpose(0, 1)  # not contiguous
    torch.testing.assert_close(layer(dense, strided), naive_dot(dense, strided, self_interaction),
                               rtol=1e-5, atol=1e-5)


def test_dot_kernel_choice():
    dense64, sparse64 = torch.randn(2, 4, dtype=torch.float64), torch.randn(2, 3, 4, dtype=torch.float64)
    auto = DotInteraction(3, embedding_dim=4)
    assert auto(dense64, sparse64).dtype == torch.float64  # batched matmuls for what the kernel lacks
    with pytest.raises(ValueError, match="kernel='native' was asked for but the native interaction takes fp32"):
        DotInteraction(3, embedding_dim=4, kernel="native")(dense64, sparse64)
    with pytest.raises(ValueError, match="kernel must be one of"):
        DotInteraction(3, kernel="c")


def test_dot_index_buffer_moves_with_module_but_is_not_checkpointed():
    layer = DotInteraction(3)
    assert "flat_pair_index" in dict(layer.named_buffers())
    assert layer.state_dict() == {}


def test_dot_shape_errors():
    layer = DotInteraction(2)
    with pytest.raises(ValueError, match=r"\[B, F, D\]"):
        layer(torch.randn(4, 3), torch.randn(4, 3, 3))
    with pytest.raises(ValueError, match="embedding_dim"):
        layer.output_dim


def naive_dcn(layer, x0):
    out = []
    for b in range(x0.shape[0]):
        x = x0[b]
        for cross in layer.cross:
            if layer.low_rank:
                down, up = cross[0], cross[1]
                weight, bias = up.weight @ down.weight, up.bias  # W = U V^T
            else:
                weight, bias = cross.weight, cross.bias
            x = x0[b] * (weight @ x + bias) + x
        out.append(x)
    return torch.stack(out)


@pytest.mark.parametrize("low_rank", [0, 2])
@pytest.mark.parametrize("num_layers", [0, 1, 3])
def test_dcn_matches_naive_loop(num_layers, low_rank):
    torch.manual_seed(1)
    dense, sparse = torch.randn(4, 3), torch.randn(4, 2, 5)  # flattened: 3 + 10 features
    layer = DCNInteraction(13, num_layers, low_rank=low_rank)
    assert layer.output_dim == 13
    out = layer(dense, sparse)
    torch.testing.assert_close(out, naive_dcn(layer, torch.cat([dense, sparse.flatten(1)], 1)))
    torch.testing.assert_close(layer(dense, sparse.flatten(1)), out)  # 2-D sparse input too
    if low_rank:
        assert all(c[0].weight.shape == (low_rank, 13) and c[0].bias is None for c in layer.cross)


def test_dcn_errors():
    with pytest.raises(ValueError, match="low_rank"):
        DCNInteraction(8, 2, low_rank=-1)
    with pytest.raises(ValueError, match="input_dim=8"):
        DCNInteraction(8, 1)(torch.randn(2, 3), torch.randn(2, 4))
