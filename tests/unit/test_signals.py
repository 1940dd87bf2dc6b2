"""neorec.signals: SIGTERM / SIGHUP raise ``Terminated`` (not an ``Exception``); a signal whose
exception was lost is raised by ``check_terminated``; ``signals_held`` lets clean-up finish before
a second signal is raised.

    python -m pytest tests/unit/test_signals.py -q
"""

import os
import signal

import pytest

from neorec.signals import Terminated, check_terminated, signals_held, terminate_raises


def test_terminated_is_a_stop_not_an_error():
    """An ``except Exception`` meant for a failed batch load took a SIGTERM for one."""
    assert issubclass(Terminated, BaseException) and not issubclass(Terminated, Exception)
    assert str(Terminated(signal.SIGTERM)) == "SIGTERM" and Terminated(signal.SIGHUP).signum == signal.SIGHUP


def test_a_lost_terminated_is_raised_at_the_next_check_and_forgotten_on_leaving():
    before = signal.getsignal(signal.SIGTERM)
    with terminate_raises():
        check_terminated()  # nothing came
        try:
            os.kill(os.getpid(), signal.SIGTERM)
        except Terminated:
            pass  # lost, as in a finalizer
        with pytest.raises(Terminated, match="SIGTERM"):
            check_terminated()
    check_terminated()  # a later run in this process starts afresh
    assert signal.getsignal(signal.SIGTERM) == before


@pytest.mark.parametrize("signum, raised", [(signal.SIGTERM, Terminated), (signal.SIGHUP, Terminated),
                                            (signal.SIGINT, KeyboardInterrupt)])
def test_a_signal_during_held_clean_up_is_raised_once_it_is_done(signum, raised):
    done = []
    with terminate_raises():
        with pytest.raises(raised):
            with signals_held():
                os.kill(os.getpid(), signum)
                done.append("the clean-up went on")
        assert done == ["the clean-up went on"]
        with signals_held():
            pass  # nothing held: nothing raised


def test_a_signal_held_by_a_block_that_fails_gives_way_to_its_error_and_is_checked_later():
    with terminate_raises():
        with pytest.raises(ValueError, match="the block's own"):
            with signals_held():
                os.kill(os.getpid(), signal.SIGTERM)
                raise ValueError("the block's own error")
        with pytest.raises(Terminated):
            check_terminated()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers back


def test_a_lost_ctrl_c_is_raised_at_the_next_check():
    with terminate_raises():
        try:
            os.kill(os.getpid(), signal.SIGINT)
        except KeyboardInterrupt:
            pass  # lost, as in a finalizer
        with pytest.raises(KeyboardInterrupt):
            check_terminated()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.parametrize("swap", [1, 2, 3])
def test_a_signal_handled_while_the_handlers_are_swapped_leaves_none_half_swapped(monkeypatch, swap):
    """``signal.signal`` first runs the handlers of signals pending; one that raised stopped the swaps
    half way: the block never ran, and a holder stayed installed for good (a later Ctrl-C did nothing)."""
    import neorec.signals as signals

    real, calls = signal.signal, []

    def swap_with_a_signal_pending(signum, handler):
        calls.append(signum)
        if len(calls) == swap:
            os.kill(os.getpid(), signal.SIGTERM)  # its handler runs in this swap
        return real(signum, handler)

    originals = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    with terminate_raises():
        inside = {s: signal.getsignal(s) for s in originals}
        monkeypatch.setattr(signals.signal, "signal", swap_with_a_signal_pending)
        done = []
        with pytest.raises(Terminated):
            with signals_held():
                done.append("the clean-up ran")
        monkeypatch.setattr(signals.signal, "signal", real)
        assert done == ["the clean-up ran"]
        assert {s: signal.getsignal(s) for s in originals} == inside
    assert {s: signal.getsignal(s) for s in originals} == originals


def test_a_second_ctrl_c_while_a_half_made_store_is_removed_leaves_no_temporary(tmp_path, monkeypatch):
    """A second Ctrl-C cut the removal of a store whose build was stopped short: its temporary folder,
    a file the size of the table, stayed until a later build of the same store."""
    import neorec.embedding.ssd_store as ssd_store

    real = ssd_store.shutil.rmtree

    def interrupted_rmtree(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # the second Ctrl-C
        return real(*args, **kwargs)

    monkeypatch.setattr(ssd_store.shutil, "rmtree", interrupted_rmtree)

    def fill(store):
        raise KeyboardInterrupt  # the first

    with pytest.raises(KeyboardInterrupt):
        ssd_store.SsdRowStore.create(tmp_path / "t", 1000, 8, fill=fill)
    assert [p.name for p in tmp_path.iterdir()] == [".t.lock"]
