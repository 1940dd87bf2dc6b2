"""The fused embedding module used as a plain PyTorch module: state dicts, copies, backward
semantics and the ids it accepts (found by an audit of the Python API).

    python -m pytest tests/unit/embedding/test_module_semantics.py -q
"""

from __future__ import annotations

import copy
import io
import re
import warnings

import pytest
import torch

from neorec.embedding import SparseOptimizerConfig, TableBatchedEmbeddingBags, TableConfig
from neorec.embedding.path_common import SecondLookupWarning
from neorec.native.build import native_available
from neorec.sparse import KeyedJaggedTensor

SGD = SparseOptimizerConfig(kind="sgd", learning_rate=1.0)


def module(tables, kernel="torch", **kwargs):
    return TableBatchedEmbeddingBags(tables, SGD, kernel=kernel, **kwargs)


def batch(keys=("a", "c"), ids=(1, 2)):
    return KeyedJaggedTensor(list(keys), torch.tensor(ids), torch.ones(len(keys), dtype=torch.long))


def test_a_state_dict_of_other_tables_is_refused_before_anything_is_copied():
    """The flat buffers carried no layout: the same total size loaded "successfully" with rows in
    other tables (here a and c swapped)."""
    a_c = module([TableConfig("a", 10, 4), TableConfig("c", 5, 4)])
    c_a = module([TableConfig("c", 5, 4), TableConfig("a", 10, 4)], init_seed=1)
    before = c_a.weights.clone()
    with pytest.raises(ValueError, match=r"holds the tables \[\['a', 10, 4\], \['c', 5, 4\]\].*this module "
                                         r"\[\['c', 5, 4\], \['a', 10, 4\]\]"):
        c_a.load_state_dict(a_c.state_dict())
    assert torch.equal(c_a.weights, before)
    same = module([TableConfig("a", 10, 4), TableConfig("c", 5, 4)], init_seed=2)
    saved = io.BytesIO()
    torch.save(a_c.state_dict(), saved)
    saved.seek(0)
    same.load_state_dict(torch.load(saved, weights_only=True))  # the layout survives a weights-only load
    assert torch.equal(same.get_table_weight("a"), a_c.get_table_weight("a"))
    legacy = {k: v for k, v in a_c.state_dict().items() if k != "table_layout"}  # saved before the layout
    same.load_state_dict(legacy)


@pytest.mark.skipif(native_available() is not None, reason="native kernels unavailable")
def test_copies_and_pickles_after_a_native_forward():
    """The loaded C library's handle made deepcopy / torch.save(module) fail after the first forward."""
    tbe = module([TableConfig("a", 10, 4), TableConfig("c", 5, 4)], kernel="native")
    tbe(batch()).values.sum().backward()
    twin = copy.deepcopy(tbe)
    assert torch.equal(twin(batch()).values, tbe(batch()).values)
    torch.save(tbe, io.BytesIO())


@pytest.mark.parametrize("kernel", ["torch", "native"])
def test_a_second_backward_through_a_freed_graph_raises_and_steps_nothing(kernel):
    """The torch path accepted it and stepped the optimizer a second time (the native one raised)."""
    if kernel == "native" and native_available() is not None:
        pytest.skip("native kernels unavailable")
    tbe = module([TableConfig("a", 10, 4), TableConfig("c", 5, 4)], kernel=kernel)
    loss = tbe(batch()).values.sum()
    loss.backward()
    after_one = tbe.weights.clone()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()
    assert torch.equal(tbe.weights, after_one) and tbe.step_count == 1


