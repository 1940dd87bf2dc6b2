"""`neorec data write-criteo` / `preprocess-criteo` (and `neorec train` on Criteo data): what they
say about inputs and output folders that cannot be used, before any work is done."""

import os
from pathlib import Path

import pytest

from neorec.cli import main
from tests.read_only import refuse_writes_in

ROOT = Path(__file__).resolve().parents[2]
CRITEO = ROOT / "configs" / "criteo.toml"


@pytest.fixture
def tsv(tmp_path):
    path = tmp_path / "s.tsv"
    assert main(["data", "write-criteo", str(path), "--lines", "50"]) == 0
    return path


def _one_line(err: str) -> str:
    assert err.count("\n") == 1, err
    assert "Errno" not in err and ".tmp-" not in err, err
    return err


def test_preprocess_criteo_into_a_folder_that_cannot_be_made_names_it_and_the_argument(tsv, tmp_path, capsys):
    """It was a bare "[Errno 20] Not a directory: 'afile/train'" (and Errno 13 for a folder that
    cannot be written), with no word of the PROCESSED_DIR argument that chooses the folder."""
    capsys.readouterr()
    blocker = tmp_path / "afile"
    blocker.write_text("")
    for processed in (blocker, blocker / "sub"):
        assert main(["data", "preprocess-criteo", str(tsv), str(processed)]) == 2
        out, err = capsys.readouterr()
        _one_line(err)
        assert err.startswith(f"neorec data: error: cannot make {processed / 'train'}, the folder of the processed "
                              "copy (PROCESSED_DIR, the second argument): "), err
        assert f"{blocker} is a file, not a directory" in err, err
        assert "preprocessed" not in out
    (tmp_path / "s.tsv.neorec").write_text("")  # the default folder, beside the TSV
    assert main(["data", "preprocess-criteo", str(tsv)]) == 2
    err = _one_line(capsys.readouterr().err)
    assert f"cannot make {tmp_path / 's.tsv.neorec' / 'train'}, the folder of the processed copy (by default " \
           "TSV.neorec beside the TSV; the second argument, PROCESSED_DIR, puts it elsewhere)" in err, err


def test_preprocess_criteo_over_a_read_only_copy_names_the_folder_not_a_temporary(tsv, tmp_path, capsys, monkeypatch):
    """It said "[Errno 13] Permission denied: '.../train/.dense.f32.tmp-4807'"."""
    processed = tmp_path / "p"
    assert main(["data", "preprocess-criteo", str(tsv), str(processed)]) == 0
    before = {p.name: p.stat().st_mtime_ns for p in (processed / "train").iterdir()}
    capsys.readouterr()
    refuse_writes_in(monkeypatch, processed / "train")
    assert main(["data", "preprocess-criteo", str(tsv), str(processed)]) == 2
    out, err = capsys.readouterr()
    monkeypatch.undo()
    _one_line(err)
    assert err == f"neorec data: error: cannot write in {processed / 'train'}, the folder of the processed copy " \
                  "(PROCESSED_DIR, the second argument): Permission denied\n", err
    assert "preprocessed" not in out
    assert {p.name: p.stat().st_mtime_ns for p in (processed / "train").iterdir()} == before


