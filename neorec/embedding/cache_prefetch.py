"""Prefetching the rows of cached tables one batch ahead, for a training loop:
``with_prefetch(batches, model)`` names batch ``i + 1`` to every ``CachedEmbeddingBagCollection``
of ``model`` before batch ``i`` is handed out (``CachedEmbeddingBagCollection.prefetch``).
"""

from __future__ import annotations

import itertools
from typing import List, Optional

from torch import nn

from neorec.embedding.cached import CachedEmbeddingBagCollection


def cached_collections(model: nn.Module) -> List[CachedEmbeddingBagCollection]:
    """Every ``CachedEmbeddingBagCollection`` inside ``model``."""
    return [m for m in model.modules() if isinstance(m, CachedEmbeddingBagCollection)]


def with_prefetch(items, model: nn.Module, sparse_of=lambda batch: batch.sparse, max_items: Optional[int] = None):
    """Yield ``items`` (batches, or anything ``sparse_of`` maps to a KeyedJaggedTensor) one ahead:
    before item ``i`` is yielded, the cached collections of ``model`` are told to prefetch the rows
    of item ``i + 1`` (loaded while ``i`` trains). At most ``max_items`` are yielded and nothing is
    prefetched past them (a prefetch moves rows in the cache, and rounds those it evicts into a
    low-precision store). Item ``i + 1`` failing to load is raised after item ``i`` has been used.
    Without cached tables items pass through."""
    collections = [c for c in cached_collections(model) if c.caches]
    iterator = iter(items) if max_items is None else itertools.islice(items, max_items)  # none past max_items
    current = next(iterator, None)
    while current is not None:
        following, error = None, None
        try:
            following = next(iterator, None)
        except Exception as exc:
            error = exc
        if following is not None:
            for collection in collections:
                collection.prefetch(sparse_of(following))
        yield current
        if error is not None:
            raise error
        current = following
