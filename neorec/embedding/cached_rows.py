"""The rows of a ``CachedEmbeddingBagCollection`` between steps, by table: copies of a table and its
optimizer state, reads and writes of rows where training sees them (resident ones in their slot,
the others in the store), initial rows, and which rows training updated. The trainer's
checkpoints (``neorec/train/checkpoint_tables.py``, ``CachedPieces``) and the tests go through
these; ``CachedRows`` is the part of the collection that serves them.
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional, Tuple

import torch

from neorec.embedding.cache import SetAssociativeCache
from neorec.embedding.config import TableConfig
from neorec.embedding.tbe import TableBatchedEmbeddingBags


class CachedRows:
    """Row access of ``CachedEmbeddingBagCollection`` (a mixin: it uses the collection's
    ``tables``, ``caches``, ``locations``, ``tbe`` / ``host_tbe`` and its step bookkeeping)."""

    def _check_table(self, name: str) -> TableConfig:
        if name not in self._table_of:
            raise ValueError(f"no table named {name!r}; tables are {[t.name for t in self.tables]}")
        return self._table_of[name]

    def _module_of(self, name: str) -> TableBatchedEmbeddingBags:
        return self.host_tbe if name in self._host_names() else self.tbe

    @torch.no_grad()
    def table_weight(self, name: str) -> torch.Tensor:
        """fp32 copy [num_embeddings, embedding_dim] of table ``name`` as the model sees it (cached
        rows from the cache, the others from the store), in host memory for every table (a cached
        table may be larger than the device's)."""
        table = self._check_table(name)
        if name not in self.caches:
            return self._module_of(name).get_table_weight(name, device="cpu")
        cache = self.caches[name]
        resident = cache.resident()
        out = torch.empty(table.num_embeddings, table.embedding_dim)
        for ids in torch.arange(table.num_embeddings).split(1 << 16):  # bounded store reads
            out[ids[0] : ids[-1] + 1] = cache.read(ids, resident, with_state=False)[0]
        return out

    @torch.no_grad()
    def optimizer_state(self, name: str) -> Dict[str, torch.Tensor]:
        """Copies of table ``name``'s optimizer state: {"momentum1": [rows] or [rows, dim], ...}, in
        host memory (as ``table_weight``)."""
        table = self._check_table(name)
        if name not in self.caches:
            return self._module_of(name).get_optimizer_state(name, device="cpu")
        return self.caches[name].read(torch.arange(table.num_embeddings))[1]

    @torch.no_grad()
    def init_rows(self, name: str, start: int, rows: torch.Tensor) -> None:
        """Set rows ``start ..`` of cached table ``name`` as initial rows, before it trains: rounded
        to nearest into the store (as its own fill does), optimizer state at its initial value,
        access counts 0; the table's cache must hold none of them."""
        cache = self._cache_of(name)
        if bool(((cache.slot_rows >= start) & (cache.slot_rows < start + rows.shape[0])).any()):
            raise RuntimeError(f"init_rows({name!r}): some of rows {start}.. are in the cache; initialise "
                               "rows before training")
        cache.store.write_range(start, rows.to("cpu", torch.float32).contiguous(),
                                {n: torch.full((rows.shape[0], w), self._initial_state)
                                 for n, w in cache.store.format.state})

    def resident(self, name: str) -> Tuple[torch.Tensor, torch.Tensor]:
        """(rows, slots) of cached table ``name``'s resident rows: ``SetAssociativeCache.resident``."""
        return self._cache_of(name).resident()

    @torch.no_grad()
    def read_rows(self, name: str, ids: torch.Tensor, resident: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
                  ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """(rows [n, dim], optimizer state) of rows ``ids`` of cached table ``name``, fp32 copies in
        host memory, as training sees them (resident rows from their slot, the others from the
        store). ``resident``: ``resident(name)``, computed once for many reads between steps."""
        return self._cache_of(name).read(ids, resident)

    @torch.no_grad()
    def write_rows(self, name: str, ids: torch.Tensor, rows: torch.Tensor,
                   state: Optional[Mapping[str, torch.Tensor]] = None,
                   resident: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> None:
        """Set the distinct rows ``ids`` of cached table ``name`` (and their optimizer state, every
        field; None: it stays): in its store, rounded to the store's precision, and in their slot
        when resident (``SetAssociativeCache.write``). Between steps only. The rows are not marked
        as modified (``track_modified_rows`` marks training's updates only)."""
        if self._pending_update:
            raise RuntimeError("write_rows between a forward and its backward; write rows between steps")
        self._cache_of(name).write(ids, rows, state, resident)

    def track_modified_rows(self, enabled: bool = True) -> None:
        """Start (or stop) marking the rows each training step updates, of every table (cleared
        now): cached tables' rows are marked when a training forward looks them up, the others by
        their fused module (``TableBatchedEmbeddingBags.track_modified_rows``)."""
        for module in (self.tbe, self.host_tbe):
            if module is not None:
                module.track_modified_rows(enabled)
        self._modified = ({name: torch.zeros(self._table_of[name].num_embeddings, dtype=torch.bool)
                           for name in self.caches} if enabled else None)

    def take_modified_rows(self, name: str) -> torch.Tensor:
        """[K] int64 ascending rows of table ``name`` updated since tracking started or since this
        table's last take (its marks are cleared), for any table of the collection."""
        self._check_table(name)
        if name not in self.caches:
            return self._module_of(name).take_modified_rows(name)
        if self._modified is None:
            raise ValueError("take_modified_rows: call track_modified_rows() first")
        marks = self._modified[name]
        rows = marks.nonzero().squeeze(1)
        marks.zero_()
        return rows

    def count_modified_rows(self, name: str) -> int:
        """How many rows ``take_modified_rows(name)`` would return (the marks stay)."""
        self._check_table(name)
        if name not in self.caches:
            return self._module_of(name).count_modified_rows(name)
        if self._modified is None:
            raise ValueError("count_modified_rows: call track_modified_rows() first")
        return int(self._modified[name].sum())

    def _cache_of(self, name: str) -> SetAssociativeCache:
        self._check_table(name)
        if name not in self.caches:
            raise ValueError(f"table {name!r} is not cached (its location is {self.locations[name].kind!r})")
        return self.caches[name]
