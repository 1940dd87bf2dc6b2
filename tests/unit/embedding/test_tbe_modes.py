"""TableBatchedEmbeddingBags: determinism, dense-gradient mode, layout, errors, state, memory.

    python -m pytest tests/unit/embedding/test_tbe_modes.py -q
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import neorec.embedding.tbe as tbe_module
from neorec.embedding import (
    EmbeddingBagCollection,
    SparseOptimizerConfig,
    StorageConfig,
    TableBatchedEmbeddingBags,
    TableConfig,
)
from neorec.sparse import KeyedJaggedTensor

from test_tbe_reference import KINDS, make_batch, make_tables


def train(kind: str, precision: str, dense_gradient: bool = False, steps: int = 3, seed: int = 0,
          kernel: str = "auto"):
    tables = make_tables("mixed")
    config = SparseOptimizerConfig(kind, learning_rate=0.05, weight_decay=0.01)
    fused = TableBatchedEmbeddingBags(tables, config, StorageConfig(precision, seed=5), dense_gradient=dense_gradient,
                                      kernel=kernel)
    generator = torch.Generator().manual_seed(seed)
    outputs = []
    for _ in range(steps):
        kjt = make_batch(tables, 8, generator, weighted=True)
        grad = torch.randn(8, sum(fused.feature_dims), generator=generator)
        out = fused(kjt).values
        outputs.append(out.detach().clone())
        out.backward(grad)
        if dense_gradient:
            fused.apply_dense_gradients()
    return fused, outputs


def assert_same_bits(a: TableBatchedEmbeddingBags, b: TableBatchedEmbeddingBags) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


@pytest.mark.parametrize("kernel", ["torch", "auto"])  # auto: the native kernels where they serve
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_two_identical_runs_give_identical_bits(kind, precision, kernel, monkeypatch):
    monkeypatch.setattr(tbe_module, "_CHUNK_BYTES", 100)
    first, out1 = train(kind, precision, kernel=kernel)
    second, out2 = train(kind, precision, kernel=kernel)
    assert_same_bits(first, second)
    assert all(torch.equal(x, y) for x, y in zip(out1, out2))
    assert first.step_count == 3
    untrained = TableBatchedEmbeddingBags(make_tables("mixed"), SparseOptimizerConfig(kind))
    assert not torch.equal(first.weights.float(), untrained.weights.float())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_dense_gradient_mode_equals_fused_mode(kind, precision, monkeypatch):
    """The dense-gradient mode (torch ops) does the torch path's fused arithmetic, bit for bit."""
    monkeypatch.setattr(tbe_module, "_CHUNK_BYTES", 100)
    fused, out_fused = train(kind, precision, kernel="torch")
    dense, out_dense = train(kind, precision, dense_gradient=True)
    assert all(torch.equal(x, y) for x, y in zip(out_fused, out_dense))
    assert dense.dense_grad is not None and not dense.dense_grad.any()
    state_fused, state_dense = fused.state_dict(), dense.state_dict()
    for key in state_fused:
        assert torch.equal(state_fused[key], state_dense[key]), key


def test_dense_gradient_mode_accumulates_until_applied():
    tables = [TableConfig("t", 6, 2)]
    dense = TableBatchedEmbeddingBags(tables, SparseOptimizerConfig("sgd", learning_rate=1.0), dense_gradient=True)
    before = dense.get_table_weight("t")
    kjt = KeyedJaggedTensor(["t"], torch.tensor([4, 4, 1]), torch.tensor([2, 1]))
    for _ in range(2):
        dense(kjt).values.sum().backward()
    assert torch.equal(dense.get_table_weight("t"), before) and dense.step_count == 0
    grad = dense.dense_grad.view(6, 2)
    assert torch.equal(grad[4], torch.full((2,), 4.0)) and torch.equal(grad[1], torch.full((2,), 2.0))
    dense.apply_dense_gradients()
    after = dense.get_table_weight("t")
    torch.testing.assert_close(after[4], before[4] - 4.0)
    torch.testing.assert_close(after[1], before[1] - 2.0)
    assert torch.equal(after[[0, 2, 3, 5]], before[[0, 2, 3, 5]]) and dense.step_count == 1
    with pytest.raises(ValueError, match="dense_gradient=True"):
        TableBatchedEmbeddingBags(tables, SparseOptimizerConfig()).apply_dense_gradients()