@pytest.mark.parametrize("kernel", ["torch", "native"])
def test_a_second_lookup_before_the_first_backward_warns(kernel):
    """Two lookups into one loss are two optimizer steps (each backward steps): said by a warning,
    not only in a docstring. A lookup whose backward ran, whose graph was dropped, or that ran
    under no_grad does not count, and copies or pickles of a module with a lookup pending work."""
    if kernel == "native" and native_available() is not None:
        pytest.skip("native kernels unavailable")
    tbe = module([TableConfig("a", 10, 4), TableConfig("c", 5, 4)], kernel=kernel)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SecondLookupWarning)
        first = tbe(batch()).values
        first.sum().backward()
        kept = tbe(batch()).values  # the first's output is still alive, its backward has run
        del kept
        dropped = tbe(batch()).values
        del dropped  # a graph dropped without a backward
        with torch.no_grad():
            tbe(batch())
        pending = tbe(batch()).values
        twin = copy.deepcopy(tbe)
        torch.save(tbe, io.BytesIO())
        twin(batch()).values.sum().backward()  # the copy has no lookup pending
    with pytest.warns(SecondLookupWarning, match="each lookup's backward is its own optimizer step") as caught:
        second = tbe(batch()).values
    assert [w.filename for w in caught] == [__file__]  # the caller's line, not one inside neorec or torch
    steps = tbe.step_count
    (pending.sum() + second.sum()).backward()
    assert tbe.step_count == steps + 2
    with warnings.catch_warnings():
        warnings.simplefilter("error", SecondLookupWarning)
        tbe(batch()).values.sum().backward()


def test_float_ids_are_refused_not_truncated():
    kjt = batch()
    with pytest.raises(TypeError, match="moves to a device; got the dtype torch.float32"):
        kjt.to(torch.float32)
    floats = KeyedJaggedTensor(["a", "c"], torch.tensor([1.7, 2.0]), torch.ones(2, dtype=torch.long), validate=False)
    for kernel in ["torch"] + (["native"] if native_available() is None else []):
        with pytest.raises(TypeError, match="ids must be integers, got torch.float32"):
            module([TableConfig("a", 10, 4), TableConfig("c", 5, 4)], kernel=kernel)(floats)


def test_the_layout_buffer_lives_with_the_other_buffers():
    tbe = module([TableConfig("a", 10, 4)], device="meta")
    assert {buffer.device.type for buffer in tbe.buffers()} == {"meta"}


@pytest.mark.parametrize("convert", ["half", "double", "bfloat16"])
def test_converting_a_model_keeps_the_tables_storage_types(convert):
    """`.half()` of a model (meant for its dense layers) converted the rows and the optimizer state
    too: fp16 row-wise AdaGrad state overflowed to inf and its rows stopped training; fp64 rows
    failed in the backward after the step count had moved."""
    from neorec.embedding import StorageConfig
    from neorec.model import DLRM
    from neorec.embedding import EmbeddingBagCollection

    tables = [TableConfig("t", 10, 4)]
    kjt = KeyedJaggedTensor(["t"], torch.tensor([3]), torch.tensor([1]))
    optimizer = SparseOptimizerConfig("rowwise_adagrad", 0.05)
    moves = []
    for converted in (False, True):
        ebc = EmbeddingBagCollection(tables, optimizer, StorageConfig("fp16"))
        dtypes = {name: b.dtype for name, b in ebc.tbe.named_buffers()}
        if converted:
            getattr(ebc, convert)()
            assert {name: b.dtype for name, b in ebc.tbe.named_buffers()} == dtypes
        before = ebc.tbe.get_table_weight("t")[3].clone()
        for _ in range(3):
            (ebc(kjt).values * 300.0).sum().backward()
        moves.append(ebc.tbe.get_table_weight("t")[3] - before)
    assert torch.equal(moves[0], moves[1]) and moves[1].abs().min() > 0
    ebc = EmbeddingBagCollection([TableConfig("a", 10, 4), TableConfig("b", 20, 4)], optimizer)
    model = getattr(DLRM(ebc, 3, {"a": 4, "b": 4}, [4], [4]), convert)()  # dense layers converted, tables not
    dense_dtype = next(model.parameters()).dtype
    kjt = KeyedJaggedTensor(["a", "b"], torch.tensor([3, 5, 11]), torch.tensor([1, 1, 1, 0]))
    model(torch.randn(2, 3, dtype=dense_dtype), kjt).sum().backward()
    assert ebc.tbe.weights.dtype == torch.float32 and ebc.tbe.step_count == 1


