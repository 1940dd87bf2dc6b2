"""Configuration of the data sources (plain dataclasses; loaded from the ``[data]`` TOML section),
and the checks of their files: a Criteo TSV (``check_criteo_tsv``) and the folder of its processed
copy (``check_processed_dir``).

Each dataclass checks its own values in ``__post_init__`` and raises ``ValueError`` naming the key.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List

DATA_SOURCES = ("synthetic", "criteo", "movielens")
MAX_ROWS = 2**48  # rows of one table: far beyond any memory, well inside int64 ids and sizes
CRITEO_CATEGORICAL = 26  # hexadecimal categorical columns of a Criteo line: features cat_0 .. cat_25
MOVIELENS_FEATURES = ["user", "item", "age", "gender", "occupation", "zip", "release_year", "genres"]


def table_name(feature: str) -> str:
    """Every source has one table per sparse feature, named after it."""
    return f"t_{feature}"


@dataclass
class SyntheticConfig:
    """Learnable synthetic click data: Zipf ids, labels from a hidden teacher model.

    num_tables: sparse features, one table each.
    num_embeddings: rows per table (one value for all, or a list of num_tables values).
    pooling: mean ids per bag (1 = one-hot); lengths ~ 1 + Poisson(pooling - 1), capped at
        max_pooling.
    max_pooling: the most ids in one bag.
    zipf_alpha: id popularity skew (0 = uniform).
    num_dense: dense features.
    num_train_samples / num_eval_samples: dataset sizes (samples of an epoch; of the eval set).
    teacher_dim: width of the hidden teacher's embeddings.
    label_noise: temperature of the teacher's logit (higher = noisier labels).
    weighted: attach a float32 weight in (0, 1] to every id (the teacher pools with them).
    seed: the dataset is a pure function of this seed.
    click_rate: the base rate of positive labels the teacher's bias is calibrated to.
    resample_each_epoch: every epoch draws fresh samples from the same teacher (an endless stream,
        like production logs); false repeats epoch 0's samples in every epoch.
    """

    num_tables: int = 8
    num_embeddings: List[int] = field(
        default_factory=lambda: [100_000, 50_000, 20_000, 10_000, 5_000, 2_000, 1_000, 100]
    )
    pooling: float = 2.0
    max_pooling: int = 64
    zipf_alpha: float = 1.05
    num_dense: int = 13
    num_train_samples: int = 500_000
    num_eval_samples: int = 20_000
    teacher_dim: int = 8
    label_noise: float = 1.0
    weighted: bool = False
    seed: int = 1234
    click_rate: float = 0.3
    resample_each_epoch: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.num_embeddings, int):
            self.num_embeddings = [self.num_embeddings]
        self.num_embeddings = list(self.num_embeddings)
        where = "data.synthetic"
        if self.num_tables < 1:
            raise ValueError(f"{where}.num_tables must be >= 1, got {self.num_tables}")
        if not self.num_embeddings or min(self.num_embeddings) < 1 or max(self.num_embeddings) > MAX_ROWS:
            raise ValueError(f"{where}.num_embeddings must hold values in [1, 2**48], got {self.num_embeddings}")
        if not 1.0 <= self.pooling < math.inf:
            raise ValueError(f"{where}.pooling must be finite and >= 1 (mean ids per bag), got {self.pooling}")
        if self.max_pooling < 1:
            raise ValueError(f"{where}.max_pooling must be >= 1, got {self.max_pooling}")
        if not self.zipf_alpha >= 0.0:
            raise ValueError(f"{where}.zipf_alpha must be >= 0 (0 = uniform), got {self.zipf_alpha}")
        if self.num_dense < 0:
            raise ValueError(f"{where}.num_dense must be >= 0, got {self.num_dense}")
        if self.num_train_samples < 1 or self.num_eval_samples < 0:
            raise ValueError(
                f"{where}.num_train_samples must be >= 1 and num_eval_samples >= 0, got "
                f"{self.num_train_samples} and {self.num_eval_samples}"
            )
        if self.teacher_dim < 1:
            raise ValueError(f"{where}.teacher_dim must be >= 1, got {self.teacher_dim}")
        if not 0.0 < self.label_noise < math.inf:
            raise ValueError(f"{where}.label_noise must be finite and > 0, got {self.label_noise}")
        if not 0.0 < self.click_rate < 1.0:
            raise ValueError(f"{where}.click_rate must be in (0, 1), got {self.click_rate}")
        if self.seed < 0:
            raise ValueError(f"{where}.seed must be >= 0, got {self.seed}")

    def table_sizes(self) -> List[int]:
        """Rows of each of the num_tables tables. The length of num_embeddings is checked here, not
        when the config is built, so that ``--set`` overrides may change num_tables and
        num_embeddings one at a time."""
        if len(self.num_embeddings) not in (1, self.num_tables):
            raise ValueError(
                f"data.synthetic.num_embeddings must hold one value (for all tables) or num_tables = "
                f"{self.num_tables} values, got {len(self.num_embeddings)}: {self.num_embeddings}"
            )
        if len(self.num_embeddings) == 1:
            return self.num_embeddings * self.num_tables
        return list(self.num_embeddings)

    def feature_names(self) -> List[str]:
        return [f"feature_{t}" for t in range(self.num_tables)]


@dataclass
class CriteoConfig:
    """Criteo click logs in the raw TSV layout (label, 13 integer, 26 hex categorical columns).

    train_path / eval_path: raw TSV files (eval_path may be empty: then the last eval_fraction of
        train_path, by line order, is held out).
    eval_fraction: the share of train_path held out for evaluation when eval_path is empty.
    processed_dir: where the binary memory-mapped form is written (defaults beside train_path:
        ``<train_path>.neorec/``); rebuilt when the TSV's size, mtime or first / last MiB change.
    num_embeddings: rows per categorical table (ids are hashed into it; row 0 = missing value).
    skip_malformed: count and skip malformed lines instead of stopping at the first one.
    shuffle: shuffle the training rows every epoch (blocks of 256 consecutive rows, seeded by
        (seed, epoch)); false reads them in file order, as the reference DLRM does.
    seed: seed of the shuffle.
    chunk_lines: lines parsed at a time while preprocessing (bounds its memory).
    """

    train_path: str = ""
    eval_path: str = ""
    processed_dir: str = ""
    eval_fraction: float = 0.1
    num_embeddings: int = 100_000
    skip_malformed: bool = False
    shuffle: bool = False
    seed: int = 0
    chunk_lines: int = 2048

    def __post_init__(self) -> None:
        where = "data.criteo"
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"{where}.eval_fraction must be in [0, 1), got {self.eval_fraction}")
        if not 2 <= self.num_embeddings <= MAX_ROWS:
            raise ValueError(f"{where}.num_embeddings must be in [2, 2**48] (row 0 holds missing values), got "
                             f"{self.num_embeddings}")
        if self.chunk_lines < 1:
            raise ValueError(f"{where}.chunk_lines must be >= 1, got {self.chunk_lines}")
        if self.seed < 0:
            raise ValueError(f"{where}.seed must be >= 0, got {self.seed}")

    def feature_names(self) -> List[str]:
        return [f"cat_{i}" for i in range(CRITEO_CATEGORICAL)]


@dataclass
class MovieLensConfig:
    """MovieLens-100k as click data, split in time.

    path: directory holding GroupLens' ``u.data``, ``u.user``, ``u.item`` and ``u.genre`` (as
        unpacked from ml-100k.zip), or RecBole's ``<name>.inter``, ``<name>.user`` and
        ``<name>.item`` (tab-separated, typed headers such as ``user_id:token``). Nothing is
        downloaded; the default is the team's shared copy beside the repository.
    eval_fraction: the last fraction of the interactions by timestamp is the eval set.
    min_rating_positive: label = 1 for a rating at least this, else 0.
    seed: seed of the per-epoch shuffle of the training interactions.
    """

    path: str = "../shared/data/ml-100k"
    eval_fraction: float = 0.2
    min_rating_positive: float = 4.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"data.movielens.eval_fraction must be in (0, 1), got {self.eval_fraction}")
        if self.seed < 0:
            raise ValueError(f"data.movielens.seed must be >= 0, got {self.seed}")
        if not math.isfinite(self.min_rating_positive):
            raise ValueError(f"data.movielens.min_rating_positive must be a finite rating, got {self.min_rating_positive}")

    def feature_names(self) -> List[str]:
        return list(MOVIELENS_FEATURES)


@dataclass
class DataConfig:
    """Which source feeds training, the batch sizes, and the batches prepared ahead.

    source: "synthetic", "criteo" or "movielens": which of the sections below is read.
    batch_size: training samples per step and rank (the global batch is this x the ranks).
    eval_batch_size: evaluation samples per batch and rank.
    prefetch_batches: batches a background thread prepares ahead (0 = no background thread).
    """

    source: str = "synthetic"
    batch_size: int = 1024
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
        if self.prefetch_batches < 0:
            raise ValueError(f"data.prefetch_batches must be >= 0, got {self.prefetch_batches}")

    def known_table_rows(self) -> Dict[str, int]:
        """{table: rows} where the config alone says them (synthetic, Criteo); {} for a source whose
        tables are sized by its data (MovieLens)."""
        if self.source == "synthetic":
            return dict(zip(self.table_names(), self.synthetic.table_sizes()))
        if self.source == "criteo":
            return {name: self.criteo.num_embeddings for name in self.table_names()}
        return {}

    def table_names(self) -> List[str]:
        """The tables the chosen source makes (``t_<feature>``), known before any data is read."""
        return [table_name(f) for f in getattr(self, self.source).feature_names()]

    def check_inputs_exist(self) -> None:
        """Raise ``FileNotFoundError`` naming the key when the chosen source's input file or directory
        is missing (``IsADirectoryError`` / ``NotADirectoryError`` when it is of the other kind). The
        sources check it too, when built; ``neorec train --nproc N`` asks before it starts ranks, so
        that the error is said once rather than by every rank."""
        if self.source == "criteo":
            for key in ("train_path", "eval_path"):
                path = getattr(self.criteo, key)
                if path:
                    check_criteo_tsv(path, f"data.criteo.{key}", held_out=key == "eval_path")
        elif self.source == "movielens":
            path = self.movielens.path
            if Path(path).exists() and not Path(path).is_dir():
                raise NotADirectoryError(f"MovieLens path {path} is a file, not a directory (data.movielens.path): "
                                         "give the directory that holds the dataset's files")
            if not Path(path).is_dir():
                raise FileNotFoundError(f"MovieLens directory not found: {path} (data.movielens.path)")


def check_criteo_tsv(path: str | Path, what: str, held_out: bool = False) -> None:
    """Raise, naming ``what`` (the setting or option that gave ``path``), unless ``path`` is a
    file: ``FileNotFoundError`` with the command that writes one (``--held-out`` for an eval file)
    when it is missing, ``IsADirectoryError`` for a directory (writing there would fail too)."""
    p = Path(path)
    if p.is_file():
        return
    if p.is_dir():
        raise IsADirectoryError(f"{path} is a directory, not a Criteo TSV file ({what}); give the path of a TSV file")
    if p.exists():  # a device, a pipe, a socket: not read as a file here
        raise ValueError(f"{path} is not a regular file ({what}); give the path of a Criteo TSV file")
    raise FileNotFoundError(f"Criteo TSV file not found: {path} ({what}; `neorec data write-criteo {path}"
                            f"{' --held-out' if held_out else ''}` writes learnable synthetic data in its layout)")


PROCESSED_DIR_SETTING = "data.criteo.processed_dir"  # what chooses the processed copy's folder, in errors


def processed_dir_error(folder: str | os.PathLike, where: str, reason: str, verb: str = "make") -> ValueError:
    """The error for a processed copy's folder that cannot be used: ``where`` says what chose it
    (the setting, or preprocess-criteo's argument), so that the user knows what to change."""
    return ValueError(f"cannot {verb} {folder}, the folder of the processed copy ({where}): {reason}")


def check_processed_dir(out_dir: str | os.PathLike, where: str = PROCESSED_DIR_SETTING) -> None:
    """Raise ``processed_dir_error`` unless a processed copy can be written into ``out_dir``: an
    existing folder in which a file can be made, or a folder that can be made (its nearest existing
    ancestor is a folder in which a file can be made). Makes no folder and leaves no file, so that
    it can be asked of every output before any work, and of a read-only copy that would be rebuilt
    (the error named one of the copy's temporaries)."""
    out_dir = Path(out_dir)
    existing = next(p for p in (out_dir, *out_dir.parents) if os.path.lexists(p))
    verb = "write in" if existing == out_dir else "make"
    if not existing.is_dir():  # (a file, or a link to nothing)
        kind = "a file, not a directory" if existing.is_file() else "not a directory"
        raise processed_dir_error(out_dir, where, f"{existing} is {kind}")
    probe = existing / f".neorec-write-test.{os.getpid()}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT, 0o600))
        probe.unlink()
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise processed_dir_error(out_dir, where, reason if existing == out_dir else f"{reason} (in {existing})",
                                  verb=verb) from None


def no_rows_reason(num_lines: int, num_skipped: int) -> str:
    """Why a TSV gave no rows, for the error that refuses it."""
    return f"its {num_skipped:,} lines are all malformed" if num_lines else "empty"
