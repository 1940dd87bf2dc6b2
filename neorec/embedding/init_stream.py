"""The initial rows of embedding tables, shared by every place that must start from the same rows:
``TableBatchedEmbeddingBags`` (its tables), ``CachedEmbeddingBagCollection`` (rows drawn into row
stores) and ``ShardedEmbeddingBagCollection.load_initial_weights`` (a rank's pieces of the unsharded
tables).

Table ``t`` is uniform in +-sqrt(1 / rows). Its rows come in blocks of ``block_rows(dim)`` rows
(``INIT_CHUNK`` values); block ``k`` is drawn by a counter-based generator of its own (numpy's PCG64,
seeded by ``SeedSequence(seed, spawn_key=(hash of the table's name, k))``). So any rows of any table
can be drawn without drawing the rows before them: a rank draws only the rows of its own pieces, and
a table's rows depend on the seed, its name, its row count and its width only, not on the other
tables or their order. The block size is part of the values (another ``INIT_CHUNK`` draws others).
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Callable, Iterator, List, Optional, Tuple

import numpy as np
import torch

from neorec.embedding.config import TableConfig

INIT_CHUNK = 1 << 22  # values per block (bounds the fp32 temporary: 16 MiB)
_observers: List[Callable[[int], None]] = []  # called with the bytes of every block drawn


@contextlib.contextmanager
def observing_draws(callback: Callable[[int], None]) -> Iterator[None]:
    """Within the ``with``, ``callback(nbytes)`` follows every block of initial rows drawn (fp32
    bytes): a progress bar for building large models."""
    _observers.append(callback)
    try:
        yield
    finally:
        _observers.remove(callback)


def block_rows(dim: int) -> int:
    """Rows per block of a table ``dim`` wide."""
    return max(1, INIT_CHUNK // dim)


def _name_key(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


class TableInit:
    """Table ``table``'s initial rows for ``seed`` (fp32), any range of them on demand."""

    def __init__(self, seed: int, table: TableConfig) -> None:
        self.seed = int(seed) % (1 << 64)  # SeedSequence takes non-negative entropy
        self.name, self.key = table.name, _name_key(table.name)
        self.rows_total, self.dim = table.num_embeddings, table.embedding_dim
        self.bound = np.float32((1.0 / table.num_embeddings) ** 0.5)
        self.block = block_rows(self.dim)
        self._last: Tuple[int, Optional[np.ndarray]] = (-1, None)  # the block drawn last, kept for the next call

    def _block(self, k: int) -> np.ndarray:
        """Block ``k``'s rows, [rows, dim] float32."""
        if self._last[0] != k:
            rows = min(self.block, self.rows_total - k * self.block)
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(self.seed, spawn_key=(self.key, k))))
            values = rng.random(rows * self.dim, dtype=np.float32)
            values *= np.float32(2.0) * self.bound
            values -= self.bound
            self._last = (k, values.reshape(rows, self.dim))
            for observe in _observers:
                observe(values.nbytes)
        return self._last[1]

    def blocks(self, lo: int = 0, hi: Optional[int] = None) -> Iterator[Tuple[int, torch.Tensor]]:
        """(first row, fp32 rows [n, dim]) covering rows ``lo .. hi`` (default: to the end), at most
        one block at a time. The tensors are views of the block kept for the next call: read them,
        do not write into them."""
        hi = self.rows_total if hi is None else hi
        if not 0 <= lo <= hi <= self.rows_total:
            raise ValueError(f"rows {lo}..{hi} are outside the table's {self.rows_total} rows")
        row = lo
        while row < hi:
            k = row // self.block
            end = min(hi, (k + 1) * self.block)
            yield row, torch.from_numpy(self._block(k)[row - k * self.block : end - k * self.block])
            row = end

    def rows(self, lo: int, hi: int) -> torch.Tensor:
        """A copy of rows ``lo .. hi``, fp32 [hi - lo, dim]."""
        parts = [block.clone() for _, block in self.blocks(lo, hi)]
        if not parts:
            return torch.empty(0, self.dim)
        return parts[0] if len(parts) == 1 else torch.cat(parts)
