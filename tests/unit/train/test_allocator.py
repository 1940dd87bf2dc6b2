"""``reuse_freed_memory``: buffers freed and allocated again stop page-faulting.

    python -m pytest tests/unit/train/test_allocator.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent("""
    import json, resource, sys
    import torch
    from neorec.train.allocator import reuse_freed_memory
    reason = reuse_freed_memory() if sys.argv[1] == "reuse" else "not asked"
    faults = []
    for _ in range(12):  # per "step": a 48 MiB buffer written and freed, a small one kept
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        buffer = torch.empty(12 << 20, dtype=torch.float32)
        buffer.fill_(1.0)
        kept = torch.empty(256)
        del buffer
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
    assert min(default["faults"][-4:]) >= pages // 512, default
    # with the thresholds raised, freed blocks are taken again: after a few steps, no faults
    assert max(reused["faults"][-4:]) < pages // 100, reused


def test_reuse_is_applied_once_and_says_why_not():
    from neorec.train import allocator

    first = allocator.reuse_freed_memory()
    assert allocator.reuse_freed_memory() == first  # cached: mallopt runs once per process
    assert first is None or isinstance(first, str)
