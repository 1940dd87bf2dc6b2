"""How a run is stopped by a signal: SIGTERM / SIGHUP (what ``timeout``, a batch scheduler or
``docker stop`` send) raise ``Terminated`` as Ctrl-C raises KeyboardInterrupt, so that a stopped
run ends through the same report (the step it stopped after, the checkpoint to resume from).

- ``terminate_raises()``: the handlers, for a block (a single-process ``neorec train`` from its
  model build on; the ``--nproc`` launcher while it watches its ranks).
- ``check_terminated()``: raises the stop again when a signal came whose exception was lost (the
  trainer calls it at every step, the launcher at every poll).
- ``signals_held()``: clean-up that a second signal must not cut short (stopping the ranks,
  removing a half-made store); a signal that comes meanwhile is raised when it is done.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Callable, Dict, Iterator, List, Optional, Tuple

_STOPS = (signal.SIGTERM, signal.SIGHUP)
_ALL = (signal.SIGINT, *_STOPS)


class Terminated(BaseException):
    """SIGTERM or SIGHUP was received (while ``terminate_raises`` was in force). Like
    KeyboardInterrupt, not an ``Exception``: an ``except Exception`` meant for errors (a batch that
    failed to load, a library's fallback) does not take a stop for one."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_received: List[int] = []  # the signals ``terminate_raises`` took, in order
_in_force = [0]  # how many ``terminate_raises`` blocks are open


def _stop_for(signum: int) -> BaseException:
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)


def _raise_stop(signum, frame) -> None:
    _received.append(signum)
    raise _stop_for(signum)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _install(handlers: Dict[int, Callable]) -> Tuple[Dict[int, Callable], Optional[BaseException]]:
    """Install ``{signum: handler}``; returns the handlers they replace and the stop that a pending
    signal raised meanwhile. ``signal.signal`` first runs the handlers of signals pending, and one
    that raises leaves that swap undone (the swaps stopped half way, a handler of the block left in
    place for good): here the swap is tried again and every one is made."""
    previous, raised = {}, None
    for signum, handler in handlers.items():
        handler = signal.SIG_DFL if handler is None else handler  # (None: one not set from Python)
        while True:
            try:
                previous[signum] = signal.signal(signum, handler)
                break
            except (KeyboardInterrupt, Terminated) as exc:
                raised = raised or exc
    return previous, raised


@contextlib.contextmanager
def terminate_raises() -> Iterator[None]:
    """SIGTERM / SIGHUP raise ``Terminated`` in the main thread within; the signals are recorded for
    ``check_terminated``, and so is Ctrl-C where it raises KeyboardInterrupt (Python's own handler
    is in force). The previous handlers come back on leaving. Off the main thread, where no handler
    can be installed, a no-op."""
    if not _in_main_thread():
        yield
        return
    _received.clear()
    recorded = _STOPS + ((signal.SIGINT,) if signal.getsignal(signal.SIGINT) is signal.default_int_handler else ())
    previous, first = _install(dict.fromkeys(recorded, _raise_stop))
    _in_force[0] += 1
    try:
        if first is not None:
            raise first
        yield
    finally:
        _in_force[0] -= 1
        _, late = _install(previous)
        _received.clear()
    if late is not None:  # (the block ended; a signal came as its handlers were taken away)
        raise late


def check_terminated() -> None:
    """Raise the stop (``Terminated``, or KeyboardInterrupt for Ctrl-C) of the first signal that came
    within ``terminate_raises``. A handler's exception can be lost: Python runs a handler wherever
    the main thread is, and one raised inside a finalizer (``__del__``, a weakref callback, a
    generator closed by the garbage collector) is only printed; code that catches broadly drops it.
    (A CI run trained on for a minute after its SIGTERM, without a word; where its exception went
    was not found.)"""
    if _received:
        raise _stop_for(_received[0])


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Ctrl-C, SIGTERM and SIGHUP wait until the block is done (a second signal raised inside
    clean-up left it half done: ranks running, a temporary store of a table's size on disk); the
    first of them is then delivered to the handler in force before (raised, or the default action).
    When the block fails, its error goes on and the signals are recorded for ``check_terminated``.
    Off the main thread a no-op."""
    if not _in_main_thread():
        yield
        return
    held: List[int] = []
    previous, first = _install(dict.fromkeys(_ALL, lambda signum, frame: held.append(signum)))
    try:
        yield
    except BaseException:
        if _in_force[0]:
            _received.extend(held)
        raise
    finally:
        _, late = _install(previous)
    if first is not None or late is not None:  # (a stop pending as the handlers were swapped)
        raise first if first is not None else late
    if held:
        signal.raise_signal(held[0])
