"""``TrainPipeline``: trains batch i while batch i + 1 is loaded, its input all-to-all is in flight
and, for cached tables, its rows are prefetched (Neo's pipelined training, section 5).

Used by ``Trainer.fit`` by default (``train.pipeline = true``; ``neorec train --no-pipeline`` turns
it off):

    pipeline = TrainPipeline(model, device)
    for batch, size, hooks in pipeline.run(loader):     # loader yields (Batch, global size)
        logits = model(batch.dense, batch.sparse)
        loss = ...
        hooks.after_forward()    # launches the input all-to-all of the NEXT batch (its header)
        loss.backward()
        hooks.after_backward()   # the header is in: launches the ids exchange
        optimizer.step()

The look-ahead, per step i. Batch i + 1 unusable on this rank (it fails to load, or an id of it
lies outside its table, found when its exchange is launched during step i): the rank launches an
empty exchange in its place, so that its collectives keep pairing with the other ranks' (which
launched theirs), step i trains as it would in the plain loop (its checkpoint is not lost), and
the error is raised after it:

1. before batch i is handed out, batch i + 1 is taken from ``items`` (a ``PrefetchLoader`` thread
   prepares it) and moved to the device; every ``CachedEmbeddingBagCollection`` of the model is
   told to prefetch its rows (they load during batch i's forward and backward, pinned, so batch
   i + 1's loads never evict a row batch i still needs: see ``neorec/embedding/cache.py``). A
   sharded rank's cached pieces learn their ids of batch i + 1 from its exchange instead:
   ``hooks.after_backward()`` waits for it and starts their loads (``prefetch_launched``);
2. ``hooks.after_forward()`` (called by the step between its forward and its backward) launches
   batch i + 1's input all-to-all on every ``ShardedEmbeddingBagCollection`` of the model: its
   small header exchange runs during batch i's backward; ``hooks.after_backward()`` then launches
   the ids exchange (sizes come from the header), which runs during the optimizer step and the
   next batch's data wait; batch i + 1's forward picks up the launched exchange instead of starting
   its own. Neither stage blocks on the other ranks when they are in flight long enough.

Why the results are bit-identical to the plain loop: the input all-to-all moves ids, lengths and
per-id weights only, which no update changes; cached rows are prefetched by both loops alike
(``embedding.location.prefetch``, never past the last step): a prefetch decides where a row sits
in the cache and, with a low-precision store, when an evicted row is rounded into it; every rank runs the same sequence of collectives (same order), so the
exchanges match up. Floating-point arithmetic is unchanged, so losses and weights are equal bit
for bit (tested in ``tests/unit/train/test_pipeline.py`` and ``tests/distributed/test_pipeline_and_qcomm.py``).
"""

from __future__ import annotations

import time
from typing import Any, Iterable, Iterator, List, Optional, Tuple

import torch
from torch import nn

from neorec.data.batch import Batch
from neorec.embedding.cache_prefetch import cached_collections
from neorec.sparse.jagged import KeyedJaggedTensor


def empty_batch_like(batch: Batch) -> Batch:
    """A batch of no samples with ``batch``'s features, dtypes and device."""
    sparse = batch.sparse
    kjt = KeyedJaggedTensor(sparse.keys(), sparse.values[:0], sparse.lengths[:0],
                            weights=None if sparse.weights is None else sparse.weights[:0], batch_size=0)
    return Batch(batch.dense[:0], kjt, batch.labels[:0])


def sharded_collections(model: nn.Module) -> List[nn.Module]:
    """Every ``ShardedEmbeddingBagCollection`` inside ``model`` (DDP-wrapped or not)."""
    from neorec.sharding.sharded_collection import ShardedEmbeddingBagCollection

    return [m for m in model.modules() if isinstance(m, ShardedEmbeddingBagCollection)]


def abandon_launched_exchanges(model: nn.Module) -> None:
    """Forget the id exchanges launched ahead for ``model``'s sharded collections without
    completing them: a step failed on this rank, the ranks are no longer in step, the run ends."""
    for collection in sharded_collections(model):
        collection.abandon_launched_input_dist()


def plain_steps(items: Iterable[Tuple[Batch, Any]], device: torch.device | str,
                timeline=None) -> Iterator[Tuple[Batch, Any, None]]:
    """The plain loop's counterpart of ``TrainPipeline.run``: ``(batch on device, extra, None)``,
    no look-ahead; with a ``timeline`` the wait for each batch is its ``data_loading``."""
    iterator = iter(items)
    while True:
        start = time.perf_counter() if timeline is not None else 0.0
        item = next(iterator, None)
        if item is None:
            return
        batch = item[0].to(device)
        if timeline is not None:
            timeline.add("data_loading", time.perf_counter() - start)
        yield batch, item[1], None


