"""Row stores (``neorec/embedding/storage.py``): round trips per precision within the stated error
bounds, unbiased stochastic rounding, partial writes, SSD create / reopen / crash marking, errors.

    python -m pytest tests/unit/embedding/test_storage.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from neorec.embedding.ssd_store import SsdRowStore
from neorec.embedding.storage import DramRowStore

PRECISIONS = ["fp32", "fp16", "bf16", "int8"]
STATE = {"momentum1": 1, "momentum2": 6}


def make_store(kind: str, tmp_path, precision: str, **kwargs):
    if kind == "dram":
        return DramRowStore(500, 6, precision, STATE, **kwargs)
    return SsdRowStore.create(tmp_path / f"store_{precision}", 500, 6, precision, STATE, **kwargs)


def error_bound(precision: str, rows: torch.Tensor, stochastic: bool) -> torch.Tensor:
    """Largest allowed |stored - rows| per value."""
    if precision == "fp32":
        return torch.zeros_like(rows)
    if precision == "int8":
        scale = (rows.amax(1, keepdim=True) - rows.amin(1, keepdim=True)) / 255
        return (scale if stochastic else scale / 2) * (1 + 1e-5) + 1e-6 * rows.abs() + 1e-7
    mantissa = 10 if precision == "fp16" else 7
    relative = 2.0 ** -(mantissa if stochastic else mantissa + 1)
    return rows.abs() * relative * (1 + 1e-6) + 1e-7


@pytest.mark.parametrize("kind", ["dram", "ssd"])
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("stochastic", [True, False])
def test_round_trip_within_bounds(tmp_path, kind, precision, stochastic):
    store = make_store(kind, tmp_path, precision, with_counts=True, stochastic_rounding=stochastic)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randperm(500, generator=generator)[:200]
    rows = torch.randn(200, 6, generator=generator) * torch.logspace(-3, 1, 200).unsqueeze(1)
    rows[0] = 0.25  # a constant row (int8 scale 0) is exact
    state = {"momentum1": torch.rand(200, generator=generator), "momentum2": torch.rand(200, 6, generator=generator)}
    store.write(ids, rows, state, counts=torch.arange(200))
    got, got_state = store.read(ids)
    assert ((got - rows).abs() <= error_bound(precision, rows, stochastic)).all()
    assert torch.equal(got[0], rows[0])
    for name in STATE:  # optimizer state is fp32: exact
        assert torch.equal(got_state[name], state[name])
    assert torch.equal(store.read_counts(ids), torch.arange(200))
    assert torch.equal(store.read_rows(ids), got)
    assert store.stats()["rows_written"] == 200 and store.stats()["bytes_read"] > 0
    store.close()


@pytest.mark.parametrize("precision", ["int8", "fp16", "bf16"])
def test_stochastic_rounding_is_unbiased(precision):
    """The same row written to many ids: the mean of what is read back is the row; round to
    nearest keeps a bias of a sizeable fraction of a grid step."""
    count = 20000
    if precision == "int8":
        step = 1 / 255
        row = torch.tensor([0.0, 1.0, 3.3 * step, 100.7 * step, 200.45 * step, 17.3 * step])
    else:
        dtype = torch.float16 if precision == "fp16" else torch.bfloat16
        base = torch.tensor([0.1, 0.3, 1.7, 2.9, 0.01, 0.5]).to(dtype)
        step = (torch.nextafter(base, torch.full_like(base, 10)).float() - base.float())
        row = base.float() + 0.3 * step
    ids = torch.arange(count)
    rows = row.expand(count, 6).contiguous()
    results = {}
    for stochastic in (True, False):
        store = DramRowStore(count, 6, precision, stochastic_rounding=stochastic, seed=3)
        store.write(ids, rows)
        results[stochastic] = store.read_rows(ids).double().mean(0) - row.double()
    step = torch.as_tensor(step, dtype=torch.float64)
    assert (results[True].abs() <= 0.02 * step).all(), results[True] / step
    inner = slice(2, 6) if precision == "int8" else slice(0, 6)
    assert (results[False][inner].abs() >= 0.25 * step * torch.ones(6, dtype=torch.float64)[inner]).all()


def test_seeded_rounding_repeats():
    rows = torch.randn(50, 6)
    stored = []
    for _ in range(2):
        store = DramRowStore(50, 6, "int8", seed=7)
        store.write(torch.arange(50), rows)
        stored.append(store.records.clone())
    assert torch.equal(stored[0], stored[1])


def test_partial_writes_leave_the_rest(tmp_path):
    store = SsdRowStore.create(tmp_path / "s", 100, 6, "int8", STATE, with_counts=True)
    ids = torch.tensor([5, 9, 70])
    rows, state = torch.randn(3, 6), {"momentum1": torch.rand(3), "momentum2": torch.rand(3, 6)}
    store.write(ids, rows, state, counts=torch.tensor([1, 2, 3]))
    before = store.read_rows(ids)
    store.write_rows(ids, rows * 2)
    assert torch.equal(store.read_state(ids)["momentum2"], state["momentum2"])
    assert torch.equal(store.read_counts(ids), torch.tensor([1, 2, 3]))
    store.write_state(ids, {"momentum1": torch.zeros(3), "momentum2": torch.ones(3, 6)})
    store.write_counts(ids, torch.tensor([7, 8, 9]))
    assert not torch.equal(store.read_rows(ids), before)
    assert torch.equal(store.read_state(ids)["momentum1"], torch.zeros(3))
    assert torch.equal(store.read_counts(ids), torch.tensor([7, 8, 9]))
    untouched, untouched_state = store.read(torch.tensor([0, 99]))
    assert torch.equal(untouched, torch.zeros(2, 6)) and torch.equal(untouched_state["momentum2"], torch.zeros(2, 6))
    store.close()


def test_ssd_create_fill_reopen_and_release(tmp_path):
    path = tmp_path / "table"
    values = torch.arange(1000 * 8, dtype=torch.float32).view(1000, 8) / 1000

    def fill(store):
        store.fill(lambda start, count: values[start : start + count], state_value=0.5)

    store = SsdRowStore.create(path, 1000, 8, "fp32", {"momentum1": 1}, fill=fill,
                               resident_budget_bytes=16 << 10)
    assert sorted(p.name for p in path.iterdir()) == ["meta.json", "rows.bin"]
    assert not list(tmp_path.glob(".table.tmp-*"))  # built aside, then renamed
    ids = torch.arange(1000)
    assert torch.equal(store.read_rows(ids), values)
    assert torch.equal(store.read_state(ids)["momentum1"], torch.full((1000,), 0.5))
    assert store.releases == 0  # reads and writes of rows go through pread / pwrite: nothing mapped
    store.write_range(0, values)  # initialising writes go through the mapping, within its budget
    assert store.releases > 0 and torch.equal(store.read_rows(ids), values)  # 16 KiB: pages dropped, data there
    store.write(torch.tensor([3]), torch.full((1, 8), 9.0))
    store.release_pages()
    assert torch.equal(store.read_rows(torch.tensor([3])), torch.full((1, 8), 9.0))
    store.close()
    reopened = SsdRowStore.open(path)
    expected = values.clone()
    expected[3] = 9.0
    assert torch.equal(reopened.read_rows(ids), expected)
    assert (reopened.num_rows, reopened.dim, reopened.precision) == (1000, 8, "fp32")
    reopened.close()


def test_unflushed_store_is_marked_unclean(tmp_path):
    path = tmp_path / "t"
    crash = ("import sys, os, torch; from neorec.embedding.ssd_store import SsdRowStore; "
             "store = SsdRowStore.create(sys.argv[1], 10, 4); "
             "store.write(torch.tensor([1]), torch.ones(1, 4)); os._exit(0)")  # no flush: a crash leaves a mix
    subprocess.run([sys.executable, "-c", crash, str(path)], check=True)
    assert json.loads((path / "meta.json").read_text())["clean"] is False
    with pytest.raises(ValueError, match="written after its last flush"):
        SsdRowStore.open(path)
    store = SsdRowStore.open(path, allow_unclean=True)
    assert torch.equal(store.read_rows(torch.tensor([1])), torch.ones(1, 4))  # the write reached the file
    store.flush()
    assert json.loads((path / "meta.json").read_text())["clean"] is True
    store.close()
    SsdRowStore.open(path).close()


def test_a_store_is_used_by_one_process_at_a_time(tmp_path):
    """An open store holds a lock: opening or re-creating it elsewhere is refused (it would delete
    or mix the rows being trained), until it is closed or its process ends."""
    path = tmp_path / "t"
    store = SsdRowStore.create(path, 10, 4)
    hold = ("import sys, time; from neorec.embedding.ssd_store import SsdRowStore; "
            "s = SsdRowStore.open(sys.argv[1]); print('open', flush=True); time.sleep(60)")
    store.close()
    holder = subprocess.Popen([sys.executable, "-c", hold, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        message = rf"row store '{path}' is in use by another process \(pid {holder.pid}\)"
        with pytest.raises(ValueError, match=message):
            SsdRowStore.open(path)
        with pytest.raises(ValueError, match=message):
            SsdRowStore.create(path, 20, 4, overwrite=True)
    finally:
        holder.kill()
        holder.wait()
    reopened = SsdRowStore.open(path)  # the kernel dropped the lock with the process
    assert reopened.num_rows == 10
    with pytest.raises(ValueError, match="is already open in this process; close"):
        SsdRowStore.open(path)  # a second handle in the same process too (it named this process as "another")
    reopened.close()
    SsdRowStore.create(path, 20, 4, overwrite=True).close()


def test_failed_fill_leaves_nothing(tmp_path):
    def fill(store):
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        SsdRowStore.create(tmp_path / "t", 10, 4, fill=fill)
    assert [p.name for p in tmp_path.iterdir()] == [".t.lock"]  # no store, no temporary: only the lock file


def test_temporaries_of_creators_killed_mid_way_are_removed_by_the_next_create(tmp_path):
    """A create killed before its rename (SIGKILL: no cleanup ran) left a table-sized
    ``.<name>.tmp-<pid>`` folder for good, one more per crash."""
    killed = [subprocess.run([sys.executable, "-c", (
        "import os, signal, sys\n"
        "from neorec.embedding.ssd_store import SsdRowStore\n"
        "SsdRowStore.create(sys.argv[1], 1000, 8, fill=lambda store: os.kill(os.getpid(), signal.SIGKILL))"),
        str(tmp_path / "table")]) for _ in range(2)]
    assert all(run.returncode == -9 for run in killed)
    assert len(list(tmp_path.glob(".table.tmp-*"))) == 1  # the second create removed the first's
    (tmp_path / ".other.tmp-1").mkdir()  # another store's: not this create's business
    SsdRowStore.create(tmp_path / "table", 10, 4).close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.tmp-1", ".table.lock", "table"]


def test_errors(tmp_path):
    store = DramRowStore(10, 4, "fp16", {"momentum1": 1}, name="t_user")
    with pytest.raises(ValueError, match=r"row store 't_user': rows must be \[2, 4\], got \(2, 5\)"):
        store.write(torch.tensor([0, 1]), torch.zeros(2, 5))
    with pytest.raises(ValueError, match=r"id 10 is outside the rows \[0, 10\)"):
        store.read(torch.tensor([3, 10]))
    with pytest.raises(ValueError, match=r"id -1 is outside"):
        store.write(torch.tensor([-1]), torch.zeros(1, 4))
    with pytest.raises(TypeError, match="1-D integer tensor"):
        store.read(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="state must have fields"):
        store.write(torch.tensor([0]), torch.zeros(1, 4), {"momentum2": torch.zeros(1)})
    with pytest.raises(ValueError, match="NaN or inf"):
        store.write(torch.tensor([0]), torch.full((1, 4), float("nan")))
    with pytest.raises(ValueError, match="precision must be one of"):
        DramRowStore(10, 4, "int4")
    with pytest.raises(ValueError, match="width 1 or dim"):
        DramRowStore(10, 4, "fp32", {"momentum1": 3})
    with pytest.raises(ValueError, match="num_rows must be a positive integer"):
        DramRowStore(0, 4)
    store.close()
    with pytest.raises(ValueError, match="is closed"):
        store.read(torch.tensor([0]))
    ssd = SsdRowStore.create(tmp_path / "t", 10, 4)
    with pytest.raises(ValueError, match="already exists"):
        SsdRowStore.create(tmp_path / "t", 10, 4)
    ssd.close()
    SsdRowStore.create(tmp_path / "t", 20, 4, overwrite=True).close()
    assert SsdRowStore.open(tmp_path / "t").num_rows == 20
    with pytest.raises(ValueError, match="no meta.json"):
        SsdRowStore.open(tmp_path)
    meta_path = tmp_path / "t" / "meta.json"
    meta = meta_path.read_text()
    meta_path.write_text(json.dumps({k: v for k, v in json.loads(meta).items() if k != "clean"}))
    with pytest.raises(ValueError, match="meta.json lacks clean"):  # was KeyError: 'clean'
        SsdRowStore.open(tmp_path / "t")
    meta_path.write_text(meta)
    with open(tmp_path / "t" / "rows.bin", "r+b") as f:
        f.truncate(7)
    with pytest.raises(ValueError, match="rows.bin holds 7 bytes"):
        SsdRowStore.open(tmp_path / "t")


def test_no_space_for_a_store_is_an_error_at_creation(tmp_path, monkeypatch):
    """The file's blocks are reserved when the store is made: a full disk is a clear error there
    (not a SIGBUS at the first write of a row), and nothing is left behind but the lock file."""
    import errno
    import os

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match=r"no space left for row store '.*t': it needs 160 bytes"):
        SsdRowStore.create(tmp_path / "t", 10, 4)
    assert [p.name for p in tmp_path.iterdir()] == [".t.lock"]
    monkeypatch.undo()
    SsdRowStore.create(tmp_path / "t", 10, 4).close()
    assert os.stat(tmp_path / "t" / "rows.bin").st_blocks * 512 >= 160  # allocated, not sparse


@pytest.mark.parametrize("precision, value", [("fp16", 65505.0), ("fp16", -1e6), ("bf16", 3.4e38)])
def test_values_beyond_the_precision_are_refused_not_stored_as_inf(precision, value):
    store = DramRowStore(4, 3, precision)
    store.write(torch.tensor([0]), torch.tensor([[1.0, 65504.0 if precision == "fp16" else 3.3e38, -2.0]]))
    assert bool(torch.isfinite(store.read_rows(torch.tensor([0]))).all())  # the largest value itself is fine
    with pytest.raises(ValueError, match=f"beyond the largest {precision} value"):
        store.write(torch.tensor([1]), torch.tensor([[0.0, value, 1.0]]))
    with pytest.raises(ValueError, match=f"beyond the largest {precision} value"):
        store.write_range(2, torch.tensor([[0.0, value, 1.0]]))
    assert torch.equal(store.read_rows(torch.tensor([1, 2])), torch.zeros(2, 3))  # nothing written


def test_int8_rows_spanning_more_than_fp32_are_refused_not_stored_as_nan():
    store = DramRowStore(2, 2, "int8")
    store.write(torch.tensor([0]), torch.tensor([[-1.5e38, 1.5e38]]))  # a span of 3e38 still fits
    assert torch.allclose(store.read_rows(torch.tensor([0])), torch.tensor([[-1.5e38, 1.5e38]]), rtol=1e-2)
    with pytest.raises(ValueError, match="span more than the fp32 range"):
        store.write(torch.tensor([1]), torch.tensor([[-3e38, 3e38]]))


def _mapped_kib(path) -> int:
    """Resident KiB of this process's mappings of ``path`` (/proc/self/smaps)."""
    import re

    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                inside = line.rstrip().endswith(str(path))
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc/self/smaps")
def test_ssd_store_mapped_memory_stays_near_its_budget_with_fault_around(tmp_path):
    """Rows written earlier sit in the page cache, and a read fault maps their neighbours too (the
    kernel's fault-around, MADV_RANDOM notwithstanding): counted at a page per row, the mapped memory
    of a 2 MiB budget reached 10 MiB and more."""
    budget, per_op = 2 << 20, 32
    store = SsdRowStore.create(tmp_path / "t", 200_000, 32, "fp32", resident_budget_bytes=budget)
    store.close()
    store = SsdRowStore.open(tmp_path / "t", resident_budget_bytes=budget)
    generator = torch.Generator().manual_seed(0)
    peak = 0
    for _ in range(300):
        ids = torch.randint(0, 200_000, (per_op,), generator=generator).unique()
        store.write(ids, store.read_rows(ids) + 1)
        peak = max(peak, _mapped_kib(tmp_path / "t" / "rows.bin") << 10)
    store.close()
    assert peak <= budget + per_op * (64 << 10) + (1 << 20), peak  # the budget, one operation, some slack


