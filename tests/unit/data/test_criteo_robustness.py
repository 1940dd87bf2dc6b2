"""Criteo preprocessing under adverse conditions: several processes at once (one preprocesses,
the others wait), temporaries left by a killed run, skipped lines reported, an empty eval set,
a full disk."""

import os
import resource
import signal
import subprocess
import sys
import time

import pytest

from neorec.data.criteo import (CriteoSource, load_or_preprocess, open_processed, preprocess_criteo,
                                remove_stale_temporaries, write_criteo_tsv)
from neorec.data.config import CriteoConfig

ROWS = 1000
GOOD = "\t".join(["1"] + ["5"] * 13 + ["0a0b0c0d"] * 26)

# a process that, once told to go, loads the processed copy; the one that preprocesses it starts
# only once the other waits for the lock (or after 60 s: then both build, and the test fails); a
# fixed 1.5 s head start was a race on a loaded host
CHILD = """
import os, sys, time
from pathlib import Path
from neorec.data import criteo
tsv, out, me, go = sys.argv[1:5]
real, notice = criteo.preprocess_criteo, criteo._notice
def waiting(text):
    if "waiting for another process" in text:
        Path(me + ".waiting").touch()
    notice(text)
def slow(*args, **kwargs):
    Path(me + ".built").touch()
    deadline = time.monotonic() + 60
    while not list(Path(me).parent.glob("c*.waiting")) and time.monotonic() < deadline:
        time.sleep(0.01)
    return real(*args, **kwargs)
criteo._notice, criteo.preprocess_criteo = waiting, slow
Path(me + ".ready").touch()
while not os.path.exists(go):
    time.sleep(0.01)
print("rows", criteo.load_or_preprocess(tsv, out, 1000).num_rows, flush=True)
"""


@pytest.fixture(scope="module")
def tsv(tmp_path_factory):
    path = tmp_path_factory.mktemp("criteo") / "day_0.tsv"
    write_criteo_tsv(path, 2000, seed=1)
    return path


def test_two_processes_preprocess_once(tsv, tmp_path):
    out, go = tmp_path / "p" / "train", tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(tsv), str(out), str(tmp_path / f"c{i}"), str(go)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"c{i}.ready").exists() for i in range(2)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "children did not start"
            time.sleep(0.05)
        go.touch()  # both ask for the processed copy at the same moment
        results = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (stdout, stderr) in zip(procs, results):
        assert p.returncode == 0, stderr
        assert "rows 2000" in stdout
    assert len(list(tmp_path.glob("c*.built"))) == 1  # one preprocessed, the other used its copy
    waited = [stdout for stdout, _ in results if "waiting for another process preprocessing" in stdout]
    assert len(waited) == 1 and str(tsv) in waited[0]
    assert not [p for p in os.listdir(out) if ".tmp-" in p]


