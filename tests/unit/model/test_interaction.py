"""DotInteraction and DCNInteraction against naive per-sample loops."""

import pytest
import torch

from neorec.model import DCNInteraction, DotInteraction
from neorec.sparse.column_blocks import ColumnBlocks


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


def _column_blocks(batch, num_features, dim, generator, split_features=(1,)):
    """A [batch, F * dim] matrix as ColumnBlocks, like a 2-rank table-wise + column-wise output:
    two received parts (features dealt alternately to them, the features in ``split_features``
    cut in two column pieces, one in each part) and one replica part (a strided view, the last
    feature)."""
    from neorec.sharding.output_dist import part_runs

    owned = [[], []]  # the output columns each received part holds, in its order
    for f in range(num_features - 1):
        columns = list(range(f * dim, (f + 1) * dim))
        if f in split_features:
            owned[0] += columns[: dim // 2]
            owned[1] += columns[dim // 2 :]
        else:
            owned[f % 2] += columns
    replica = list(range((num_features - 1) * dim, num_features * dim))
    columns = owned[0] + owned[1] + replica  # received column i -> output column columns[i]
    widths = [len(owned[0]), len(owned[1])]
    flat = torch.randn(batch * sum(widths), generator=generator, requires_grad=True)
    base = torch.randn(batch, dim + 3, generator=generator, requires_grad=True)
    extra = base[:, 2 : 2 + dim]  # unit column stride, wider rows
    runs = tuple(part_runs(columns, widths + [dim]))
    return ColumnBlocks(flat, batch, tuple(widths), (extra,), runs), (flat, base)


@pytest.mark.parametrize("dim", [16, 40, 64])
@pytest.mark.parametrize("self_interaction", [False, True])
@pytest.mark.parametrize("split_features", [(1,), ()], ids=["a-vector-split-gathered", "whole-vectors-by-address"])
def test_native_dot_reads_column_blocks_in_place_with_the_same_bits(dim, self_interaction, split_features):
    """The sparse vectors given as column blocks of other tensors (a sharded collection's received
    parts): the kernel reads every vector where it lies and writes its gradient there (or, when a
    vector is split between two blocks, gathers the sample's vectors and scatters their gradients
    back); outputs and gradients equal (bit for bit) placing the blocks into one matrix and running
    the kernel."""
    from neorec.model.native_interaction import _vector_table

    generator = torch.Generator().manual_seed(4)
    batch, num_features = 300, 6
    blocks, leaves = _column_blocks(batch, num_features, dim, generator, split_features)
    # permuted blocks from all three parts, a feature cut between two of them or none
    assert {part for part, *_ in blocks.runs} == {0, 1, 2}
    assert any(t % dim for _, _, t, _ in blocks.runs) == bool(split_features)
    assert (_vector_table(blocks.parts(), blocks.runs, dim) is None) == bool(split_features)
    dense = torch.randn(batch, dim, generator=generator, requires_grad=True)
    layer = DotInteraction(num_features, self_interaction=self_interaction, embedding_dim=dim, kernel="native")
    out = layer(dense, blocks)
    expected = layer(dense, blocks.materialize().view(batch, num_features, dim))
    assert torch.equal(out, expected)
    torch.testing.assert_close(out, naive_dot(dense, blocks.materialize().view(batch, num_features, dim),
                                              self_interaction), rtol=1e-5, atol=1e-5)
    upstream = torch.randn(out.shape, generator=generator)
    mine = torch.autograd.grad(out, (dense, *leaves), upstream)
    reference = torch.autograd.grad(expected, (dense, *leaves), upstream)
    assert all(torch.equal(a, b) for a, b in zip(mine, reference))


@pytest.mark.parametrize("split_features", [(1,), ()], ids=["a-vector-split-gathered", "whole-vectors-by-address"])
def test_native_dot_column_block_gradients_do_not_follow_the_default_dtype(split_features):
    """The extra parts' gradient buffers were made in torch's default dtype: under float64 the
    kernel's fp32 writes came back as reinterpreted bits, with no error."""
    def gradients(default_dtype):
        generator = torch.Generator().manual_seed(6)
        blocks, leaves = _column_blocks(20, 4, 8, generator, split_features)
        dense = torch.randn(20, 8, generator=generator, requires_grad=True)
        out = DotInteraction(4, embedding_dim=8, kernel="native")(dense, blocks)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(default_dtype)  # (the fp32 inputs are made): the backward allocates
        try:
            return torch.autograd.grad(out.sum(), (dense, *leaves))
        finally:
            torch.set_default_dtype(previous)

    expected, got = gradients(torch.float32), gradients(torch.float64)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_dot_takes_column_blocks_on_every_path():
    generator = torch.Generator().manual_seed(5)
    blocks, leaves = _column_blocks(7, 4, 8, generator)
    dense = torch.randn(7, 8, generator=generator, requires_grad=True)
    plain = blocks.materialize().view(7, 4, 8)
    torch_layer = DotInteraction(4, embedding_dim=8, kernel="torch")  # copies the blocks together
    torch.testing.assert_close(torch_layer(dense, blocks), naive_dot(dense, plain, False), rtol=1e-5, atol=1e-5)
    (torch_layer(dense, blocks).sum() + DotInteraction(4, embedding_dim=8)(dense, blocks).sum()).backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (dense, *leaves))
    with pytest.raises(ValueError, match=r"\[B, F \* D\] = \[7, 40\]"):
        DotInteraction(5, embedding_dim=8)(dense, blocks)


def test_dot_kernel_choice():
    dense64, sparse64 = torch.randn(2, 4, dtype=torch.float64), torch.randn(2, 3, 4, dtype=torch.float64)
    auto = DotInteraction(3, embedding_dim=4)
    assert auto(dense64, sparse64).dtype == torch.float64  # batched matmuls for what the kernel lacks
    with pytest.raises(ValueError, match="kernel='native' was asked for but the native interaction takes fp32"):
        DotInteraction(3, embedding_dim=4, kernel="native")(dense64, sparse64)
    with pytest.raises(ValueError, match="kernel must be one of"):
        DotInteraction(3, kernel="c")
    # dim 0: the torch path (the kernel's memcpy of an empty tensor's NULL data is undefined behaviour)
    assert torch.equal(DotInteraction(2)(torch.randn(3, 0), torch.randn(3, 2, 0)), torch.zeros(3, 3))
    with pytest.raises(ValueError, match="kernel='native' was asked for but the native interaction takes fp32 CPU "
                                         "tensors of dims 1 to"):
        DotInteraction(2, kernel="native")(torch.randn(3, 0), torch.randn(3, 2, 0))


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


def test_a_double_backward_through_the_native_dot_is_refused_and_the_torch_one_gives_it():
    """A gradient penalty through the native kernels (C code outside autograd) had no graph: its
    term silently added nothing to the gradients (53.78 against 3141.91)."""
    torch.manual_seed(2)
    dense, sparse = torch.randn(4, 8), torch.randn(4, 3, 8)
    grads = {}
    for kernel in ("native", "torch"):
        layer = DotInteraction(3, embedding_dim=8, kernel=kernel)
        d, s = dense.clone().requires_grad_(), sparse.clone().requires_grad_()
        loss = layer(d, s).pow(2).sum()
        if kernel == "native":
            (g,) = torch.autograd.grad(loss, d, create_graph=True)
            with pytest.raises(RuntimeError, match="differentiate twice"):
                (loss + g.pow(2).sum()).backward()
            continue
        (g,) = torch.autograd.grad(loss, d, create_graph=True)
        (loss + g.pow(2).sum()).backward()
        grads[kernel] = d.grad
    reference = dense.clone().double().requires_grad_()
    s64 = sparse.double()
    loss = naive_dot(reference, s64, False).pow(2).sum()
    (g,) = torch.autograd.grad(loss, reference, create_graph=True)
    (loss + g.pow(2).sum()).backward()
    torch.testing.assert_close(grads["torch"].double(), reference.grad, rtol=1e-4, atol=1e-3)