def test_int8_rows_of_subnormals_keep_their_span():
    """The row's scale underflowed to 0: a row spanning a few subnormals was stored as a constant."""
    store = DramRowStore(2, 4, "int8")
    tiny = torch.tensor([[1e-39, 1.00003e-39, 1.00001e-39, 1.00002e-39], [0.0, 1.0, 2.0, 3.0]])
    store.write(torch.tensor([0, 1]), tiny)
    back = store.read_rows(torch.tensor([0, 1]))
    assert back[0].amax() > back[0].amin() and torch.allclose(back[1], tiny[1], atol=3 / 255)


@pytest.mark.parametrize("kind", ["dram", "ssd"])
def test_an_empty_id_list_reads_and_writes_nothing(tmp_path, kind):
    """The SSD store raised IndexError on no ids (its runs of consecutive ids began with ids[0]); the
    DRAM store returned empty results. Reachable through a cached collection's ``read_rows``."""
    store = make_store(kind, tmp_path, "fp32", with_counts=True)
    none = torch.tensor([], dtype=torch.long)
    rows, state = store.read(none)
    assert rows.shape == (0, 6) and {name: tuple(v.shape) for name, v in state.items()} == {
        "momentum1": (0,), "momentum2": (0, 6)}
    assert store.read_rows(none).shape == (0, 6) and store.read_counts(none).shape == (0,)
    store.write(none, torch.zeros(0, 6), {"momentum1": torch.zeros(0), "momentum2": torch.zeros(0, 6)},
                counts=torch.zeros(0, dtype=torch.long))
    assert store.stats() == {"rows_read": 0, "rows_written": 0, "bytes_read": 0, "bytes_written": 0}
    store.close()