class StepHooks:
    """What the step calls: ``after_forward()`` between its forward and backward, and
    ``after_backward()`` between its backward and its optimizer step (both optional, each once)."""

    def __init__(self, pipeline: "TrainPipeline", batch: Optional[Batch]) -> None:
        self._pipeline, self._batch = pipeline, batch
        self._stage = 0
        self.error: Optional[Exception] = None  # batch i + 1's ids were refused: raised after this step

    def after_forward(self) -> None:
        if self._stage != 0:
            raise RuntimeError("TrainPipeline: after_forward() called twice for one step")
        self._stage = 1
        if self._batch is not None:
            self.error = self._pipeline._launch(self._batch)

    def after_backward(self) -> None:
        if self._stage != 1:
            raise RuntimeError("TrainPipeline: after_backward() needs one after_forward() before it")
        self._stage = 2
        if self._batch is not None:
            self._pipeline._progress()


class TrainPipeline:
    """One-batch look-ahead over the training batches of ``model``.

    Args:
        model: the model being trained (plain, sharded, DDP-wrapped; cached tables allowed).
        device: where batches go before the step (``Batch.to``).
        timeline: optional ``StepTimeline``; the time spent waiting for the next batch is added to
            its ``data_loading`` phase and the launch of the next input all-to-all to ``input_dist``.
        prefetch_cached_rows: tell cached collections to prefetch the next batch's rows (the
            trainer passes ``embedding.location.prefetch``, which the plain loop follows too).
    """

    def __init__(self, model: nn.Module, device: torch.device | str, timeline=None,
                 prefetch_cached_rows: bool = True) -> None:
        self.model = model
        self.device = torch.device(device)
        self.timeline = timeline
        self._sharded = sharded_collections(model)
        # a sharded rank's cached pieces learn batch i + 1's ids from its look-ahead exchange
        inner = {id(c.cached) for c in self._sharded if c.cached is not None}
        self._cached = [c for c in cached_collections(model) if c.caches and id(c) not in inner] \
            if prefetch_cached_rows else []
        self._prefetch_pieces = prefetch_cached_rows and len(inner) > 0
        self.num_launched = 0  # input all-to-alls launched ahead (for tests and reports)

    def run(self, items: Iterable[Tuple[Batch, Any]],
            max_items: Optional[int] = None) -> Iterator[Tuple[Batch, Any, StepHooks]]:
        """Yield ``(batch on device, extra, hooks)`` for every ``(batch, extra)`` of ``items`` (at
        most ``max_items``: nothing is loaded or exchanged past them), in order. The step calls
        ``hooks.after_forward()`` between its forward and its backward and
        ``hooks.after_backward()`` before its optimizer step (skipping them is allowed: the next
        forward then does the rest of the exchange itself)."""
        if max_items is not None and max_items <= 0:
            return
        iterator = iter(items)
        current = self._next(iterator)
        count = 1
        try:
            while current is not None:
                following, error = None, None
                if max_items is None or count < max_items:
                    try:
                        following = self._next(iterator)
                    except Exception as exc:  # batch i + 1 failed to load: batch i trains first, as in
                        error = exc           # the plain loop (its step and checkpoint are not lost)
                count += 1
                if following is not None:
                    for collection in self._cached:
                        collection.prefetch(following[0].sparse)
                    hooks = StepHooks(self, following[0] if self._sharded else None)
                elif error is not None and self._sharded:
                    # the other ranks launch batch i + 1's exchange during step i: this rank launches
                    # an empty one, so that its collectives keep pairing with theirs (without it, step
                    # i's gradient all-to-all met their header exchange: gloo aborted them, or the
                    # bytes were swapped) and this rank's own error is the one reported
                    hooks = StepHooks(self, empty_batch_like(current[0]))
                else:
                    hooks = StepHooks(self, None)
                yield current[0], current[1], hooks
                if error is None:
                    error = hooks.error
                if error is not None:
                    raise error
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

    def _launch(self, batch: Batch) -> Optional[Exception]:
        """Launch ``batch``'s exchanges; where its ids are refused (checked before anything is sent),
        an empty exchange in its place: the refusal is returned, to be raised after this step."""
        start = time.perf_counter() if self.timeline is not None else 0.0
        error = None
        for collection in self._sharded:
            if error is None:
                try:
                    collection.launch_input_dist(batch.sparse)
                    continue
                except ValueError as exc:
                    error = exc
            collection.launch_input_dist(empty_batch_like(batch).sparse)
        self.num_launched += 1
        if self.timeline is not None:
            self.timeline.add("input_dist", time.perf_counter() - start)
        return error

    def _progress(self) -> None:
        start = time.perf_counter() if self.timeline is not None else 0.0
        for collection in self._sharded:
            collection.progress_launched_input_dist()
        if self._prefetch_pieces:  # (every exchange launched before any is waited for)
            for collection in self._sharded:
                collection.prefetch_launched()
        if self.timeline is not None:
            self.timeline.add("input_dist", time.perf_counter() - start)

    def close(self) -> None:
        """Complete and drop input all-to-alls launched for batches that will not run (the loop
        stopped early). Every rank stops at the same step, so the exchanges still match; after a
        failed step the trainer abandons them first (``abandon_launched_exchanges``)."""
        for collection in self._sharded:
            collection.drop_launched_input_dist()
