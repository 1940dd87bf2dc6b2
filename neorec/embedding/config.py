"""Plain-data descriptions of embedding tables and of the sparse optimizer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

POOLINGS = ("sum", "mean")
PRECISIONS = ("fp32", "fp16", "bf16")
SPARSE_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam")


@dataclass
class TableConfig:
    """One embedding table.

    name: unique table name.
    num_embeddings: rows.
    embedding_dim: columns.
    feature_names: the sparse features (KeyedJaggedTensor keys) looked up in this table; several
        features may share one table. Defaults to ``[name]``.
    pooling: "sum" or "mean" over each bag.
    """

    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: List[str] = field(default_factory=list)
    pooling: str = "sum"

    def __post_init__(self) -> None:
        if not self.feature_names:
            self.feature_names = [self.name]
        if self.num_embeddings <= 0:
            raise ValueError(f"table {self.name!r}: num_embeddings must be > 0, got {self.num_embeddings}")
        if self.embedding_dim <= 0:
            raise ValueError(f"table {self.name!r}: embedding_dim must be > 0, got {self.embedding_dim}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"table {self.name!r}: pooling must be one of {POOLINGS}, got {self.pooling!r}")


@dataclass
class SparseOptimizerConfig:
    """The optimizer fused into the embedding backward.

    kind: "sgd", "adagrad", "rowwise_adagrad" (one state value per row) or "adam" (lazy: only
        touched rows move; bias correction uses the global step count).
    """

    kind: str = "rowwise_adagrad"
    learning_rate: float = 0.05
    eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0
    initial_accumulator_value: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in SPARSE_OPTIMIZERS:
            raise ValueError(
                f"sparse optimizer must be one of {SPARSE_OPTIMIZERS}, got {self.kind!r}"
            )
        if not self.learning_rate > 0:
            raise ValueError(f"sparse optimizer learning_rate must be > 0, got {self.learning_rate}")


@dataclass
class StorageConfig:
    """How the weights are held: ``precision`` "fp32", "fp16" or "bf16"; low-precision updates use
    seeded stochastic rounding when ``stochastic_rounding`` is on."""

    precision: str = "fp32"
    stochastic_rounding: bool = True
    seed: Optional[int] = 0

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
