"""``PrefetchLoader``: prepares the next batches on a background thread while the current one trains.

    with PrefetchLoader(source.train_batches(512), depth=4) as loader:
        for batch in loader:
            ...

Iterating yields the same batches in the same order as iterating ``batches`` directly. An exception
raised while producing a batch is re-raised in the consumer (same exception object, original
traceback kept); iterations side by side each have their own thread and queue, and are independent
when ``batches`` is re-iterable (a list, a source's epoch object); a generator can be iterated
once, so two iterations of one share it (and raise "generator already executing" if they run at
once). Leaving the loop early, ``close()`` or
leaving the ``with`` block stops the thread; nothing hangs. ``depth=0`` iterates in the caller's
thread (no background thread).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Dict, Iterable, Iterator, Tuple

_END = object()
_POLL_SECONDS = 0.05
_JOIN_SECONDS = 5.0


class _ProducerError:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class PrefetchLoader:
    """Iterate ``batches`` with up to ``depth`` items produced ahead by a daemon thread."""

    def __init__(self, batches: Iterable[Any], depth: int = 4) -> None:
        if depth < 0:
            raise ValueError(f"PrefetchLoader depth must be >= 0, got {depth}")
        self._batches = batches
        self.depth = int(depth)
        self._running: Dict[threading.Thread, Tuple[threading.Event, queue.Queue]] = {}  # per iteration

    def __iter__(self) -> Iterator[Any]:
        if self.depth == 0:
            yield from self._batches
            return
        stop = threading.Event()
        items: queue.Queue = queue.Queue(maxsize=self.depth)
        thread = threading.Thread(target=_produce, args=(self._batches, items, stop),
                                  name="neorec-prefetch", daemon=True)
        self._running[thread] = (stop, items)  # iterations side by side each have their own thread
        thread.start()
        try:
            while True:
                item = _get(items, thread)
                if item is _END:
                    return
                if isinstance(item, _ProducerError):
                    raise item.exc
                yield item
        finally:
            # also runs when the consumer breaks out early (the generator is closed)
            if self._running.pop(thread, None) is not None:
                _stop_producer(thread, stop, items)

    def close(self) -> None:
        """Stop the background threads of every iteration and drop the batches they prepared."""
        while self._running:
            thread, (stop, items) = self._running.popitem()
            _stop_producer(thread, stop, items)

    def __enter__(self) -> "PrefetchLoader":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


def _stop_producer(thread: threading.Thread, stop: threading.Event, items: queue.Queue) -> None:
    stop.set()
    if threading.current_thread() is thread:  # pragma: no cover - defensive
        return
    # the producer notices ``stop`` within a poll interval unless it is inside the wrapped
    # iterable; a producer stuck there longer is left behind (it is a daemon thread)
    deadline = time.monotonic() + _JOIN_SECONDS
    while thread.is_alive() and time.monotonic() < deadline:
        _drain(items)
        thread.join(_POLL_SECONDS)
    _drain(items)


def _produce(batches: Iterable[Any], items: queue.Queue, stop: threading.Event) -> None:
    iterator = None
    try:
        iterator = iter(batches)
        for item in iterator:
            if not _put(items, item, stop):
                return
        _put(items, _END, stop)
    except BaseException as exc:  # handed to the consumer, which re-raises it
        _put(items, _ProducerError(exc), stop)
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            try:
                close()
            except Exception:  # pragma: no cover - a generator that fails while closing
                pass


def _put(items: queue.Queue, item: Any, stop: threading.Event) -> bool:
    """Put unless stopped; returns False when the consumer has gone."""
    while not stop.is_set():
        try:
            items.put(item, timeout=_POLL_SECONDS)
            return True
        except queue.Full:
            continue
    return False


def _get(items: queue.Queue, thread: threading.Thread) -> Any:
    while True:
        try:
            return items.get(timeout=_POLL_SECONDS)
        except queue.Empty:
            if not thread.is_alive():
                try:
                    return items.get_nowait()
                except queue.Empty:
                    raise RuntimeError("PrefetchLoader: the producer thread ended without a result") from None


def _drain(items: queue.Queue) -> None:
    while True:
        try:
            items.get_nowait()
        except queue.Empty:
            return
