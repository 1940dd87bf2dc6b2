"""The harness itself: a deadlock fails within the deadline instead of hanging the test run.

    python -m pytest tests/distributed/test_harness.py -q
"""

from __future__ import annotations

import time

import pytest

import workers
from harness import run_ranks


def test_deadlock_fails_instead_of_hanging(tmp_path):
    start = time.monotonic()
    with pytest.raises(AssertionError):
        run_ranks(workers.deadlock, 2, tmp_path, timeout=8)
    assert time.monotonic() - start < 60
