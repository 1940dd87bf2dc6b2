"""Configuration of the data sources (plain dataclasses; loaded from the ``[data]`` TOML section)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

DATA_SOURCES = ("synthetic", "criteo", "movielens")


@dataclass
class SyntheticConfig:
    """Learnable synthetic click data: Zipf ids, labels from a hidden teacher model.

    num_tables: sparse features, one table each.
    num_embeddings: rows per table (one value for all, or a list of num_tables values).
    pooling: mean ids per bag (1 = one-hot); lengths ~ 1 + Poisson(pooling - 1), capped at
        max_pooling.
    zipf_alpha: id popularity skew (0 = uniform).
    num_dense: dense features.
    num_train_samples / num_eval_samples: dataset sizes.
    teacher_dim: width of the hidden teacher's embeddings.
    label_noise: temperature of the teacher's logit (higher = noisier labels).
    seed: the dataset is a pure function of this seed.
    """

    num_tables: int = 8
    num_embeddings: List[int] = field(default_factory=lambda: [10000])
    pooling: float = 1.0
    max_pooling: int = 64
    zipf_alpha: float = 1.05
    num_dense: int = 13
    num_train_samples: int = 200_000
    num_eval_samples: int = 20_000
    teacher_dim: int = 8
    label_noise: float = 1.0
    weighted: bool = False
    seed: int = 1234


@dataclass
class CriteoConfig:
    """Criteo click logs in the raw TSV layout (label, 13 integer, 26 hex categorical columns).

    train_path / eval_path: raw TSV files (eval_path may be empty: then the last eval_fraction of
        train_path, by line order, is held out).
    processed_dir: where the binary memory-mapped form is written (defaults beside train_path).
    num_embeddings: rows per categorical table (ids are hashed into it).
    skip_malformed: count and skip malformed lines instead of stopping at the first one.
    """

    train_path: str = ""
    eval_path: str = ""
    processed_dir: str = ""
    eval_fraction: float = 0.1
    num_embeddings: int = 100_000
    skip_malformed: bool = False


@dataclass
class MovieLensConfig:
    """MovieLens-100k as click data (label = rating >= 4), split in time: the last eval_fraction
    of interactions by timestamp are the eval set."""

    path: str = "../shared/data/ml-100k"
    eval_fraction: float = 0.2
    min_rating_positive: float = 4.0


@dataclass
class DataConfig:
    source: str = "synthetic"
    batch_size: int = 512
    eval_batch_size: int = 4096
    prefetch_batches: int = 4
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    criteo: CriteoConfig = field(default_factory=CriteoConfig)
    movielens: MovieLensConfig = field(default_factory=MovieLensConfig)

    def __post_init__(self) -> None:
        if self.source not in DATA_SOURCES:
            raise ValueError(f"data.source must be one of {DATA_SOURCES}, got {self.source!r}")
        if self.batch_size <= 0 or self.eval_batch_size <= 0:
            raise ValueError("data.batch_size and data.eval_batch_size must be > 0")