def test_preprocess_criteo_into_a_read_only_folder(tsv, tmp_path, capsys, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    capsys.readouterr()
    if os.geteuid() == 0:  # root writes in read-only folders
        refuse_writes_in(monkeypatch, locked)
    else:
        locked.chmod(0o555)
    try:
        assert main(["data", "preprocess-criteo", str(tsv), str(locked / "p")]) == 2
    finally:
        monkeypatch.undo()
        locked.chmod(0o755)
    err = _one_line(capsys.readouterr().err)
    assert err == f"neorec data: error: cannot make {locked / 'p' / 'train'}, the folder of the processed copy " \
                  f"(PROCESSED_DIR, the second argument): Permission denied (in {locked})\n", err
    assert list(locked.iterdir()) == []


def test_preprocess_criteo_checks_every_input_before_starting(tsv, tmp_path, capsys):
    """A missing --eval-tsv was found after the whole training file was preprocessed (hours on a
    Terabyte day); a directory given as a TSV was "not found"."""
    capsys.readouterr()
    processed = tmp_path / "p"
    missing = tmp_path / "missing.tsv"
    assert main(["data", "preprocess-criteo", str(tsv), str(processed), "--eval-tsv", str(missing)]) == 2
    out, err = capsys.readouterr()
    _one_line(err)
    assert f"Criteo TSV file not found: {missing} (--eval-tsv" in err, err
    assert out == "" and not (processed / "train").exists()
    folder = tmp_path / "somedir"
    folder.mkdir()
    for argv, option in [([str(tsv), str(processed), "--eval-tsv", str(folder)], "--eval-tsv"),
                         ([str(folder), str(processed)], "TSV")]:
        assert main(["data", "preprocess-criteo", *argv]) == 2
        out, err = capsys.readouterr()
        _one_line(err)
        assert f"{folder} is a directory, not a Criteo TSV file ({option})" in err, err
        assert "write-criteo" not in err and out == "" and not (processed / "train").exists()
    assert not (folder.parent / "somedir.neorec").exists()


def test_write_criteo_refuses_zero_lines(tmp_path, capsys):
    """`--lines 0` wrote an empty file that every later step refuses."""
    target = tmp_path / "w0.tsv"
    assert main(["data", "write-criteo", str(target), "--lines", "0"]) == 2
    assert capsys.readouterr().err == "neorec data: error: --lines must be >= 1, got 0\n"
    assert not target.exists()
    assert main(["data", "write-criteo", str(target), "--lines", "1"]) == 0 and target.read_text().count("\n") == 1


@pytest.mark.parametrize("content,why", [("", "empty"), ("a,b,c\n1,2,3\n", "its 2 lines are all malformed")])
def test_train_on_a_tsv_without_rows_says_why_and_leaves_no_copy(tmp_path, capsys, content, why):
    """It said "Criteo data empty.tsv has no training rows" and left a 0-row copy behind (the
    copy preprocess-criteo removes)."""
    path = tmp_path / "empty.tsv"
    path.write_text(content)
    assert main(["train", "--config", str(CRITEO), "--no-progress", "--output-dir", str(tmp_path / "run"),
                 "--set", f"data.criteo.train_path='{path}'", "--set", "data.criteo.skip_malformed=true"]) == 2
    err = _one_line(capsys.readouterr().err)
    assert f"{path} holds no rows ({why}): nothing to train on" in err, err
    processed = tmp_path / "empty.tsv.neorec"
    assert not (processed / "train").exists()
    assert [p.name for p in processed.iterdir()] == ["train.lock"]  # kept: see preprocess_criteo
    # as preprocess-criteo leaves it
    assert main(["data", "preprocess-criteo", str(path), "--skip-malformed"]) == 2
    assert f"{path} holds no rows ({why}): nothing to train on" in capsys.readouterr().err
    assert [p.name for p in processed.iterdir()] == ["train.lock"]


def test_train_on_a_directory_or_a_file_says_which_it_is(tmp_path, capsys):
    """A Criteo path that is a directory was "not found", with a `write-criteo DIR` suggestion that
    fails; a MovieLens path that is a file was "directory not found"."""
    folder = tmp_path / "somedir"
    folder.mkdir()
    assert main(["train", "--config", str(CRITEO), "--no-progress", "--output-dir", str(tmp_path / "run"),
                 "--set", f"data.criteo.train_path='{folder}'"]) == 2
    err = _one_line(capsys.readouterr().err)
    assert err == f"neorec train: error: {folder} is a directory, not a Criteo TSV file (data.criteo.train_path)" \
                  "; give the path of a TSV file\n", err
    afile = tmp_path / "afile"
    afile.write_text("")
    assert main(["train", "--config", str(ROOT / "configs" / "movielens.toml"), "--no-progress",
                 "--output-dir", str(tmp_path / "run"), "--set", f"data.movielens.path='{afile}'"]) == 2
    err = _one_line(capsys.readouterr().err)
    assert f"MovieLens path {afile} is a file, not a directory (data.movielens.path)" in err, err