def test_layout_is_sorted_by_dim_and_contiguous_per_group():
    fused = TableBatchedEmbeddingBags(make_tables("sum"), SparseOptimizerConfig(), StorageConfig("fp16"))
    # tables: t8a (13x8), t4 (7x4), t16 (29x16), t8b (5x8) -> storage order t4, t8a, t8b, t16
    assert fused.table_dims == [8, 4, 16, 8] and fused.table_rows == [13, 7, 29, 5]
    assert fused.table_offsets == [28, 0, 28 + 104 + 40, 28 + 104]
    assert fused.table_row_offset_in_group == [0, 0, 0, 13]
    assert fused.table_row_offsets == [7, 0, 25, 20]
    assert fused.weights.dtype == torch.float16 and fused.weights.shape == (28 + 104 + 40 + 29 * 16,)
    assert fused.momentum1.shape == (7 + 13 + 5 + 29,)
    group8 = fused.groups[1]
    assert (group8.dim, group8.num_rows, group8.element_start) == (8, 18, 28)
    view = fused.group_weights(group8)
    assert torch.equal(view[13:].float(), fused.get_table_weight("t8b"))
    new = torch.randn(5, 8)
    fused.set_table_weight("t8b", new)
    assert torch.equal(fused.get_table_weight("t8b"), new.half().float())
    first = TableBatchedEmbeddingBags(make_tables("sum"), SparseOptimizerConfig(), init_seed=1)
    again = TableBatchedEmbeddingBags(make_tables("sum"), SparseOptimizerConfig(), init_seed=1)
    assert torch.equal(first.weights, again.weights)
    bound = (1 / 29) ** 0.5
    t16 = first.get_table_weight("t16")
    assert t16.abs().max() <= bound and t16.std() > bound / 3


@pytest.mark.filterwarnings("ignore::neorec.embedding.path_common.SecondLookupWarning")  # (two lookups, on purpose)
def test_out_of_range_and_negative_ids_are_rejected():
    fused = TableBatchedEmbeddingBags(make_tables("sum"), SparseOptimizerConfig())
    keys = ["f_a1", "f_a2", "f_b", "f_c", "f_d"]
    lengths = torch.tensor([1, 0, 1, 0, 1, 0, 1, 0, 1, 0])
    good = torch.tensor([12, 12, 6, 28, 4])
    for position, bad_id, feature, table, rows in [(3, 29, "f_c", "t16", 29), (4, -1, "f_d", "t8b", 5), (0, 13, "f_a1", "t8a", 13)]:
        values = good.clone()
        values[position] = bad_id
        with pytest.raises(ValueError) as info:
            fused(KeyedJaggedTensor(keys, values, lengths))
        message = str(info.value)
        assert f"'{feature}'" in message and f"'{table}'" in message and str(bad_id) in message
        assert f"[0, {rows})" in message
    fused(KeyedJaggedTensor(keys, good, lengths))  # the boundary ids are fine
    shared = TableBatchedEmbeddingBags([TableConfig("x", 10, 4, ["p", "q"]), TableConfig("y", 10, 4)],
                                       SparseOptimizerConfig())  # one bound for the whole group
    for values, feature in [([1, 2, 10, 0], "q"), ([1, -3, 2, 0], "p"), ([1, 2, 3, 11], "y")]:
        with pytest.raises(ValueError, match=f"feature '{feature}'.*outside the table's rows \\[0, 10\\)"):
            shared(KeyedJaggedTensor(["p", "q", "y"], torch.tensor(values), torch.tensor([1, 1, 1, 0, 0, 1])))


def test_missing_feature_and_bad_tables_are_rejected():
    fused = TableBatchedEmbeddingBags(make_tables("sum"), SparseOptimizerConfig())
    kjt = KeyedJaggedTensor(["f_a1", "f_b"], torch.tensor([1, 2]), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="lacks features.*f_a2.*expected"):
        fused(kjt)
    with pytest.raises(TypeError, match="KeyedJaggedTensor"):
        fused(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="appears more than once"):
        EmbeddingBagCollection([TableConfig("a", 3, 2), TableConfig("a", 4, 2)])
    with pytest.raises(ValueError, match="also in table 'a'"):
        EmbeddingBagCollection([TableConfig("a", 3, 2, ["x"]), TableConfig("b", 4, 2, ["x"])])
    with pytest.raises(TypeError, match="list of TableConfig"):
        EmbeddingBagCollection(TableConfig("a", 3, 2))
    with pytest.raises(ValueError, match="no table named"):
        fused.get_table_weight("nope")