@pytest.mark.parametrize("kind", ["dram", "ssd"])
def test_the_initial_fill_is_not_counted_as_rows_moved(tmp_path, kind):
    """A DRAM store counted its initial fill (the whole table) in rows_written / bytes_written and
    an SSD store did not, so a run's cache record said the DRAM tables wrote a table more."""
    store = make_store(kind, tmp_path, "fp16")
    store.fill(lambda start, count: torch.full((count, 6), 0.5))
    assert store.stats() == {"rows_read": 0, "rows_written": 0, "bytes_read": 0, "bytes_written": 0}
    store.write(torch.tensor([3, 7]), torch.ones(2, 6), {"momentum1": torch.zeros(2), "momentum2": torch.zeros(2, 6)})
    assert store.stats()["rows_written"] == 2 and store.stats()["bytes_written"] == 2 * store.format.record_bytes
    store.close()


def test_a_symlink_to_a_store_shares_its_lock(tmp_path):
    """The lock file was named after the path as given: a symlink to the store's folder had a lock
    of its own, and two writers could open the same rows.bin."""
    path = tmp_path / "t_user"
    store = SsdRowStore.create(path, 10, 4)
    alias = tmp_path / "alias"
    alias.symlink_to(path, target_is_directory=True)
    try:
        with pytest.raises(ValueError, match="is already open in this process; close"):
            SsdRowStore.open(alias)
    finally:
        store.close()
    SsdRowStore.open(alias).close()  # (closed: the alias opens the store)


def test_an_unclean_mark_that_failed_to_be_written_is_tried_again(tmp_path, monkeypatch):
    """The store counted itself unclean before meta.json said so: when that write failed (a full
    disk), the next writes went into rows.bin under a meta.json still saying clean, and a crash
    then reopened the store as if nothing had been written."""
    import neorec.embedding.ssd_store as ssd_store

    store = SsdRowStore.create(tmp_path / "t", 4, 3)
    store.flush()
    real = ssd_store._write_json
    calls = {"n": 0}

    def full_once(path, data):
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(28, "No space left on device", str(path))
        return real(path, data)

    monkeypatch.setattr(ssd_store, "_write_json", full_once)
    rows = torch.full((1, 3), 5.0)
    with pytest.raises(OSError, match="No space left"):
        store.write_rows(torch.tensor([1]), rows)
    store.write_rows(torch.tensor([1]), rows)  # the retry writes the mark, then the row
    assert json.loads((tmp_path / "t" / "meta.json").read_text())["clean"] is False
    store.close()
