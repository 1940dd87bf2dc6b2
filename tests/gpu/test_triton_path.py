"""TableBatchedEmbeddingBags dispatching to the Triton kernels (kernel="triton") trains like its
torch path: same outputs each step, same rows and optimizer state after.

On a CPU machine the kernels run in triton's interpreter (tests/gpu/conftest.py sets
TRITON_INTERPRET=1); with CUDA the module runs on the GPU and the torch path on the CPU.

    python -m pytest tests/gpu/test_triton_path.py -q
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from neorec.embedding import EmbeddingBagCollection  # noqa: E402
from neorec.embedding.config import SparseOptimizerConfig  # noqa: E402
from neorec.embedding.tbe import TableBatchedEmbeddingBags  # noqa: E402

from test_triton_tbe_module import TABLES, make_features  # noqa: E402

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("kind", ["sgd", "rowwise_adagrad", "adagrad"])
def test_triton_dispatch_matches_torch_path(kind):
    optimizer = SparseOptimizerConfig(kind=kind, learning_rate=0.1)
    reference = TableBatchedEmbeddingBags(TABLES, optimizer, init_seed=5, kernel="torch")
    triton_module = TableBatchedEmbeddingBags(TABLES, optimizer, init_seed=5, kernel="triton", device=DEVICE)
    assert triton_module._uses_triton() and not reference._uses_triton()
    generator = torch.Generator().manual_seed(2)
    for step in range(3):
        features = make_features(generator, batch_size=4, weighted=step == 1)
        expected = reference(features).values
        got = triton_module(features.to(DEVICE)).values
        torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-6)
        grad = torch.randn(expected.shape, generator=generator)
        expected.backward(grad)
        got.backward(grad.to(DEVICE))
    assert triton_module.step_count == reference.step_count == 3
    torch.testing.assert_close(triton_module.weights.cpu(), reference.weights, rtol=1e-5, atol=1e-6)
    if kind != "sgd":
        torch.testing.assert_close(triton_module.momentum1.cpu(), reference.momentum1, rtol=1e-5, atol=1e-7)
    with torch.no_grad():  # eval forward takes the kernel too
        features = make_features(generator, batch_size=2, weighted=False)
        torch.testing.assert_close(triton_module(features.to(DEVICE)).values.cpu(), reference(features).values,
                                   rtol=1e-5, atol=1e-6)


def test_triton_refuses_optimizer_settings_changed_out_of_range_before_counting_the_step():
    """A learning rate set to 0 between steps (taken by the torch and native paths then) was refused
    inside the Triton kernel after the step had been counted; all paths now refuse it first."""
    module = TableBatchedEmbeddingBags(TABLES, SparseOptimizerConfig("sgd"), kernel="triton", device=DEVICE)
    features = make_features(torch.Generator().manual_seed(0), batch_size=2, weighted=False).to(DEVICE)
    module.optimizer.learning_rate = 0.0
    before = module.weights.clone()
    with pytest.raises(ValueError, match="settings changed since it was built: sparse optimizer learning_rate must be > 0"):
        module(features).values.sum().backward()
    assert torch.equal(module.weights, before) and int(module.step) == 0


def test_triton_dispatch_checks_ids_and_choices():
    module = TableBatchedEmbeddingBags(TABLES, SparseOptimizerConfig("sgd"), kernel="triton", device=DEVICE)
    features = make_features(torch.Generator().manual_seed(0), batch_size=2, weighted=False)
    bad = features.values.clone()
    bad[-1] = 1000
    from neorec.sparse import KeyedJaggedTensor

    with pytest.raises(ValueError, match=r"feature '\w' \(table '\w+'\): id 1000 is outside"):
        module(KeyedJaggedTensor(features.keys(), bad, features.lengths).to(DEVICE))
    weighted = make_features(torch.Generator().manual_seed(0), batch_size=2, weighted=True)
    weights = weighted.weights.clone().requires_grad_()  # no gradient flows to them: refused, as on the CPU paths
    with pytest.raises(ValueError, match="weights.detach"):
        module(KeyedJaggedTensor(weighted.keys(), weighted.values, weighted.lengths, weights).to(DEVICE))
    with pytest.raises(ValueError, match="has no Triton kernel"):
        TableBatchedEmbeddingBags(TABLES, SparseOptimizerConfig("adam"), kernel="triton")._uses_triton()
    with pytest.raises(ValueError, match="kernel must be one of"):
        TableBatchedEmbeddingBags(TABLES, SparseOptimizerConfig("sgd"), kernel="cuda")
    # "auto" keeps CPU weights on the torch path, even under the interpreter
    assert not EmbeddingBagCollection(TABLES).tbe._uses_triton()


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # the interpreter's fp16 cast
@pytest.mark.parametrize("precision, largest, step, span", [("fp16", 65504.0, 32.0, 2.0),
                                                             ("bf16", 3.3895313892515355e38, 2.0**120, 0.99)])
def test_rows_past_the_largest_value_become_inf_on_both_paths(precision, largest, step, span):
    """With stochastic rounding the Triton kernel saturated an overflowing row to the largest
    finite value (any overflow, 1e30 too) where the torch path stores inf: the same config gave inf
    on the CPU and a finite row on the GPU, hiding a row that blew up. Now the rounding past the
    largest value goes up to inf with probability (x - largest) / step, on both paths."""
    from neorec.embedding import StorageConfig, TableConfig
    from neorec.embedding.kernels.reference import stochastic_round
    from neorec.sparse.jagged import KeyedJaggedTensor

    rows = 512
    kjt = KeyedJaggedTensor(["a"], torch.arange(rows), torch.ones(rows, dtype=torch.long))
    # each row's 4 values go from `largest` to largest + (row / rows) x span steps, up or down (bf16:
    # fp32's own largest value is about a step past bf16's)
    target = largest + (torch.arange(rows, dtype=torch.float64) / rows * span * step).unsqueeze(1).expand(rows, 4)
    sign = torch.where(torch.arange(rows) % 2 == 0, 1.0, -1.0).unsqueeze(1)
    results = {}
    for kernel in ("torch", "triton"):
        module = TableBatchedEmbeddingBags([TableConfig("a", rows, 4)], SparseOptimizerConfig("sgd", 1.0),
                                           StorageConfig(precision, stochastic_rounding=True), kernel=kernel,
                                           device=DEVICE if kernel == "triton" else "cpu")
        module.set_table_weight("a", (sign * largest).expand(rows, 4).to(torch.float32))
        grad = -(sign * (target - largest)).to(torch.float32)  # (the update is -lr * grad)
        (module(kjt.to(module.weights.device)).values * grad.to(module.weights.device)).sum().backward()
        results[kernel] = module.get_table_weight("a").cpu().double()
    exact = (sign * target).to(torch.float32)
    results["reference"] = stochastic_round(exact, getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[precision]),
                                            torch.Generator().manual_seed(0)).double()
    past = (target[:, 0] - largest) >= step  # a step or more past the largest value: always inf
    for name, stored in results.items():
        magnitude = stored.abs()
        assert bool(((magnitude == largest) | magnitude.isinf()).all()), name  # one of the two neighbours
        assert bool(magnitude[past].isinf().all()) and bool((stored.sign() == sign).all()), name
        share = float(magnitude[~past].isinf().double().mean())  # below a step: inf (x - largest) / step of the time
        expected = float(((target[:, 0] - largest) / step)[~past].mean())
        assert abs(share - expected) < 0.06, (name, share, expected)


def test_seed_none_draws_a_seed_for_the_rounding_noise():
    """StorageConfig(seed=None) draws a non-deterministic seed (the torch path's generator does);
    the Triton path used seed 0, so every such run had the same noise. Seeded runs still repeat."""
    from neorec.embedding import StorageConfig, TableConfig
    from neorec.sparse.jagged import KeyedJaggedTensor

    kjt = KeyedJaggedTensor(["a"], torch.arange(64), torch.ones(64, dtype=torch.long)).to(DEVICE)

    def trained(seed):
        module = TableBatchedEmbeddingBags([TableConfig("a", 64, 8)], SparseOptimizerConfig("sgd", 1.0),
                                           StorageConfig("fp16", stochastic_rounding=True, seed=seed),
                                           kernel="triton", device=DEVICE)
        module.set_table_weight("a", torch.ones(64, 8))
        (module(kjt).values * 1.3 * 2**-11).sum().backward()  # 0.3 of an fp16 step: rounded either way
        return module.get_table_weight("a").cpu()

    assert torch.equal(trained(5), trained(5))
    assert not torch.equal(trained(None), trained(None))
