"""Modified-row tracking (incremental checkpoints) on the Triton path marks the same rows as the
torch path. CPU machines run the kernels in triton's interpreter (tests/gpu/conftest.py).

    python -m pytest tests/gpu/test_triton_modified_rows.py -q
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from neorec.embedding.config import SparseOptimizerConfig  # noqa: E402
from neorec.embedding.tbe import TableBatchedEmbeddingBags  # noqa: E402

from test_triton_tbe_module import TABLES, make_features  # noqa: E402

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_triton_path_marks_the_rows_the_torch_path_marks():
    optimizer = SparseOptimizerConfig(kind="rowwise_adagrad", learning_rate=0.1)
    reference = TableBatchedEmbeddingBags(TABLES, optimizer, init_seed=5, kernel="torch")
    triton_module = TableBatchedEmbeddingBags(TABLES, optimizer, init_seed=5, kernel="triton", device=DEVICE)
    assert triton_module._uses_triton()
    reference.track_modified_rows()
    triton_module.track_modified_rows()
    generator = torch.Generator().manual_seed(3)
    for _ in range(2):
        features = make_features(generator, batch_size=4, weighted=False)
        reference(features).values.sum().backward()
        triton_module(features.to(DEVICE)).values.sum().backward()
    assert reference.modified_rows.any()
    for table in reference.tables:
        assert triton_module.take_modified_rows(table.name).cpu().tolist() == \
            reference.take_modified_rows(table.name).tolist(), table.name