@pytest.mark.filterwarnings("ignore::neorec.embedding.path_common.SecondLookupWarning")  # (two lookups, on purpose)
def test_collection_exposes_features_and_matches_its_tbe():
    tables = make_tables("mixed")
    collection = EmbeddingBagCollection(tables, SparseOptimizerConfig("adagrad"), init_seed=4)
    assert collection.feature_names == ["f_a1", "f_a2", "f_b", "f_c", "f_d"]
    assert collection.embedding_dims == [8, 8, 4, 16, 8]
    assert collection.tables == tables and collection.total_dim == 44
    kjt = make_batch(tables, 5, torch.Generator().manual_seed(1), weighted=False)
    out = collection(kjt)
    assert torch.equal(out.values, collection.tbe(kjt).values)
    assert set(collection.state_dict()) == {"tbe.weights", "tbe.momentum1", "tbe.step", "tbe.table_layout"}


def test_state_dict_round_trip_resumes_bit_for_bit():
    first, _ = train("rowwise_adagrad", "bf16", steps=2)
    copy = TableBatchedEmbeddingBags(make_tables("mixed"), SparseOptimizerConfig("rowwise_adagrad", 0.05, weight_decay=0.01),
                                     StorageConfig("bf16", seed=99))
    copy.load_state_dict(first.state_dict())
    assert copy.step_count == 2
    kjt = make_batch(make_tables("mixed"), 8, torch.Generator().manual_seed(9), weighted=True)
    for module in (first, copy):
        module(kjt).values.sum().backward()
    assert_same_bits(first, copy)


class _LargeAllocationWatch(TorchDispatchMode):
    """Records every op output with at least ``limit`` elements that is not a view of ``allowed``."""

    def __init__(self, limit, allowed):
        super().__init__()
        self.limit, self.allowed, self.seen = limit, {t.untyped_storage().data_ptr() for t in allowed}, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.numel() >= self.limit and t.untyped_storage().data_ptr() not in self.allowed:
                self.seen.append((str(func), tuple(t.shape)))
        return out


@pytest.mark.parametrize("kind,precision", [("rowwise_adagrad", "fp32"), ("adam", "bf16")])
def test_backward_allocates_nothing_of_table_size(kind, precision):
    rows, dim = 200_000, 16
    tables = [TableConfig("big", rows, dim, ["u", "v"], pooling="mean"), TableConfig("small", 10, 4)]
    fused = TableBatchedEmbeddingBags(tables, SparseOptimizerConfig(kind), StorageConfig(precision))
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 20, (3 * 256,), generator=generator)
    values = torch.cat([torch.randint(0, n, (int(lengths[i * 256 : (i + 1) * 256].sum()),), generator=generator)
                        for i, n in enumerate([rows, rows, 10])])
    out = fused(KeyedJaggedTensor(["u", "v", "small"], values, lengths)).values
    before = fused.get_table_weight("big")
    with _LargeAllocationWatch(rows * dim // 8, list(fused.buffers())) as watch:
        out.sum().backward()
    assert watch.seen == []
    assert not torch.equal(before, fused.get_table_weight("big"))


@pytest.mark.parametrize("count,num_rows", [(0, 5), (1, 5), (1000, 7), (5000, 3_000_000), (300, 2**61)])
def test_stable_sort_rows_matches_torch_stable_sort(count, num_rows):
    from neorec.embedding.lookup import stable_sort_rows

    generator = torch.Generator().manual_seed(count)
    rows = torch.randint(0, min(num_rows, 2**62), (count,), generator=generator)
    if count:
        rows[: count // 2] = rows[0]  # many duplicates
    for dtype in (torch.int32, torch.int64) if num_rows < 2**31 else (torch.int64,):
        sorted_rows, permutation = stable_sort_rows(rows.to(dtype), num_rows)
        expected_rows, expected_permutation = torch.sort(rows, stable=True)
        assert torch.equal(sorted_rows, expected_rows) and sorted_rows.dtype == torch.int64
        assert torch.equal(permutation, expected_permutation)


def test_weights_that_require_grad_are_rejected_and_half_forward_is_fp32():
    tables = [TableConfig("t", 50, 8, pooling="mean")]
    kjt = KeyedJaggedTensor(["t"], torch.tensor([1, 2, 3]), torch.tensor([3]), torch.rand(3, requires_grad=True))
    fused = TableBatchedEmbeddingBags(tables, SparseOptimizerConfig(), StorageConfig("bf16"))
    with pytest.raises(ValueError, match="weights.detach"):
        fused(kjt)
    weights = kjt.weights.detach()
    out = fused(KeyedJaggedTensor(["t"], kjt.values, kjt.lengths, weights)).values
    rows = fused.get_table_weight("t")[[1, 2, 3]]
    expected = (weights.unsqueeze(1) * rows).sum(0, keepdim=True) / 3  # fp32 math on the stored rows
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-7)


def test_asking_for_triton_where_it_cannot_run_says_which_part_is_missing(monkeypatch):
    """The message named both causes at once ("not installed ... or no CUDA device") and never the
    way to run the kernels on a CPU, though triton was installed."""
    import importlib.util

    from neorec.embedding.cache_kernels import choose_cache_kernel

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "triton" else
                        real_find_spec(name, *a))
    module = TableBatchedEmbeddingBags(make_tables("sum"), SparseOptimizerConfig("sgd"), kernel="triton")
    with pytest.raises(ValueError, match=r"^kernel='triton' was asked for but there is no CUDA device "
                                         r"\(TRITON_INTERPRET=1 runs the kernels on CPU tensors, slowly\)$"):
        module.kernel_path()
    with pytest.raises(ValueError, match=r"cache 't': kernel='triton' was asked for but there is no CUDA device"):
        choose_cache_kernel("triton", torch.device("cpu"), "t")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else
                        real_find_spec(name, *a))
    with pytest.raises(ValueError, match=r"but triton is not installed \(pip install 'neorec\[gpu\]'\)$"):
        module.kernel_path()


