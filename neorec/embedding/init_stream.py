"""The random stream that initialises embedding tables, shared by every place that must start
from the same rows: ``TableBatchedEmbeddingBags`` (its tables), ``CachedEmbeddingBagCollection``
(rows drawn into row stores) and ``ShardedEmbeddingBagCollection.load_initial_weights`` (a rank's
pieces of the unsharded tables).

One ``torch.Generator`` seeded with the init seed draws the tables in order; table ``t`` is
uniform in +-sqrt(1 / rows), ``INIT_CHUNK`` values per ``uniform_`` call from the table's start
(the chunking is part of the stream: other chunk sizes draw other values).
"""

from __future__ import annotations

import torch

from neorec.embedding.config import TableConfig

INIT_CHUNK = 1 << 22  # values generated per uniform_ call (bounds the fp32 temporary)


class InitStream:
    """One table's initial values, in row-major order, handed out in slices of any size."""

    def __init__(self, generator: torch.Generator, table: TableConfig) -> None:
        self.generator, self.bound = generator, (1.0 / table.num_embeddings) ** 0.5
        self.remaining = table.num_embeddings * table.embedding_dim
        self.buffer = torch.empty(0)

    def take(self, count: int) -> torch.Tensor:
        """The next ``count`` values (fp32, 1-D)."""
        parts, need = [], count
        while need:
            if self.buffer.numel() == 0:
                size = min(INIT_CHUNK, self.remaining)
                self.buffer = torch.empty(size).uniform_(-self.bound, self.bound, generator=self.generator)
                self.remaining -= size
            part, self.buffer = self.buffer[:need], self.buffer[need:]
            parts.append(part)
            need -= part.numel()
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def skip(self) -> None:
        """Draw and drop the rest of the table (the next table's stream starts after it)."""
        while self.remaining:
            self.take(min(INIT_CHUNK, self.remaining))
        self.buffer = torch.empty(0)
