"""Plain-data descriptions of embedding tables and of the sparse optimizer."""

from __future__ import annotations

import math
import numbers
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
        if not isinstance(self.name, str):
            raise TypeError(f"table name must be a string, got {self.name!r}")
        if not isinstance(self.feature_names, (list, tuple)) or not all(
            isinstance(f, str) for f in self.feature_names
        ):
            raise TypeError(
                f"table {self.name!r}: feature_names must be a list of strings, got {self.feature_names!r}"
            )
        self.feature_names = list(self.feature_names) or [self.name]
        for arg in ("num_embeddings", "embedding_dim"):
            value = getattr(self, arg)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"table {self.name!r}: {arg} must be an int, got {value!r}")
            if value <= 0:
                raise ValueError(f"table {self.name!r}: {arg} must be > 0, got {value}")
            setattr(self, arg, int(value))
        if self.pooling not in POOLINGS:
            raise ValueError(f"table {self.name!r}: pooling must be one of {POOLINGS}, got {self.pooling!r}")


@dataclass
class SparseOptimizerConfig:
    """The optimizer fused into the embedding backward.

    kind: "sgd", "adagrad", "rowwise_adagrad" (one state value per row) or "adam" (lazy: only
        touched rows move; bias correction uses the global step count).
    learning_rate: step size of every update.
    eps: added to the denominator of the AdaGrad, row-wise AdaGrad and Adam updates.
    beta1, beta2: Adam's decay rates of its first and second moment estimates.
    weight_decay: L2 penalty: weight_decay x the row is added to each touched row's gradient.
    initial_accumulator_value: the AdaGrad kinds' starting sum of squared gradients.
    Checked on construction (``check()``), and again by a fused module before each update since the
    settings may change between steps: finite numbers with learning_rate > 0, eps, weight_decay and
    initial_accumulator_value >= 0, and 0 <= beta1, beta2 < 1; and eps > 0 where a zero gradient
    would otherwise give 0 / 0 (Adam; AdaGrad kinds without an initial accumulator).
    """

    kind: str = "rowwise_adagrad"
    learning_rate: float = 0.05
    eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0
    initial_accumulator_value: float = 0.0

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise if a setting is out of its range (see the class docstring)."""
        if self.kind not in SPARSE_OPTIMIZERS:
            raise ValueError(
                f"sparse optimizer must be one of {SPARSE_OPTIMIZERS}, got {self.kind!r}"
            )
        for arg in ("learning_rate", "eps", "beta1", "beta2", "weight_decay", "initial_accumulator_value"):
            value = getattr(self, arg)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"sparse optimizer {arg} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"sparse optimizer {arg} must be finite, got {value}")
        if not self.learning_rate > 0:
            raise ValueError(f"sparse optimizer learning_rate must be > 0, got {self.learning_rate}")
        for arg in ("eps", "weight_decay", "initial_accumulator_value"):
            if getattr(self, arg) < 0:
                raise ValueError(f"sparse optimizer {arg} must be >= 0, got {getattr(self, arg)}")
        for arg in ("beta1", "beta2"):
            if not 0 <= getattr(self, arg) < 1:
                raise ValueError(f"sparse optimizer {arg} must be in [0, 1), got {getattr(self, arg)}")
        if self.eps == 0 and (self.kind == "adam" or (self.kind != "sgd" and self.initial_accumulator_value == 0)):
            raise ValueError(f"sparse optimizer eps must be > 0 for {self.kind}"
                             + (" (or initial_accumulator_value > 0)" if self.kind != "adam" else "")
                             + ": every looked-up row is stepped, and one whose gradient is 0 would be updated "
                               "by 0 / 0 = NaN")


@dataclass
class StorageConfig:
    """How the weights of the fused module are held.

    precision: "fp32", "fp16" or "bf16" rows (pooled and updated in fp32; optimizer state fp32).
    stochastic_rounding: round each fp16 / bf16 update stochastically (unbiased), else to nearest.
    seed: seed of that rounding's generator (None, from Python only: drawn once).
    """

    precision: str = "fp32"
    stochastic_rounding: bool = True
    seed: Optional[int] = 0

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
