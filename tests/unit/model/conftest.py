"""Fixtures for model tests: a plain per-feature ``nn.EmbeddingBag`` sparse arch and random KJTs.

The fused EmbeddingBagCollection has the same KeyedJaggedTensor -> KeyedTensor contract; this
stub keeps the model tests independent of it.
"""

from __future__ import annotations

from typing import Dict, Tuple

import pytest
import torch
from torch import nn

from neorec.sparse.jagged import KeyedJaggedTensor
from neorec.sparse.keyed import KeyedTensor


class PerFeatureEmbeddingBags(nn.Module):
    """tables {feature: (num_rows, dim)} -> sum-pooled KeyedTensor, features in the given order."""

    def __init__(self, tables: Dict[str, Tuple[int, int]]) -> None:
        super().__init__()
        self.bags = nn.ModuleDict({k: nn.EmbeddingBag(n, d, mode="sum") for k, (n, d) in tables.items()})

    def forward(self, kjt: KeyedJaggedTensor) -> KeyedTensor:
        pooled = []
        for key, bag in self.bags.items():
            jt = kjt[key]
            pooled.append(bag(jt.values, jt.offsets()[:-1], per_sample_weights=jt.weights))
        return KeyedTensor(list(self.bags), [b.embedding_dim for b in self.bags.values()], torch.cat(pooled, 1))


def random_kjt(tables: Dict[str, Tuple[int, int]], batch_size: int, max_ids: int = 3) -> KeyedJaggedTensor:
    lengths = torch.randint(0, max_ids + 1, (len(tables), batch_size))
    values = [torch.randint(0, n, (int(lengths[i].sum()),)) for i, (n, _) in enumerate(tables.values())]
    return KeyedJaggedTensor(list(tables), torch.cat(values), lengths.flatten())


@pytest.fixture
def sparse_arch_factory():
    return PerFeatureEmbeddingBags


@pytest.fixture
def kjt_factory():
    return random_kjt
