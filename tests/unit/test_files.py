"""Atomic writes and the writable-directory check of ``neorec/files.py``."""

import os

import pytest

from neorec.files import NAME_MAX, ensure_writable_dir, hold_dir, temporary_name, write_atomic


def test_write_atomic_replaces_and_creates_parents(tmp_path):
    target = tmp_path / "a" / "b.json"
    write_atomic(target, "one")
    write_atomic(target, b"two")
    assert target.read_bytes() == b"two"
    assert sorted(p.name for p in target.parent.iterdir()) == ["b.json"]


def test_failed_write_atomic_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "plan.json"
    target.write_text("old")

    def refuse(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="No space left") as caught:
        write_atomic(target, "new")
    assert caught.value.filename == str(target) and caught.value.errno == 28  # was pathless
    assert str(target) in str(caught.value)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


def test_write_atomic_onto_a_directory_is_refused(tmp_path):
    with pytest.raises(IsADirectoryError, match="is a directory; give a file name"):
        write_atomic(tmp_path, "x")
    assert list(tmp_path.parent.glob(f".{tmp_path.name}*")) == []


def test_ensure_writable_dir(tmp_path):
    made = ensure_writable_dir(tmp_path / "x" / "y", "train.output_dir")
    assert made.is_dir() and list(made.iterdir()) == []  # the probe file is gone
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="checkpoint.dir '.*f' is a file, not a directory"):
        ensure_writable_dir(tmp_path / "f", "checkpoint.dir")
    with pytest.raises(ValueError, match="checkpoint.dir '.*f/sub' is not a writable directory"):
        ensure_writable_dir(tmp_path / "f" / "sub", "checkpoint.dir")


def test_a_dangling_symbolic_link_is_named_as_one(tmp_path):
    """It said "not a writable directory: File exists"."""
    (tmp_path / "out").symlink_to(tmp_path / "gone")
    with pytest.raises(ValueError, match=r"train.output_dir '.*out' is a symbolic link to '.*gone', which does not exist"):
        ensure_writable_dir(tmp_path / "out", "train.output_dir")


def test_a_name_at_the_file_system_limit_is_written_atomically(tmp_path):
    """The temporary ``.<name>.<pid>.tmp`` of a 250-byte name passed NAME_MAX (File name too long)."""
    for name in ("n" * 250 + ".json", "é" * 127):  # 255 bytes each, one in two-byte characters
        target = tmp_path / name
        write_atomic(target, "x")
        assert target.read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["n" * 250 + ".json", "é" * 127])
    long_a, long_b = temporary_name("a" * 255, pid=7), temporary_name("a" * 254 + "b", pid=7)
    assert len(long_a.encode()) <= NAME_MAX and long_a != long_b  # shortened names stay distinct
    assert temporary_name("plan.json", pid=7) == ".plan.json.7.tmp"


def test_holding_a_folder_sweeps_the_temporaries_a_killed_write_left(tmp_path):
    """A run killed inside ``write_atomic`` left ``.metrics.jsonl.<pid>.tmp`` files for good. A live
    writer's temporary (another process writing a plan into the folder) and a fresh one are kept."""
    import subprocess
    import time

    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that ended (not reused within the test)
    old = time.time() - 3600
    swept = [temporary_name("metrics.jsonl", pid=dead.pid), temporary_name("x" * 300, pid=dead.pid)]
    live = subprocess.Popen(["sleep", "30"])
    try:
        kept = [temporary_name("plan.json", pid=live.pid), ".notes.tmp"]  # a live writer's; not write_atomic's
        for name in swept + kept:
            (tmp_path / name).write_text("half")
            os.utime(tmp_path / name, (old, old))
        fresh = temporary_name("config.json", pid=dead.pid)
        (tmp_path / fresh).write_text("half")  # written to a moment ago: kept for now
        (tmp_path / "sub").mkdir()
        (tmp_path / "sub" / temporary_name("rank0.json", pid=dead.pid)).write_text("half")  # subfolders: not swept
        fd = hold_dir(tmp_path, "train.output_dir")
        try:
            assert sorted(p.name for p in tmp_path.iterdir()) == sorted([".neorec.lock", "sub", fresh, *kept])
            assert len(list((tmp_path / "sub").iterdir())) == 1
        finally:
            os.close(fd)
    finally:
        live.kill()
        live.wait()
