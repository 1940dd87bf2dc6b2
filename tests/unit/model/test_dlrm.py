"""DLRM end to end on a per-feature nn.EmbeddingBag sparse arch (see conftest.py)."""

import math

import pytest
import torch
import torch.nn.functional as F

from neorec.model import DLRM, DenseArch, OverArch, dense_named_parameters, dense_parameters
from neorec.sparse.jagged import KeyedJaggedTensor

TABLES = {"user": (20, 4), "item": (30, 4), "genre": (5, 4)}


def make_model(sparse_arch_factory, tables=TABLES, **kwargs):
    kwargs.setdefault("dense_layers", [8, 4])
    kwargs.setdefault("over_layers", [8])
    dims = {k: d for k, (_, d) in tables.items()}
    return DLRM(sparse_arch_factory(tables), num_dense=3, embedding_dims=dims, **kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"self_interaction": True}, {"interaction": "dcn"}, {"interaction": "dcn", "dcn_low_rank": 2}],
)
def test_forward_shape(sparse_arch_factory, kjt_factory, kwargs):
    torch.manual_seed(0)
    model = make_model(sparse_arch_factory, **kwargs)
    logits = model(torch.randn(6, 3), kjt_factory(TABLES, 6))
    assert logits.shape == (6,) and logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_over_arch_input_width(sparse_arch_factory):
    dot = make_model(sparse_arch_factory)
    assert dot.over_arch.mlp[0].in_features == 4 + 4 * 3 // 2  # D + (F+1)F/2 with F=3
    dcn = make_model(sparse_arch_factory, interaction="dcn")
    assert dcn.over_arch.mlp[0].in_features == 4 + 3 * 4


def test_dot_rejects_mismatched_dims_naming_features(sparse_arch_factory):
    tables = {"user": (20, 4), "item": (30, 6), "genre": (5, 8)}
    with pytest.raises(ValueError, match=r"'item': 6.*'genre': 8") as err:
        make_model(sparse_arch_factory, tables)
    assert "dense_layers[-1]=4" in str(err.value) and "'user'" not in str(err.value)
    model = make_model(sparse_arch_factory, tables, interaction="dcn")  # DCN takes any dims
    assert model.interaction.output_dim == 4 + 18


def test_argument_errors(sparse_arch_factory, kjt_factory):
    with pytest.raises(ValueError, match="allowed"):
        make_model(sparse_arch_factory, interaction="cat")
    with pytest.raises(ValueError, match="self_interaction"):
        make_model(sparse_arch_factory, interaction="dcn", self_interaction=True)
    with pytest.raises(ValueError, match="layer_sizes is empty"):
        make_model(sparse_arch_factory, dense_layers=[])
    model = make_model(sparse_arch_factory)
    with pytest.raises(ValueError, match=r"dense must be \[B, 3\]"):
        model(torch.randn(2, 5), kjt_factory(TABLES, 2))
    with pytest.raises(ValueError, match="dense has 3 rows but the sparse KeyedJaggedTensor has batch_size=2"):
        model(torch.randn(3, 3), kjt_factory(TABLES, 2))


class _SparseArchOutputBatch(torch.nn.Module):
    """Wraps a sparse arch and keeps only the first ``rows`` rows of its output (a faulty arch)."""

    def __init__(self, inner, rows):
        super().__init__()
        self.inner, self.rows = inner, rows

    def forward(self, kjt):
        from neorec.sparse.keyed import KeyedTensor

        out = self.inner(kjt)
        return KeyedTensor(out.keys, out.length_per_key, out.values[: self.rows])


def test_input_errors_are_caught_at_entry_before_the_sparse_arch_runs(sparse_arch_factory, kjt_factory):
    model = make_model(sparse_arch_factory)
    calls = []
    model.sparse_arch.register_forward_pre_hook(lambda *_: calls.append("sparse"))
    kjt = kjt_factory(TABLES, 3)
    for dtype in (torch.float64, torch.int64, torch.float16):
        with pytest.raises(ValueError, match=rf"DLRM: dense must be torch.float32 .*got {dtype}"):
            model(torch.ones(3, 3, dtype=dtype), kjt)
    with pytest.raises(ValueError, match=r"dense has 4 rows but the sparse KeyedJaggedTensor has batch_size=3"):
        model(torch.randn(4, 3), kjt)
    assert calls == []
    assert model(torch.randn(3, 3), kjt).shape == (3,) and calls == ["sparse"]
    # a model converted to float64 expects float64 dense features
    model64 = make_model(sparse_arch_factory).double()
    assert model64(torch.randn(3, 3, dtype=torch.float64), kjt).dtype == torch.float64
    with pytest.raises(ValueError, match=r"dense must be torch.float64 .*got torch.float32"):
        model64(torch.randn(3, 3), kjt)
    # a sparse arch that returns the wrong batch is still blamed as such
    faulty = make_model(lambda tables: _SparseArchOutputBatch(sparse_arch_factory(tables), 2))
    with pytest.raises(ValueError, match=r"sparse_arch returned \[B=2\].*expected B=3"):
        faulty(torch.randn(3, 3), kjt)


