"""The interface every data source offers the trainer, and the helpers the sources share.

    from neorec.data import make_data_source
    source = make_data_source(cfg.data)             # synthetic, criteo or movielens
    tables = source.tables(embedding_dim=16)        # one TableConfig per sparse feature
    for batch in source.train_batches(512, epoch=0):
        ...                                         # Batch(dense [B, num_dense], sparse KJT, labels [B])
"""

from __future__ import annotations

from typing import Iterator, List, Protocol, Sequence, runtime_checkable

import numpy as np

from neorec.data.batch import Batch
from neorec.data.config import DataConfig, table_name
from neorec.embedding.config import TableConfig

_MASK64 = 0xFFFFFFFFFFFFFFFF
GOLDEN64 = 0x9E3779B97F4A7C15


@runtime_checkable
class DataSource(Protocol):
    """A dataset the trainer can iterate.

    name: "synthetic", "criteo" or "movielens".
    num_dense: dense features per sample.
    feature_names: sparse features, in KeyedJaggedTensor key order.
    """

    name: str
    num_dense: int
    feature_names: List[str]

    def tables(self, embedding_dim: int, pooling: str = "sum") -> List[TableConfig]:
        """One table per sparse feature (named ``t_<feature>``), ``feature_names`` set."""
        ...

    def num_train_samples(self) -> int: ...

    def num_eval_samples(self) -> int: ...

    def train_batches(self, batch_size: int, epoch: int = 0, start_batch: int = 0) -> Iterator[Batch]:
        """Batches in an order that depends only on (seed, epoch); the last partial batch is
        included; ``start_batch`` skips that many batches without producing them."""
        ...

    def eval_batches(self, batch_size: int) -> Iterator[Batch]: ...


def make_data_source(cfg: DataConfig) -> DataSource:
    """The source named by ``cfg.source``, built from its section of the config."""
    if cfg.source == "synthetic":
        from neorec.data.synthetic import SyntheticSource

        return SyntheticSource(cfg.synthetic)
    if cfg.source == "criteo":
        from neorec.data.criteo import CriteoSource

        return CriteoSource(cfg.criteo)
    if cfg.source == "movielens":
        from neorec.data.movielens import MovieLensSource

        return MovieLensSource(cfg.movielens)
    raise ValueError(f"data.source must be one of synthetic, criteo, movielens; got {cfg.source!r}")


# --------------------------------------------------------------------------------- helpers
def one_table_per_feature(
    feature_names: Sequence[str], num_embeddings: Sequence[int], embedding_dim: int, pooling: str
) -> List[TableConfig]:
    """Tables ``t_<feature>`` with ``num_embeddings[i]`` rows for feature ``i``."""
    return [
        TableConfig(name=table_name(feature), num_embeddings=int(rows), embedding_dim=embedding_dim,
                    feature_names=[feature], pooling=pooling)
        for feature, rows in zip(feature_names, num_embeddings)
    ]


def check_batch_args(batch_size: int, epoch: int = 0, start_batch: int = 0) -> None:
    if batch_size <= 0:
        raise ValueError(f"batch_size must be > 0, got {batch_size}")
    if epoch < 0 or start_batch < 0:
        raise ValueError(f"epoch and start_batch must be >= 0, got {epoch} and {start_batch}")


def splitmix64(x: np.ndarray) -> np.ndarray:
    """A stable 64-bit mixing function (SplitMix64's finalizer) of a uint64 array."""
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * np.uint64(0xBF58476D1CE4E5B9)
        x = x ^ (x >> np.uint64(27))
        x = x * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def splitmix64_int(x: int) -> int:
    """``splitmix64`` of one Python int (the scalar reference)."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class EpochOrder:
    """The order in which an epoch visits ``num_rows`` stored rows.

    Without shuffling, file order. With shuffling, the rows are cut into blocks of ``block_rows``
    consecutive rows and the blocks are permuted by a generator seeded by (seed, epoch): memory
    O(num_rows / block_rows) and reads stay local; ``block_rows=1`` is a full permutation.
    """

    def __init__(self, num_rows: int, shuffle: bool, seed: int, epoch: int, block_rows: int = 1) -> None:
        self.num_rows = int(num_rows)
        self.shuffle = shuffle
        self.block_rows = max(1, int(block_rows))
        if shuffle and self.num_rows:
            num_blocks = -(-self.num_rows // self.block_rows)
            rng = np.random.default_rng([int(seed), int(epoch), 0x5EED])
            self._blocks = rng.permutation(num_blocks)
            sizes = np.full(num_blocks, self.block_rows, dtype=np.int64)
            sizes[-1] = self.num_rows - (num_blocks - 1) * self.block_rows
            self._ends = np.cumsum(sizes[self._blocks])  # position after each permuted block

    def rows(self, start: int, stop: int) -> np.ndarray | slice:
        """Stored row indices of epoch positions [start, stop): a slice when in file order."""
        stop = min(stop, self.num_rows)
        if not self.shuffle:
            return slice(start, stop)
        positions = np.arange(start, stop, dtype=np.int64)
        k = np.searchsorted(self._ends, positions, side="right")
        blocks = self._blocks[k]
        last = len(self._blocks) - 1
        sizes = np.where(blocks == last, self.num_rows - last * self.block_rows, self.block_rows)
        return blocks * self.block_rows + positions - (self._ends[k] - sizes)


def batch_ranges(num_rows: int, batch_size: int, start_batch: int = 0) -> Iterator[tuple]:
    """(start, stop) of each batch over ``num_rows`` positions, from batch ``start_batch`` on."""
    for start in range(start_batch * batch_size, num_rows, batch_size):
        yield start, min(start + batch_size, num_rows)
