"""``TrainPipeline``: trains batch i while batch i + 1 is loaded, its input all-to-all is in flight
and, for cached tables, its rows are prefetched (Neo's pipelined training, section 5).

Used by ``Trainer.fit`` by default (``train.pipeline = true``; ``neorec train --no-pipeline`` turns
it off):

    pipeline = TrainPipeline(model, device)
    for batch, size, after_forward in pipeline.run(loader):     # loader yields (Batch, global size)
        logits = model(batch.dense, batch.sparse)
        loss = ...
        after_forward()          # launches the input all-to-all of the NEXT batch
        loss.backward(); optimizer.step()
    pipeline.close()

The look-ahead, per step i:

1. before batch i is handed out, batch i + 1 is taken from ``items`` (a ``PrefetchLoader`` thread
   prepares it) and moved to the device; every ``CachedEmbeddingBagCollection`` of the model is
   told to prefetch its rows (they load during batch i's forward and backward, pinned, so batch
   i + 1's loads never evict a row batch i still needs: see ``neorec/embedding/cache.py``);
2. ``after_forward()`` (called by the step between its forward and its backward) launches batch
   i + 1's input all-to-all on every ``ShardedEmbeddingBagCollection`` of the model; the id
   exchange runs while batch i's backward and optimizer run, and batch i + 1's forward picks up
   the launched exchange instead of starting its own.

Why the results are bit-identical to the plain loop: the input all-to-all moves ids, lengths and
per-id weights only, which no update changes; the prefetch only decides where a row sits in the
cache, never its value; every rank runs the same sequence of collectives (same order), so the
exchanges match up. Floating-point arithmetic is unchanged, so losses and weights are equal bit
for bit (tested in ``tests/unit/train/test_pipeline.py`` and ``tests/distributed/test_pipeline.py``).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Iterator, List, Optional, Tuple

import torch
from torch import nn

from neorec.data.batch import Batch
from neorec.embedding.cached import cached_collections


def sharded_collections(model: nn.Module) -> List[nn.Module]:
    """Every ``ShardedEmbeddingBagCollection`` inside ``model`` (DDP-wrapped or not)."""
    from neorec.sharding.sharded_collection import ShardedEmbeddingBagCollection

    return [m for m in model.modules() if isinstance(m, ShardedEmbeddingBagCollection)]


def _no_op() -> None:
    return None


class TrainPipeline:
    """One-batch look-ahead over the training batches of ``model``.

    Args:
        model: the model being trained (plain, sharded, DDP-wrapped; cached tables allowed).
        device: where batches go before the step (``Batch.to``).
        timeline: optional ``StepTimeline``; the time spent waiting for the next batch is added to
            its ``data_loading`` phase and the launch of the next input all-to-all to ``input_dist``.
        prefetch_cached_rows: tell cached collections to prefetch the next batch's rows (on by
            default; the plain loop does it only with ``embedding.location.prefetch``).
    """

    def __init__(self, model: nn.Module, device: torch.device | str, timeline=None,
                 prefetch_cached_rows: bool = True) -> None:
        self.model = model
        self.device = torch.device(device)
        self.timeline = timeline
        self._sharded = sharded_collections(model)
        self._cached = [c for c in cached_collections(model) if c.caches] if prefetch_cached_rows else []
        self.num_launched = 0  # input all-to-alls launched ahead (for tests and reports)

    def run(self, items: Iterable[Tuple[Batch, Any]]) -> Iterator[Tuple[Batch, Any, Callable[[], None]]]:
        """Yield ``(batch on device, extra, after_forward)`` for every ``(batch, extra)`` of
        ``items``, in order. The caller must call ``after_forward()`` once between the step's
        forward and its backward (not calling it is allowed: the next forward then exchanges its
        ids itself)."""
        iterator = iter(items)
        current = self._next(iterator)
        try:
            while current is not None:
                following = self._next(iterator)
                if following is not None:
                    for collection in self._cached:
                        collection.prefetch(following[0].sparse)
                    hook = self._launcher(following[0]) if self._sharded else _no_op
                else:
                    hook = _no_op
                yield current[0], current[1], hook
                current = following
        finally:
            self.close()

    def _next(self, iterator: Iterator) -> Optional[Tuple[Batch, Any]]:
        start = time.perf_counter() if self.timeline is not None else 0.0
        item = next(iterator, None)
        if item is not None:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], Batch)):
                raise TypeError(f"TrainPipeline.run expects (Batch, extra) pairs, got {type(item).__name__}")
            item = (item[0].to(self.device), item[1])
        if self.timeline is not None:
            self.timeline.add("data_loading", time.perf_counter() - start)
        return item

    def _launcher(self, batch: Batch) -> Callable[[], None]:
        done = []

        def launch() -> None:
            if done:
                raise RuntimeError("TrainPipeline: after_forward() called twice for one step")
            done.append(True)
            start = time.perf_counter() if self.timeline is not None else 0.0
            for collection in self._sharded:
                collection.launch_input_dist(batch.sparse)
            self.num_launched += 1
            if self.timeline is not None:
                self.timeline.add("input_dist", time.perf_counter() - start, exposed=True)

        return launch

    def close(self) -> None:
        """Complete and drop input all-to-alls launched for batches that will not run (the loop
        stopped early). Every rank stops at the same step, so the exchanges still match."""
        for collection in self._sharded:
            collection.drop_launched_input_dist()