def test_embedding_dims_forms_and_key_reordering(sparse_arch_factory, kjt_factory):
    torch.manual_seed(0)
    arch = sparse_arch_factory(TABLES)
    dense, kjt = torch.randn(4, 3), kjt_factory(TABLES, 4)
    outputs = []
    for dims in ([4, 4, 4], list(zip(TABLES, [4, 4, 4])), dict(zip(TABLES, [4, 4, 4])), arch(kjt)):
        torch.manual_seed(1)
        outputs.append(DLRM(arch, 3, dims, [8, 4], [8])(dense, kjt))
    for out in outputs[1:]:
        torch.testing.assert_close(out, outputs[0])
    # A model that names its features in another order gets the columns in its own order.
    torch.manual_seed(1)
    reordered = DLRM(arch, 3, {"genre": 4, "user": 4, "item": 4}, [8, 4], [8])
    pooled = arch(kjt)
    expected = torch.cat([pooled["genre"], pooled["user"], pooled["item"]], 1)
    torch.testing.assert_close(reordered._sparse_values(pooled, 4), expected)
    with pytest.raises(ValueError, match="returned features"):
        DLRM(arch, 3, {"user": 4, "item": 4, "age": 4}, [8, 4], [8])(dense, kjt)


def test_no_dense_features(sparse_arch_factory, kjt_factory):
    model = DLRM(sparse_arch_factory(TABLES), 0, [4, 4, 4], [4], [])
    assert model(torch.zeros(5, 0), kjt_factory(TABLES, 5)).shape == (5,)


def test_gradients_reach_dense_params_and_embeddings(sparse_arch_factory, kjt_factory):
    torch.manual_seed(0)
    for interaction in ("dot", "dcn"):
        # Linear over arch: no dead ReLU can zero a sample's gradient.
        model = make_model(sparse_arch_factory, interaction=interaction, over_layers=[])
        kjt = kjt_factory(TABLES, 8, max_ids=2)
        model(torch.randn(8, 3), kjt).sum().backward()
        for name, p in dense_named_parameters(model):
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        for key, bag in model.sparse_arch.bags.items():
            used = kjt[key].values.unique()
            grad_rows = bag.weight.grad.abs().sum(1)
            assert (grad_rows[used] > 0).all(), key
            unused = torch.ones_like(grad_rows, dtype=torch.bool)
            unused[used] = False
            assert (grad_rows[unused] == 0).all(), key


def test_dense_parameters_exclude_sparse_arch(sparse_arch_factory):
    model = make_model(sparse_arch_factory)
    dense = dense_parameters(model)
    sparse_ids = {id(p) for p in model.sparse_arch.parameters()}
    assert dense and not any(id(p) in sparse_ids for p in dense)
    assert len(dense) + len(sparse_ids) == len(list(model.parameters()))
    wrapped = torch.nn.Module()
    wrapped.module = model  # like DistributedDataParallel
    assert [id(p) for p in dense_parameters(wrapped)] == [id(p) for p in dense]
    with pytest.raises(ValueError, match="sparse_arch"):
        dense_parameters(torch.nn.Linear(2, 2))


def test_dlrm_init_is_seeded_and_scaled():
    torch.manual_seed(3)
    a = DenseArch(300, [500])
    torch.manual_seed(3)
    b = DenseArch(300, [500])
    torch.testing.assert_close(a.mlp[0].weight, b.mlp[0].weight)
    assert a.mlp[0].weight.std().item() == pytest.approx(math.sqrt(2 / 800), rel=0.02)
    assert a.mlp[0].bias.std().item() == pytest.approx(math.sqrt(1 / 500), rel=0.15)
    over = OverArch(16, [8])
    assert over.mlp[-1].out_features == 1 and isinstance(over.mlp[1], torch.nn.ReLU)
    assert not isinstance(over.mlp[-1], torch.nn.ReLU)  # logits, no activation at the end


