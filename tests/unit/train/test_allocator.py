"""``reuse_freed_memory``: buffers freed and allocated again stop page-faulting.

The probe calls glibc's malloc directly: torch's CPU allocator asks for 64-byte aligned blocks
(``posix_memalign``), whose slack makes the step at which a freed block is taken again depend on
the heap's layout; what the setting does for training steps is measured by
``benchmarks/bench_allocator.py``.

    python -m pytest tests/unit/train/test_allocator.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent("""
    import ctypes, json, resource, sys
    from neorec.train.allocator import reuse_freed_memory
    reason = reuse_freed_memory() if sys.argv[1] == "reuse" else "not asked"
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size, faults = 48 << 20, []
    for _ in range(6):  # per "step": a 48 MiB block written and freed
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = libc.malloc(size)
        ctypes.memset(block, 1, size)
        libc.free(block)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(json.dumps({"reason": reason, "faults": faults}))
""")


def _probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc thresholds: Linux only")
def test_freed_buffers_are_reused_without_page_faults():
    default, reused = _probe("default"), _probe("reuse")
    if reused["reason"] is not None:
        pytest.skip(f"not applied here: {reused['reason']}")
    pages = (48 << 20) // 4096
    # glibc's default serves a 48 MiB block (above its 32 MiB ceiling) with a fresh mmap every
    # time: a fault per page (or per huge page, with transparent huge pages on), step after step
    assert min(default["faults"]) >= pages // 512, default
    # with the thresholds raised, the freed block stays on the heap and is taken again: the first
    # step faults its pages in, the next ones none
    assert reused["faults"][0] >= pages // 512 and max(reused["faults"][1:]) < pages // 100, reused


def test_reuse_is_applied_once_and_says_why_not():
    from neorec.train import allocator

    first = allocator.reuse_freed_memory()
    assert allocator.reuse_freed_memory() == first  # cached: mallopt runs once per process
    assert first is None or isinstance(first, str)
