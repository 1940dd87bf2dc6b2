"""The Triton kernels on the storage of a real ``TableBatchedEmbeddingBags``: same output as its
forward and same rows/state after its fused backward (its CPU path is the yardstick), which checks
the layout contract (flat buffer, dim-sorted tables, row-wise state order, output columns).

    python -m pytest tests/gpu/test_triton_tbe_module.py -q
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from neorec.embedding.config import SparseOptimizerConfig, StorageConfig, TableConfig  # noqa: E402
from neorec.embedding.kernels import TableBatchedLayout, triton_interpreting  # noqa: E402
from neorec.embedding.kernels import triton_tbe  # noqa: E402
from neorec.embedding.tbe import TableBatchedEmbeddingBags  # noqa: E402
from neorec.sparse.jagged import KeyedJaggedTensor  # noqa: E402

pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(not triton_interpreting(), reason="compares with the module's CPU path (interpreter)"),
]

TABLES = [  # dims out of order, a shared table, both poolings
    TableConfig("wide", 9, 16, ["a"], "sum"),
    TableConfig("narrow", 7, 4, ["b", "c"], "mean"),
    TableConfig("middle", 5, 8, ["d"], "sum"),
    TableConfig("narrow2", 4, 4, ["e"], "sum"),
]


def kernel_layout(module: TableBatchedEmbeddingBags) -> TableBatchedLayout:
    return TableBatchedLayout.build(
        table_dims=module.table_dims,
        table_rows=module.table_rows,
        feature_table=module.layout.feature_tables,
        feature_pooling_mean=[module.tables[t].pooling == "mean" for t in module.layout.feature_tables],
        table_offsets=module.table_offsets,
    )


def make_features(generator: torch.Generator, batch_size: int, weighted: bool) -> KeyedJaggedTensor:
    keys = ["e", "c", "a", "d", "b"]  # not the module's order
    rows = {"a": 9, "b": 7, "c": 7, "d": 5, "e": 4}
    lengths = torch.randint(0, 4, (len(keys) * batch_size,), generator=generator)
    values = torch.cat([
        torch.randint(0, rows[keys[bag // batch_size]], (int(n),), generator=generator)
        for bag, n in enumerate(lengths.tolist())
    ])
    weights = torch.rand(values.numel(), generator=generator) if weighted else None
    return KeyedJaggedTensor(keys, values, lengths, weights)


def kernel_inputs(module: TableBatchedEmbeddingBags, features: KeyedJaggedTensor):
    keys = features.keys()
    ordered = features.permute([keys.index(name) for name in module.feature_names])
    return ordered.values, ordered.offsets(), ordered.batch_size, ordered.weights


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["rowwise_adagrad", "sgd", "adagrad"])
def test_kernels_match_module(kind, precision):
    generator = torch.Generator().manual_seed(11)
    module = TableBatchedEmbeddingBags(
        TABLES, SparseOptimizerConfig(kind=kind, learning_rate=0.1, weight_decay=0.01),
        StorageConfig(precision=precision, stochastic_rounding=False), init_seed=3,
    )
    layout = kernel_layout(module)
    weights = module.weights.clone()
    state = module.momentum1.clone() if kind != "sgd" else None
    for step in range(2):
        features = make_features(generator, batch_size=3, weighted=step == 0)
        indices, offsets, batch_size, per_value_weights = kernel_inputs(module, features)
        expected = module(features).values
        output = triton_tbe.tbe_forward(weights, layout, indices, offsets, batch_size, per_value_weights)
        torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-6)
        grad_output = torch.randn(expected.shape, generator=generator)
        expected.backward(grad_output)
        triton_tbe.tbe_backward_update(
            kind, weights, state, layout, indices, offsets, batch_size, grad_output, per_value_weights,
            learning_rate=0.1, weight_decay=0.01, stochastic_rounding=False,
        )
        tolerance = dict(rtol=1e-5, atol=1e-6) if precision == "fp32" else dict(rtol=1.6e-2, atol=1e-3)
        torch.testing.assert_close(weights.float(), module.weights.float(), **tolerance)
        if state is not None:
            torch.testing.assert_close(state, module.momentum1, rtol=1e-5, atol=1e-7)