@pytest.mark.parametrize("num_dense", [13, 0])
def test_mlps_relu_in_place_same_values_and_gradients_as_out_of_place(num_dense):
    """The MLPs' ReLUs overwrite their Linear's output; forward and every gradient are those of
    the same MLPs with out-of-place ReLUs, bit for bit (including the [B, 0] input of num_dense 0)."""
    torch.manual_seed(0)
    bottom, top = DenseArch(num_dense, [24, 16, 8]), OverArch(8 + 5, [24, 16])
    relus = [m for m in list(bottom.modules()) + list(top.modules()) if isinstance(m, torch.nn.ReLU)]
    assert len(relus) == 5 and all(m.inplace for m in relus)
    dense, extra = torch.randn(32, num_dense), torch.randn(32, 5, requires_grad=True)

    def run():
        out = top(torch.cat([bottom(dense), extra], dim=1))
        params = list(bottom.parameters()) + list(top.parameters()) + [extra]
        return [out.detach()] + list(torch.autograd.grad(out.square().sum(), params))

    in_place = run()
    for m in relus:
        m.inplace = False
    out_of_place = run()
    assert all(torch.equal(a, b) for a, b in zip(in_place, out_of_place))
    assert in_place[0].abs().sum() > 0 and in_place[2].abs().sum() > 0  # not vacuous (bottom bias grad)


@pytest.mark.parametrize("interaction", ["dot", "dcn"])
def test_trains_on_learnable_problem(sparse_arch_factory, interaction):
    torch.manual_seed(0)
    n = 256
    ids = {k: torch.randint(0, rows, (n,)) for k, (rows, _) in TABLES.items()}
    score = {k: torch.randn(rows) for k, (rows, _) in TABLES.items()}
    dense = torch.randn(n, 3)
    logit = sum(score[k][ids[k]] for k in TABLES) + dense[:, 0]
    labels = (logit > 0).float()
    kjt = KeyedJaggedTensor(list(TABLES), torch.cat(list(ids.values())), torch.ones(len(TABLES) * n, dtype=torch.long))
    model = make_model(sparse_arch_factory, interaction=interaction)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    losses = []
    for _ in range(80):
        loss = F.binary_cross_entropy_with_logits(model(dense, kjt), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses[::10]


def test_sparse_arch_exchange_in_flight_while_bottom_mlp_runs(sparse_arch_factory, kjt_factory):
    """A sparse arch with ``forward_awaitable`` (the sharded collection) is launched before the
    bottom MLP and waited for after it; the logits equal those of its blocking forward."""
    from neorec.sharding.comm import Awaitable

    events = []

    class Launching(sparse_arch_factory):
        def forward_awaitable(self, kjt):
            events.append("launch")
            return Awaitable([], lambda: events.append("wait") or self.forward(kjt))

    torch.manual_seed(0)
    model = make_model(Launching)
    model.dense_arch.register_forward_hook(lambda *_: events.append("bottom mlp"))
    dense, kjt = torch.randn(6, 3), kjt_factory(TABLES, 6)
    logits = model(dense, kjt)
    assert events == ["launch", "bottom mlp", "wait"]
    blocking = make_model(sparse_arch_factory)
    blocking.load_state_dict(model.state_dict())
    assert torch.equal(logits, blocking(dense, kjt))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_dense_parts_converted_to_another_dtype_take_the_pooled_rows_in_it(sparse_arch_factory, kjt_factory, dtype):
    """The pooled rows are fp32: with the dense parts in bf16 the interaction promoted back to fp32 and
    the over-arch raised "mat1 and mat2 must have the same dtype"."""
    torch.manual_seed(0)
    for interaction in ("dot", "dcn"):
        model = make_model(sparse_arch_factory, interaction=interaction, over_layers=[])
        for part in (model.dense_arch, model.interaction, model.over_arch):
            part.to(dtype)
        kjt = kjt_factory(TABLES, 8, max_ids=2)
        logits = model(torch.randn(8, 3, dtype=dtype), kjt)
        assert logits.dtype == dtype and logits.shape == (8,)
        logits.float().sum().backward()
        for key, bag in model.sparse_arch.bags.items():  # the gradient reaches the fp32 embeddings
            assert bag.weight.grad is not None and bag.weight.grad.abs().sum() > 0, key


def test_layer_widths_must_be_integers():
    """DenseArch(3, [8.7]) built a layer of width 8 without a word."""
    with pytest.raises(TypeError, match=r"layer widths must be integers, got \[8.7\]"):
        DenseArch(3, [8.7])
    with pytest.raises(TypeError, match=r"layer widths must be integers, got \[True\]"):
        OverArch(4, [True])
    assert DenseArch(3, [torch.tensor(8).item()]).output_dim == 8