@pytest.mark.parametrize("pooling", [1, 5])  # batch-major and key-major lookups
@pytest.mark.parametrize("kernel", ["torch", "native"])
def test_the_update_uses_the_batch_as_it_was_at_the_forward(kernel, pooling):
    """The torch path kept views of the batch's per-id weights and lengths for its backward: the
    caller changing them in place between forward and backward changed the update (weights x 100:
    an update 100x too large) where the native path refused the change."""
    from neorec.embedding import SparseOptimizerConfig, TableBatchedEmbeddingBags, TableConfig
    from neorec.native.build import native_available
    from neorec.sparse import KeyedJaggedTensor

    if kernel == "native" and native_available() is not None:
        pytest.skip("native kernels unavailable")
    tables = [TableConfig("a", 50, 8, feature_names=["f", "g"])]
    generator = torch.Generator().manual_seed(3)
    lengths = torch.full((8,), pooling)
    values = torch.randint(0, 50, (int(lengths.sum()),), generator=generator)
    weights = torch.rand(values.numel(), generator=generator)

    def train(mutate: bool):
        module = TableBatchedEmbeddingBags(tables, SparseOptimizerConfig("sgd", 1.0), init_seed=1, kernel=kernel)
        kjt = KeyedJaggedTensor(["f", "g"], values.clone(), lengths.clone(), weights=weights.clone())
        out = module(kjt).values
        if mutate:
            kjt.weights.mul_(100)
            kjt.lengths.zero_()
        try:
            out.sum().backward()
        except RuntimeError as exc:  # refused outright is as good as unchanged
            assert "modified by an inplace operation" in str(exc)
            return None
        return module.get_table_weight("a")

    changed, reference = train(True), train(False)
    assert changed is None or torch.equal(changed, reference)


def test_lengths_that_do_not_sum_to_the_values_are_refused_on_the_torch_path():
    """A KeyedJaggedTensor built with validate=False: lengths past the values failed with "aminmax():
    cannot compute aminmax over an empty dimension", lengths short of them left values unread."""
    from neorec.embedding import SparseOptimizerConfig, TableBatchedEmbeddingBags, TableConfig
    from neorec.sparse import KeyedJaggedTensor

    module = TableBatchedEmbeddingBags([TableConfig("a", 10, 4)], SparseOptimizerConfig("sgd", 1.0), kernel="torch")
    for lengths, total in (([3, 3], 6), ([1, 1], 2)):
        kjt = KeyedJaggedTensor(["a"], torch.tensor([1, 2, 3, 4]), torch.tensor(lengths), validate=False)
        with pytest.raises(ValueError, match=f"its lengths sum to {total} but it holds 4 values"):
            module(kjt)


def test_bag_offsets_are_int64_once_a_batch_has_2_31_ids():
    """The torch path's index type followed the table's rows only: its bag offsets, which count a
    batch's ids, would have wrapped past 2^31 ids into a small table (not run here: 16 GB of ids)."""
    from neorec.embedding.lookup import index_dtype_for

    assert index_dtype_for(1000, 2**31 - 1) == torch.int32
    assert index_dtype_for(1000, 2**31) == torch.int64
    assert index_dtype_for(2**31, 10) == torch.int64
