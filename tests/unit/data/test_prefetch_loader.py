"""PrefetchLoader: same items in the same order, producer errors re-raised, no hang on early exit."""

import threading
import time
import traceback

import pytest

from neorec.data import PrefetchLoader

DEADLINE = 10.0  # seconds: every test here finishes far sooner unless something hangs


def run_with_deadline(fn):
    """Run fn in a thread; fail (instead of hanging the suite) if it has not returned in time."""
    result = {}

    def target():
        try:
            result["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            result["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(DEADLINE)
    assert not thread.is_alive(), "PrefetchLoader hung"
    if "error" in result:
        raise result["error"]
    return result.get("value")


@pytest.mark.parametrize("depth", [0, 1, 4])
def test_same_items_in_the_same_order(depth):
    items = list(range(100))
    assert run_with_deadline(lambda: list(PrefetchLoader(iter(items), depth=depth))) == items
    loader = PrefetchLoader(items, depth=depth)  # a re-iterable input can be iterated again
    assert run_with_deadline(lambda: list(loader) + list(loader)) == items + items


def test_runs_ahead_on_another_thread():
    threads = []

    def produce():
        for i in range(3):
            threads.append(threading.current_thread())
            yield i

    with PrefetchLoader(produce(), depth=2) as loader:
        assert run_with_deadline(lambda: list(loader)) == [0, 1, 2]
    assert all(t is not threading.current_thread() for t in threads)


def failing_producer():
    yield 1
    yield 2
    raise KeyError("batch 3 is broken")


def test_producer_exception_is_reraised_with_its_traceback():
    def consume():
        seen = []
        with pytest.raises(KeyError, match="batch 3 is broken") as info:
            for item in PrefetchLoader(failing_producer(), depth=4):
                seen.append(item)
        return seen, info

    seen, info = run_with_deadline(consume)
    assert seen == [1, 2]
    frames = [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]
    assert "failing_producer" in frames  # the original frames are kept


def test_early_exit_stops_the_thread_and_closes_the_producer():
    state = {"produced": 0, "closed": False}

    def endless():
        try:
            while True:
                state["produced"] += 1
                yield state["produced"]
        finally:
            state["closed"] = True

    def consume_a_few():
        loader = PrefetchLoader(endless(), depth=3)
        got = []
        for item in loader:
            got.append(item)
            if len(got) == 5:
                break  # the generator is closed here, which stops the thread
        return got, loader

    got, loader = run_with_deadline(consume_a_few)
    assert got == [1, 2, 3, 4, 5]
    assert not loader._running
    deadline = time.monotonic() + DEADLINE
    while not state["closed"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert state["closed"]
    produced = state["produced"]
    time.sleep(0.2)
    assert state["produced"] == produced  # nothing runs any more


def test_close_and_context_manager_with_a_slow_consumer():
    def consume():
        with PrefetchLoader(iter(range(1000)), depth=2) as loader:
            it = iter(loader)
            first = [next(it) for _ in range(3)]
            time.sleep(0.1)  # the producer is blocked on the full queue meanwhile
        return first, loader

    first, loader = run_with_deadline(consume)
    assert first == [0, 1, 2] and not loader._running
    run_with_deadline(loader.close)  # closing twice is fine


def test_iterations_side_by_side_are_independent():
    """A second iteration used to stop the first one's thread: "the producer thread ended without a result"."""
    data = [0, 1, 2, 3]
    loader = PrefetchLoader(data, depth=1)
    assert list(zip(loader, loader)) == list(zip(data, data))
    first = iter(loader)
    assert next(first) == 0
    assert list(loader) == data  # a whole iteration in between
    assert list(first) == data[1:]
    first, second = iter(loader), iter(loader)
    assert next(first) == 0 and next(second) == 0
    loader.close()  # stops both
    assert not loader._running


def test_rejects_negative_depth():
    with pytest.raises(ValueError, match="depth"):
        PrefetchLoader([], depth=-1)
