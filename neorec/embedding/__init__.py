"""Embedding tables: configs, the table-batched fused module, the user-facing collection."""

from neorec.embedding.cached import CachedEmbeddingBagCollection
from neorec.embedding.config import SparseOptimizerConfig, StorageConfig, TableConfig
from neorec.embedding.locations import LocationConfig, TableLocation
from neorec.embedding.tables import EmbeddingBagCollection
from neorec.embedding.tbe import TableBatchedEmbeddingBags

__all__ = [
    "CachedEmbeddingBagCollection",
    "LocationConfig",
    "TableLocation",
    "EmbeddingBagCollection",
    "SparseOptimizerConfig",
    "StorageConfig",
    "TableBatchedEmbeddingBags",
    "TableConfig",
]
