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
