"""Fused TableBatchedEmbeddingBags against a plain reference: per-table ``nn.EmbeddingBag``
forward, autograd's dense gradient, and a per-row update loop written here.

    python -m pytest tests/unit/embedding -q
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional

import pytest
import torch
from torch import nn

import neorec.embedding.kernels.native_tbe as native_tbe
import neorec.embedding.lookup as lookup_module
import neorec.embedding.tbe as tbe_module
from neorec.embedding import SparseOptimizerConfig, StorageConfig, TableBatchedEmbeddingBags, TableConfig
from neorec.sparse import KeyedJaggedTensor

KINDS = ["sgd", "adagrad", "rowwise_adagrad", "adam"]
NATIVE_KINDS = ["sgd", "adagrad", "rowwise_adagrad"]
PRECISIONS = ["fp32", "fp16", "bf16"]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TOLERANCE = {"fp32": dict(rtol=1e-5, atol=1e-6), "fp16": dict(rtol=2e-3, atol=1e-4), "bf16": dict(rtol=1.6e-2, atol=1e-3)}


def make_tables(pooling: str) -> List[TableConfig]:
    """Mixed dims 4, 8, 8, 16 (not sorted), mixed rows; table "t8a" serves two features."""
    poolings = {"sum": ["sum"] * 4, "mean": ["mean"] * 4, "mixed": ["mean", "sum", "mean", "sum"]}[pooling]
    return [
        TableConfig("t8a", 13, 8, ["f_a1", "f_a2"], pooling=poolings[0]),
        TableConfig("t4", 7, 4, ["f_b"], pooling=poolings[1]),
        TableConfig("t16", 29, 16, ["f_c"], pooling=poolings[2]),
        TableConfig("t8b", 5, 8, ["f_d"], pooling=poolings[3]),
    ]


def make_batch(tables: List[TableConfig], batch_size: int, generator: torch.Generator, weighted: bool,
               keys: Optional[List[str]] = None) -> KeyedJaggedTensor:
    """Random bags: some empty, duplicate ids within and across bags (small id ranges)."""
    rows = {f: t.num_embeddings for t in tables for f in t.feature_names}
    keys = keys or list(rows)
    lengths = torch.randint(0, 5, (len(keys), batch_size), generator=generator)
    lengths[:, 0] = 0  # an empty bag in every feature
    values = []
    for k, key in enumerate(keys):
        high = rows.get(key, 100)
        if k % 2 == 0:
            high = min(high, 3)  # few distinct ids -> many duplicates
        values.append(torch.randint(0, high, (int(lengths[k].sum()),), generator=generator))
    values = torch.cat(values)
    weights = torch.rand(values.numel(), generator=generator) * 2 - 0.5 if weighted else None
    return KeyedJaggedTensor(keys, values, lengths.flatten(), weights)


class Reference:
    """Per-table fp32 weights (autograd leaves) + dense state, updated row by row."""

    def __init__(self, fused: TableBatchedEmbeddingBags, config: SparseOptimizerConfig, precision: str) -> None:
        self.tables = fused.tables
        self.config = config
        self.dtype = DTYPES[precision]
        self.weights = {t.name: nn.Parameter(fused.get_table_weight(t.name)) for t in self.tables}
        init = config.initial_accumulator_value if config.kind != "adam" else 0.0
        self.state: Dict[str, Dict[str, torch.Tensor]] = {}
        for t in self.tables:
            shape = (t.num_embeddings,) if config.kind == "rowwise_adagrad" else (t.num_embeddings, t.embedding_dim)
            names = {"sgd": [], "adagrad": ["momentum1"], "rowwise_adagrad": ["momentum1"],
                     "adam": ["momentum1", "momentum2"]}[config.kind]
            self.state[t.name] = {n: torch.full(shape, float(init)) for n in names}
        self.step = 0

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        outputs = []
        for t in self.tables:
            bag = nn.EmbeddingBag(t.num_embeddings, t.embedding_dim, mode="sum")
            bag.weight = self.weights[t.name]
            for feature in t.feature_names:
                jt = kjt[feature]
                offsets = jt.offsets()[:-1]
                if jt.weights is None and t.pooling == "mean":
                    bag.mode = "mean"
                    pooled = bag(jt.values, offsets)
                    bag.mode = "sum"
                else:
                    pooled = bag(jt.values, offsets, per_sample_weights=jt.weights)
                    if t.pooling == "mean":
                        pooled = pooled / jt.lengths.clamp(min=1).unsqueeze(1)
                outputs.append(pooled)
        return torch.cat(outputs, dim=1)

    @torch.no_grad()
    def update(self, kjt: KeyedJaggedTensor) -> None:
        """One step on every row that appears in ``kjt`` (even if its gradient is zero)."""
        self.step += 1
        c = self.config
        for t in self.tables:
            w, state = self.weights[t.name], self.state[t.name]
            touched = sorted({int(i) for f in t.feature_names for i in kjt[f].values.tolist()})
            for r in touched:
                g = w.grad[r] + c.weight_decay * w[r]
                if c.kind == "sgd":
                    new = w[r] - c.learning_rate * g
                elif c.kind == "adagrad":
                    state["momentum1"][r] += g * g
                    new = w[r] - c.learning_rate * g / (state["momentum1"][r].sqrt() + c.eps)
                elif c.kind == "rowwise_adagrad":
                    state["momentum1"][r] += (g * g).mean()
                    new = w[r] - c.learning_rate * g / (state["momentum1"][r].sqrt() + c.eps)
                else:
                    m, v = state["momentum1"], state["momentum2"]
                    m[r] = c.beta1 * m[r] + (1 - c.beta1) * g
                    v[r] = c.beta2 * v[r] + (1 - c.beta2) * g * g
                    step_size = c.learning_rate * math.sqrt(1 - c.beta2**self.step) / (1 - c.beta1**self.step)
                    new = w[r] - step_size * m[r] / (v[r].sqrt() + c.eps)
                w[r] = new.to(self.dtype).float()  # round to nearest for fp16/bf16 storage
            w.grad = None


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("pooling,weighted", [("sum", False), ("mean", False), ("mixed", True)])
@pytest.mark.parametrize("kind", KINDS)
def test_fused_matches_reference(kind, pooling, weighted, precision, monkeypatch):
    monkeypatch.setattr(tbe_module, "_CHUNK_BYTES", 48)  # a few rows per chunk: exercise chunking
    check_against_reference(kind, pooling, weighted, precision, "torch", monkeypatch)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("pooling,weighted", [("sum", False), ("mean", False), ("mixed", True)])
@pytest.mark.parametrize("kind", NATIVE_KINDS)
def test_native_kernels_match_reference(kind, pooling, weighted, threads, monkeypatch):
    """The C kernels (kernel="native"), on one thread and with the work split over three."""
    monkeypatch.setattr(native_tbe, "_threads", lambda work: threads)
    check_against_reference(kind, pooling, weighted, "fp32", "native", monkeypatch)


def check_against_reference(kind: str, pooling: str, weighted: bool, precision: str, kernel: str, monkeypatch) -> None:
    tables = make_tables(pooling)
    config = SparseOptimizerConfig(kind, learning_rate=0.1, weight_decay=0.01,
                                   initial_accumulator_value=0.1 if "adagrad" in kind else 0.0)
    storage = StorageConfig(precision, stochastic_rounding=False)
    fused = TableBatchedEmbeddingBags(tables, config, storage, init_seed=3, kernel=kernel)
    assert fused.kernel_path() == kernel
    reference = Reference(fused, config, precision)
    generator = torch.Generator().manual_seed(11)
    tolerance = TOLERANCE[precision]
    for step in range(3):
        # alternate key-major (step 0, 2) and batch-major (step 1) bag order
        monkeypatch.setattr(lookup_module, "BATCH_MAJOR_MAX_POOLING", 1e9 if step == 1 else 0.0)
        kjt = make_batch(tables, 6, generator, weighted)
        grad_output = torch.randn(6, sum(fused.feature_dims), generator=generator)
        pooled = fused(kjt)
        assert pooled.keys == ["f_a1", "f_a2", "f_b", "f_c", "f_d"]
        assert pooled.length_per_key == [8, 8, 4, 16, 8]
        expected = reference.forward(kjt)
        torch.testing.assert_close(pooled.values, expected, **tolerance, msg=f"forward, step {step}")
        pooled.values.backward(grad_output)
        expected.backward(grad_output)
        reference.update(kjt)
        assert fused.step_count == step + 1
        for t in tables:
            torch.testing.assert_close(fused.get_table_weight(t.name), reference.weights[t.name].detach(),
                                       **tolerance, msg=f"table {t.name}, step {step}")
            state = fused.get_optimizer_state(t.name)
            assert sorted(state) == sorted(reference.state[t.name])
            for name, value in state.items():
                torch.testing.assert_close(value, reference.state[t.name][name], rtol=2e-3 if precision != "fp32" else 1e-5,
                                           atol=1e-6, msg=f"{name} of {t.name}, step {step}")


@pytest.mark.filterwarnings("ignore::neorec.embedding.path_common.SecondLookupWarning")  # (two lookups, on purpose)
def test_keys_superset_and_permutation_give_same_result():
    tables = make_tables("mixed")
    generator = torch.Generator().manual_seed(5)
    kjt = make_batch(tables, 4, generator, weighted=True,
                     keys=["extra", "f_d", "f_c", "f_a2", "f_b", "f_a1"])
    ordered = kjt.select_keys(["f_a1", "f_a2", "f_b", "f_c", "f_d"])
    fused = TableBatchedEmbeddingBags(tables, SparseOptimizerConfig("sgd"))
    torch.testing.assert_close(fused(kjt).values, fused(ordered).values, rtol=0, atol=0)


def test_learning_rate_change_between_steps_takes_effect():
    tables = [TableConfig("t", 4, 2)]
    kjt = KeyedJaggedTensor(["t"], torch.tensor([1]), torch.tensor([1]))
    fused = TableBatchedEmbeddingBags(tables, SparseOptimizerConfig("sgd", learning_rate=0.5))
    before = fused.get_table_weight("t")
    fused(kjt).values.sum().backward()
    fused.optimizer.learning_rate = 0.25
    fused(kjt).values.sum().backward()
    after = fused.get_table_weight("t")
    torch.testing.assert_close(after[1], before[1] - 0.75)
    torch.testing.assert_close(after[[0, 2, 3]], before[[0, 2, 3]], rtol=0, atol=0)


def test_no_grad_forward_does_not_update_and_weights_are_not_parameters():
    tables = make_tables("sum")
    fused = TableBatchedEmbeddingBags(tables, SparseOptimizerConfig("sgd"))
    assert list(fused.parameters()) == []
    kjt = make_batch(tables, 3, torch.Generator().manual_seed(0), weighted=False)
    with torch.no_grad():
        out = fused(kjt).values
    assert not out.requires_grad
    assert fused.step_count == 0
