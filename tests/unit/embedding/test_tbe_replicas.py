"""TableBatchedEmbeddingBags with ``dense_gradient_tables``: replica tables leave the fused update,
their dense gradient goes through ``gradient_reducer`` once per backward, then the optimizer steps.

    python -m pytest tests/unit/embedding/test_tbe_replicas.py -q
"""

from __future__ import annotations

import pytest
import torch

from neorec.embedding import SparseOptimizerConfig, TableBatchedEmbeddingBags

from test_tbe_reference import make_batch, make_tables


def run(kind, replicas=(), reducer=None, steps=3, learning_rate=0.05, only_keys=None):
    tables = make_tables("mixed")
    module = TableBatchedEmbeddingBags(tables, SparseOptimizerConfig(kind, learning_rate=learning_rate),
                                       dense_gradient_tables=replicas, gradient_reducer=reducer)
    generator = torch.Generator().manual_seed(3)
    for _ in range(steps):
        kjt = make_batch(tables, 8, generator, weighted=True)
        if only_keys is not None:  # zero lengths for the other features
            lengths = kjt.lengths.view(len(kjt.keys()), 8).clone()
            keep = torch.tensor([k in only_keys for k in kjt.keys()])
            lengths[~keep] = 0
            starts = kjt.offset_per_key()
            values = torch.cat([kjt.values[starts[i]:starts[i + 1]] for i, k in enumerate(kjt.keys()) if k in only_keys])
            weights = torch.cat([kjt.weights[starts[i]:starts[i + 1]] for i, k in enumerate(kjt.keys()) if k in only_keys])
            kjt = type(kjt)(kjt.keys(), values, lengths.reshape(-1), weights)
        grad = torch.randn(8, sum(module.feature_dims), generator=generator)
        module(kjt).values.backward(grad)
    return module


@pytest.mark.parametrize("kind", ["sgd", "rowwise_adagrad", "adagrad"])
def test_replica_tables_without_reducer_match_the_fused_update(kind):
    plain = run(kind)
    replicated = run(kind, replicas=["t8a", "t4"])
    for table in make_tables("mixed"):
        torch.testing.assert_close(replicated.get_table_weight(table.name), plain.get_table_weight(table.name),
                                   rtol=1e-6, atol=1e-7)
    assert replicated.step_count == plain.step_count == 3


def test_reducer_sees_every_backward_and_scales_the_gradient():
    calls = []

    def halve(grad):
        calls.append(grad.numel())
        grad.mul_(0.5)

    halved = run("sgd", replicas=["t16"], reducer=halve)
    reference = run("sgd")
    slow = run("sgd", learning_rate=0.025)
    assert calls == [29 * 16 + 29] * 3  # the gradient, then one look-up count per row
    torch.testing.assert_close(halved.get_table_weight("t16"), slow.get_table_weight("t16"))
    torch.testing.assert_close(halved.get_table_weight("t4"), reference.get_table_weight("t4"))

    # no id of the replica table in a batch: the reducer still runs (collectives stay matched)
    calls.clear()
    untouched = run("sgd", replicas=["t16"], reducer=halve, only_keys={"f_b"})
    assert calls == [29 * 16 + 29] * 3  # the gradient, then one look-up count per row
    fresh = TableBatchedEmbeddingBags(make_tables("mixed"), SparseOptimizerConfig("sgd"))
    torch.testing.assert_close(untouched.get_table_weight("t16"), fresh.get_table_weight("t16"))


def test_replica_errors():
    with pytest.raises(ValueError, match="no tables named"):
        TableBatchedEmbeddingBags(make_tables("sum"), SparseOptimizerConfig("sgd"), dense_gradient_tables=["nope"])
    with pytest.raises(ValueError, match="dense_gradient=True"):
        TableBatchedEmbeddingBags(make_tables("sum"), SparseOptimizerConfig("sgd"), dense_gradient=True,
                                  dense_gradient_tables=["t4"])