def test_stale_temporaries_of_dead_processes_are_removed(tsv, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid is free now
    alive = os.getppid()
    stale = [out / f".dense.f32.tmp-{dead.pid}", out / f".meta.json.tmp-{dead.pid}"]
    kept = [out / f".labels.u8.tmp-{alive}", out / f".notes.txt.tmp-{dead.pid}", out / "keep.txt"]
    for p in stale + kept:
        p.write_bytes(b"x" * 100)
    preprocess_criteo(tsv, out, ROWS)
    assert not any(p.exists() for p in stale)
    assert all(p.exists() for p in kept)  # a live process's temporary, and files that are not ours
    assert open_processed(out).num_rows == 2000
    assert remove_stale_temporaries(out) == []


def test_skipped_lines_are_reported_when_training(tmp_path, capsys):
    path = tmp_path / "bad.tsv"
    path.write_text("\n".join([GOOD] * 6 + ["junk"] + [GOOD] * 13) + "\n")
    cfg = CriteoConfig(train_path=str(path), processed_dir=str(tmp_path / "p"), num_embeddings=ROWS,
                       skip_malformed=True)
    for _ in range(2):  # when building the copy, and when reusing it
        source = CriteoSource(cfg)
        assert source.num_train_samples() == 17
        lines = [line for line in capsys.readouterr().out.splitlines() if "malformed" in line]
        assert len(lines) == 1
        assert f"{path}: 1 of 20 lines were malformed and skipped" in lines[0] and "first: line 7:" in lines[0]
    clean = tmp_path / "clean.tsv"
    clean.write_text("\n".join([GOOD] * 20) + "\n")
    CriteoSource(CriteoConfig(train_path=str(clean), num_embeddings=ROWS, skip_malformed=True))
    assert "malformed" not in capsys.readouterr().out


def test_empty_eval_set_is_refused(tsv, tmp_path):
    empty = tmp_path / "empty.tsv"
    empty.write_text("")
    with pytest.raises(ValueError, match=f"Criteo eval data {empty} holds no rows \\(empty\\): give "
                                         "data.criteo.eval_path"):
        CriteoSource(CriteoConfig(train_path=str(tsv), eval_path=str(empty), processed_dir=str(tmp_path / "p"),
                                  num_embeddings=ROWS))
    tiny = tmp_path / "tiny.tsv"
    tiny.write_text("\n".join([GOOD] * 4) + "\n")
    with pytest.raises(ValueError, match="eval_fraction 0.1 of its 4 rows leaves no eval rows: raise "
                                         "data.criteo.eval_fraction"):
        CriteoSource(CriteoConfig(train_path=str(tiny), num_embeddings=ROWS, eval_fraction=0.1))
    assert CriteoSource(CriteoConfig(train_path=str(tiny), num_embeddings=ROWS, eval_fraction=0.25)).num_eval_samples() == 1
    none = CriteoSource(CriteoConfig(train_path=str(tiny), num_embeddings=ROWS, eval_fraction=0.0))  # asks for none
    assert none.num_eval_samples() == 0 and none.num_train_samples() == 4


def test_full_disk_names_the_file(tsv, tmp_path):
    """A file size limit fails the writes as a full disk does (numpy: "N requested and M written")."""
    out = tmp_path / "out"
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (50_000, hard))  # categorical.i32 needs 208 kB
    try:
        with pytest.raises(OSError) as info:
            preprocess_criteo(tsv, out, ROWS, chunk_lines=256)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    message = str(info.value)
    assert f"writing {out / 'categorical.i32'} failed" in message and "the disk may be full" in message, message
    assert "\n" not in message
    assert not out.exists()  # the partial files are gone, and the folder this call made
    assert load_or_preprocess(tsv, out, ROWS).num_rows == 2000  # with room, it works


def test_a_large_file_announces_its_preprocessing(tmp_path, monkeypatch, capsys):
    """Files of PROGRESS_BYTES or more say that they are being preprocessed (minutes of silence
    otherwise); small ones stay quiet."""
    import neorec.data.criteo as criteo

    tsv = tmp_path / "day.tsv"
    criteo.write_criteo_tsv(tsv, 200, seed=0)
    criteo.preprocess_criteo(tsv, tmp_path / "quiet", num_embeddings=1000)
    assert "preprocessing" not in capsys.readouterr().out
    monkeypatch.setattr(criteo, "PROGRESS_BYTES", 1)
    criteo.preprocess_criteo(tsv, tmp_path / "loud", num_embeddings=1000)
    assert f"criteo: preprocessing {tsv} (0 MiB) into {tmp_path / 'loud'}" in capsys.readouterr().out


def test_a_line_too_long_to_be_criteo_is_refused_by_number(tmp_path, monkeypatch):
    """A file with a line of MAX_LINE_BYTES or more (a binary file, a file without newlines) is
    read in pieces of that size, never whole, and refused naming the line, even with
    skip_malformed; lines just under the bound parse as before."""
    import neorec.data.criteo as criteo

    tsv = tmp_path / "day.tsv"
    criteo.write_criteo_tsv(tsv, 50, seed=0)
    lines = tsv.read_bytes().splitlines(keepends=True)
    longest = max(len(line) for line in lines)
    monkeypatch.setattr(criteo, "MAX_LINE_BYTES", longest)  # a line of exactly that many bytes ends in "\n"
    assert criteo.preprocess_criteo(tsv, tmp_path / "ok", num_embeddings=1000).num_rows == 50
    bad = tmp_path / "bad.tsv"
    bad.write_bytes(b"".join(lines[:7]) + b"1\t" * (5 * longest) + b"".join(lines[7:]))
    for skip in (False, True):
        with pytest.raises(ValueError, match=rf"bad.tsv:8: a line of {longest:,} bytes or more"):
            criteo.preprocess_criteo(bad, tmp_path / f"bad{skip}", num_embeddings=1000, skip_malformed=skip)


