"""``EmbeddingBagCollection``: the user-facing set of pooled embedding tables of a model.

    tables = [TableConfig("user", 1000, 16), TableConfig("item", 5000, 16, ["item", "last_item"])]
    collection = EmbeddingBagCollection(tables, SparseOptimizerConfig("rowwise_adagrad", 0.05))
    pooled = collection(kjt)            # KeyedTensor, keys ["user", "item", "last_item"]
    pooled.values                       # [B, 48] fp32
    pooled.values.sum().backward()      # updates the touched rows in place

All tables are served by one ``TableBatchedEmbeddingBags`` (``self.tbe``); the weights are
buffers updated by the fused sparse optimizer in backward, so a dense ``torch.optim`` optimizer
over ``model.parameters()`` never sees them.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

from neorec.embedding.config import SparseOptimizerConfig, StorageConfig, TableConfig
from neorec.embedding.layout import validate_tables
from neorec.embedding.tbe import TableBatchedEmbeddingBags
from neorec.sparse.jagged import KeyedJaggedTensor
from neorec.sparse.keyed import KeyedTensor


class EmbeddingBagCollection(nn.Module):
    """Pooled embedding lookups for every feature of ``tables``.

    Args: as ``TableBatchedEmbeddingBags`` (tables, optimizer, storage, dense_gradient, device,
    init_seed). Table names must be unique; a feature belongs to one table; several features may
    share a table.

    Attributes:
        tables: the table configs, in the given order.
        feature_names: output keys: table order, then each table's feature order.
        embedding_dims: [len(feature_names)] embedding dim of each feature.
        tbe: the fused module holding all weights and optimizer state.
    """

    def __init__(
        self,
        tables: Sequence[TableConfig],
        optimizer: SparseOptimizerConfig = SparseOptimizerConfig(),
        storage: StorageConfig = StorageConfig(),
        dense_gradient: bool = False,
        device: Optional[torch.device | str] = None,
        init_seed: Optional[int] = 0,
        kernel: str = "auto",
    ) -> None:
        super().__init__()
        self.tables: List[TableConfig] = validate_tables(tables)
        self.tbe = TableBatchedEmbeddingBags(
            self.tables, optimizer, storage, dense_gradient=dense_gradient, device=device,
            init_seed=init_seed, kernel=kernel,
        )
        self.feature_names: List[str] = list(self.tbe.feature_names)
        self.embedding_dims: List[int] = list(self.tbe.feature_dims)

    def embedding_dim_per_feature(self) -> Dict[str, int]:
        return dict(zip(self.feature_names, self.embedding_dims))

    @property
    def total_dim(self) -> int:
        """Width of the pooled output: sum of ``embedding_dims``."""
        return sum(self.embedding_dims)

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """``features`` must hold every name in ``feature_names`` (more keys are ignored).
        Returns values [B, total_dim] fp32."""
        return self.tbe(features)
