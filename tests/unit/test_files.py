"""Atomic writes and the writable-directory check of ``neorec/files.py``."""

import os

import pytest

from neorec.files import ensure_writable_dir, write_atomic


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
