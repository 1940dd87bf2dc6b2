"""How a run is stopped by a signal: SIGTERM / SIGHUP (what ``timeout``, a batch scheduler or
``docker stop`` send) raise ``Terminated`` as Ctrl-C raises KeyboardInterrupt, so that a stopped
run ends through the same report (the step it stopped after, the checkpoint to resume from).

- ``terminate_raises()``: the handlers, for a block (a single-process ``neorec train`` from its
  model build on; the ``--nproc`` launcher while it watches its ranks).
- ``check_terminated()``: raises ``Terminated`` when a signal came whose exception was lost (the
  trainer calls it at every step).
- ``signals_held()``: clean-up that a second signal must not cut short (stopping the ranks,
  removing a half-made store); a signal that comes meanwhile is raised when it is done.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator, List

_STOPS = (signal.SIGTERM, signal.SIGHUP)


class Terminated(BaseException):
    """SIGTERM or SIGHUP was received (while ``terminate_raises`` was in force). Like
    KeyboardInterrupt, not an ``Exception``: an ``except Exception`` meant for errors (a batch that
    failed to load, a library's fallback) does not take a stop for one."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_received: List[int] = []  # the signals ``terminate_raises`` took, in order


def _raise_terminated(signum, frame) -> None:
    _received.append(signum)
    raise Terminated(signum)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _restore(previous: dict) -> None:
    for signum, handler in previous.items():  # (None: a handler not set from Python; the default then)
        signal.signal(signum, signal.SIG_DFL if handler is None else handler)


@contextlib.contextmanager
def terminate_raises() -> Iterator[None]:
    """SIGTERM / SIGHUP raise ``Terminated`` in the main thread within. The previous handlers come
    back on leaving. Off the main thread, where no handler can be installed, a no-op."""
    if not _in_main_thread():
        yield
        return
    _received.clear()
    previous = {signum: signal.signal(signum, _raise_terminated) for signum in _STOPS}
    try:
        yield
    finally:
        _restore(previous)
        _received.clear()


def check_terminated() -> None:
    """Raise ``Terminated`` if SIGTERM / SIGHUP came within ``terminate_raises``: the trainer calls it
    at every step. A handler's exception can be lost: Python runs a handler wherever the main thread
    is, and one raised inside a finalizer (``__del__``, a weakref callback, a generator closed by the
    garbage collector) is only printed; code that catches broadly drops it. (A CI run trained on
    for a minute after its SIGTERM, without a word; where its exception went was not found.)"""
    if _received:
        raise Terminated(_received[0])


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Ctrl-C, SIGTERM and SIGHUP wait until the block is done (a second signal raised inside
    clean-up left it half done: ranks running, a temporary store of a table's size on disk); the
    first of them is then delivered to the handler in force before (raised, or the default action).
    Off the main thread a no-op."""
    if not _in_main_thread():
        yield
        return
    held: List[int] = []
    previous = {signum: signal.signal(signum, lambda signum, frame: held.append(signum))
                for signum in (signal.SIGINT, *_STOPS)}
    try:
        yield
    finally:
        _restore(previous)
    if held:
        signal.raise_signal(held[0])