@pytest.mark.parametrize("kind, extra", [("adam", {}), ("sgd", {"weight_decay": 0.01}),
                                         ("rowwise_adagrad", {"weight_decay": 0.01})])
def test_looked_up_rows_with_a_zero_gradient_step_like_the_fused_update(kind, extra):
    """A row looked up whose gradient sums to exactly zero (here: every value weighted 0) still
    takes its optimizer step in the fused update (weight decay, Adam's moments): replica tables,
    reduced or not, and the dense-gradient mode do the same."""
    tables = make_tables("mixed")
    config = SparseOptimizerConfig(kind, learning_rate=0.05, **extra)
    fused = TableBatchedEmbeddingBags(tables, config)
    replicated = TableBatchedEmbeddingBags(tables, config, dense_gradient_tables=["t8a", "t4"],
                                           gradient_reducer=lambda grad: grad.mul_(1.0))
    dense = TableBatchedEmbeddingBags(tables, config, dense_gradient=True)
    generator = torch.Generator().manual_seed(5)
    for step in range(4):
        kjt = make_batch(tables, 8, generator, weighted=True)
        if step % 2:  # zero weights on half of the values: rows seen only through them get a zero gradient
            kjt = type(kjt)(kjt.keys(), kjt.values, kjt.lengths, kjt.weights * (torch.arange(kjt.values.numel()) % 2))
        grad = torch.randn(8, sum(fused.feature_dims), generator=generator)
        for module in (fused, replicated, dense):
            module(kjt).values.backward(grad)
        dense.apply_dense_gradients()
    for table in tables:
        want = fused.get_table_weight(table.name)
        torch.testing.assert_close(replicated.get_table_weight(table.name), want, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(dense.get_table_weight(table.name), want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_replicas_stay_equal_across_ranks_with_stochastic_rounding(precision):
    """Two "ranks": different batches (so their own shards round different numbers of rows), the
    same all-reduced replica gradient. The replicas drew their rounding noise from the shards'
    generator, so the copies of one table drifted apart rank by rank (fp16 ~1e-3 after 6 steps)."""
    from neorec.embedding import StorageConfig

    tables = make_tables("mixed")
    rows = 29 * 16 + 29  # t16's gradient, then its look-up counts
    global_grads = [torch.randn(rows, generator=torch.Generator().manual_seed(step)) for step in range(6)]
    for grad in global_grads:
        grad[29 * 16:] = 1.0  # every row looked up somewhere

    def rank(seed):
        calls = iter(global_grads)
        module = TableBatchedEmbeddingBags(tables, SparseOptimizerConfig("rowwise_adagrad", learning_rate=0.5),
                                           StorageConfig(precision, seed=7), dense_gradient_tables=["t16"],
                                           gradient_reducer=lambda grad: grad.copy_(next(calls)))
        generator = torch.Generator().manual_seed(seed)
        for _ in range(6):
            kjt = make_batch(tables, 8, generator, weighted=False)
            module(kjt).values.backward(torch.randn(8, sum(module.feature_dims), generator=generator))
        return module

    first, second = rank(1), rank(2)
    assert not torch.equal(first.get_table_weight("t4"), second.get_table_weight("t4"))  # own shards differ
    assert torch.equal(first.get_table_weight("t16"), second.get_table_weight("t16"))
    state = first.state_dict()
    assert torch.equal(state["replica_rounding_rng_state"], second.state_dict()["replica_rounding_rng_state"])
    assert not torch.equal(state["rounding_rng_state"], state["replica_rounding_rng_state"])


def test_replicas_with_stochastic_rounding_need_a_fixed_seed():
    from neorec.embedding import StorageConfig

    with pytest.raises(ValueError, match="need a fixed storage seed"):
        TableBatchedEmbeddingBags(make_tables("sum"), SparseOptimizerConfig("sgd"), StorageConfig("fp16", seed=None),
                                  dense_gradient_tables=["t4"])