def test_a_chunk_ends_at_chunk_bytes_so_wide_lines_stay_bounded(tmp_path, monkeypatch):
    """Chunks were bounded by their line count alone: 2048 lines of 200 kB of a wrong file (a
    wide CSV) took 4 GB of parsing arrays before its first line was refused. Now a chunk also ends
    at CHUNK_BYTES, and the result does not depend on where the chunks end."""
    import neorec.data.criteo as criteo

    tsv = tmp_path / "day.tsv"
    criteo.write_criteo_tsv(tsv, 300, seed=2)
    whole = criteo.preprocess_criteo(tsv, tmp_path / "whole", num_embeddings=1000)
    sizes = []
    parse = criteo.parse_chunk
    monkeypatch.setattr(criteo, "parse_chunk", lambda buf, *args: sizes.append(len(buf)) or parse(buf, *args))
    monkeypatch.setattr(criteo, "CHUNK_BYTES", 2000)
    longest = max(len(line) for line in tsv.read_bytes().splitlines(keepends=True))
    stats = criteo.preprocess_criteo(tsv, tmp_path / "small", num_embeddings=1000)
    assert len(sizes) > 10 and max(sizes) < 2000 + longest and sum(sizes) == tsv.stat().st_size
    assert (stats.num_rows, stats.num_lines) == (whole.num_rows, whole.num_lines) == (300, 300)
    for name in ("dense.f32", "categorical.i32", "labels.u8"):
        assert (tmp_path / "small" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes()


@pytest.mark.parametrize("kind", ["gzip", "bz2", "xz"])
def test_a_compressed_tsv_is_read_through_its_decompressor(tmp_path, kind):
    """The Terabyte logs ship as day_N.gz: one was refused as 'expected 40 tab-separated columns
    (...), found 2' and, with skip_malformed, became 0 rows and exit code 0."""
    import bz2
    import gzip
    import lzma

    import neorec.data.criteo as criteo

    tsv = tmp_path / "day.tsv"
    criteo.write_criteo_tsv(tsv, 500, seed=5)
    compress = {"gzip": gzip.compress, "bz2": bz2.compress, "xz": lzma.compress}[kind]
    packed = tmp_path / "day.packed"  # (known by its first bytes, not by its name)
    packed.write_bytes(compress(tsv.read_bytes()))
    plain = load_or_preprocess(tsv, tmp_path / "plain", ROWS)
    read = load_or_preprocess(packed, tmp_path / "packed", ROWS)
    assert read.num_rows == plain.num_rows == 500
    for key in ("dense", "categorical", "labels"):
        assert (getattr(read, key) == getattr(plain, key)).all(), key
    (tmp_path / "cut.tsv").write_bytes(packed.read_bytes()[: packed.stat().st_size // 2])
    with pytest.raises(ValueError, match=f"cut.tsv: the {kind} stream ends early: the file is truncated"):
        preprocess_criteo(tmp_path / "cut.tsv", tmp_path / "cut", ROWS, skip_malformed=True)
    assert not (tmp_path / "cut").exists()  # nothing left but the lock file beside it


def test_zstd_and_zip_files_are_refused_with_how_to_decompress_them(tmp_path):
    for name, head, tool in (("day.zst", b"\x28\xb5\x2f\xfd", "unzstd"), ("day.zip", b"PK\x03\x04", "unzip")):
        (tmp_path / name).write_bytes(head + b"\0" * 100)
        with pytest.raises(ValueError, match=rf"{name} is a \w+ file; decompress it first \(e.g. `{tool} "):
            preprocess_criteo(tmp_path / name, tmp_path / f"{name}.neorec" / "train", ROWS, skip_malformed=True)
    # the refusal left an empty out/train folder; now only the lock file beside it (see preprocess_criteo)
    for name in ("day.zip", "day.zst"):
        assert [p.name for p in (tmp_path / f"{name}.neorec").iterdir()] == ["train.lock"]


def test_rebuilding_with_wider_ids_removes_the_narrow_copy(tsv, tmp_path):
    """categorical.i32 stayed beside the new categorical.i64 (hundreds of GB for the Terabyte logs)."""
    out = tmp_path / "out"
    load_or_preprocess(tsv, out, ROWS)
    assert (out / "categorical.i32").exists()
    load_or_preprocess(tsv, out, 2**31 + 5)
    assert sorted(p.name for p in out.iterdir()) == ["categorical.i64", "dense.f32", "labels.u8", "meta.json"]
    assert open_processed(out).categorical.dtype.name == "int64"