@pytest.mark.parametrize("assign", [False, True])
def test_assigning_a_state_dict_of_another_precision_keeps_this_modules_types(assign):
    """load_state_dict(assign=True) of an fp32 state dict left fp32 rows in an fp16 module; and under
    strict loading (the default) either way failed on the rounding generator's state ("Missing
    key(s): tbe.rounding_rng_state" into fp16 rows, "Unexpected key(s)" back into fp32 ones)."""
    from neorec.embedding import StorageConfig

    tables = [TableConfig("a", 10, 4), TableConfig("c", 5, 4)]
    source = module(tables, init_seed=3)
    half = module(tables, storage=StorageConfig("fp16"))
    dtypes = {name: b.dtype for name, b in half.named_buffers()}
    half.load_state_dict(source.state_dict(), assign=assign)
    assert {name: b.dtype for name, b in half.named_buffers()} == dtypes
    assert torch.equal(half.weights, source.weights.half())
    half(batch()).values.sum().backward()  # and it trains
    assert half.step_count == 1
    back = module(tables)
    back.load_state_dict(half.state_dict(), assign=assign)  # rounded rows into an fp32 module
    assert torch.equal(back.weights, half.weights.float()) and back.weights.dtype == torch.float32


@pytest.mark.parametrize("precision, large, kept", [("fp16", 1e5, 65510.0), ("bf16", 3.4e38, 3.38e38)])
def test_rows_beyond_the_half_precision_range_are_refused_not_stored_as_inf(precision, large, kept):
    """fp32 rows copied into fp16 / bf16 storage (set_table_weight, load_state_dict: what a resume
    of an fp32 checkpoint into half-precision rows runs) turned a value beyond the type's range
    into inf without a word; the run then stopped on a NaN loss blamed on the learning rates."""
    from neorec.embedding import StorageConfig

    tables = [TableConfig("a", 10, 4), TableConfig("c", 5, 4)]
    half = module(tables, storage=StorageConfig(precision))
    before = half.weights.clone()
    weight = half.get_table_weight("c")
    weight[3, 2] = -large
    shown = re.escape(f"-{large:.6g}")
    with pytest.raises(ValueError, match=rf"set_table_weight\('c'\): row 3 holds {shown}, beyond the largest "
                                         rf"{precision} value \(.*\); refusing to store it as inf"):
        half.set_table_weight("c", weight)
    source = module(tables, init_seed=3)
    source.set_table_weight("c", weight)
    for assign in (False, True):
        with pytest.raises(ValueError, match=rf"load_state_dict: table 'c', row 3 holds {shown}, beyond"):
            half.load_state_dict(source.state_dict(), assign=assign)
    assert torch.equal(half.weights, before)
    weight[3, 2] = kept  # rounds to the largest finite value: taken
    half.set_table_weight("c", weight)
    assert torch.isfinite(half.weights).all() and float(half.get_table_weight("c")[3, 2]) > 1e4


def test_the_first_non_finite_row_is_named_by_table_and_row():
    """What the trainer's divergence check names: tables of several dims (blocks grouped by dim)."""
    tables = [TableConfig("a", 5, 4), TableConfig("b", 7, 8), TableConfig("c", 3, 4)]
    tbe = TableBatchedEmbeddingBags(tables, SparseOptimizerConfig("sgd", 0.1), init_seed=0)
    assert tbe.first_non_finite_row() is None
    for name, row in (("c", 2), ("b", 6), ("a", 0)):
        weight = tbe.get_table_weight(name)
        weight[row, -1] = float("nan")
        tbe.set_table_weight(name, weight)
        found = tbe.first_non_finite_row()
        assert found is not None and torch.isnan(tbe.get_table_weight(found[0])[found[1]]).any(), found
    assert tbe.first_non_finite_row() in {("a", 0), ("b", 6), ("c", 2)}
