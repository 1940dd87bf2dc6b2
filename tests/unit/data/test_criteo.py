"""Criteo: writer, streaming preprocessor (equal to a line-by-line reference, bounded memory,
malformed lines, stale caches) and the memory-mapped source."""

import json
import math
import os
import tracemalloc

import numpy as np
import pytest
import torch

from neorec.data import CriteoConfig, DataConfig, criteo_tsv, make_data_source
from neorec.data.criteo import (CriteoSource, cache_is_fresh, categorical_id, load_or_preprocess,
                                open_processed, preprocess_criteo, write_criteo_tsv)

ROWS = 1000  # num_embeddings of the processed tables


def reference(lines, num_embeddings=ROWS):
    """Line-by-line parse with Python's int(): dense [N, 13], categorical [N, 26], labels [N]."""
    dense, cats, labels = [], [], []
    for line in lines:
        fields = line.rstrip("\r\n").split("\t")
        assert len(fields) == 40
        labels.append(int(fields[0]))
        dense.append([math.log1p(max(int(x), 0)) if x else 0.0 for x in fields[1:14]])
        cats.append([categorical_id(x, c, num_embeddings) for c, x in enumerate(fields[14:])])
    return np.array(dense, np.float32).reshape(-1, 13), np.array(cats).reshape(-1, 26), np.array(labels)


def assert_matches(arrays, lines, num_embeddings=ROWS):
    dense, cats, labels = reference(lines, num_embeddings)
    np.testing.assert_allclose(arrays.dense, dense, rtol=1e-6)
    np.testing.assert_array_equal(arrays.categorical, cats)
    np.testing.assert_array_equal(arrays.labels, labels)


@pytest.fixture(scope="module")
def tsv(tmp_path_factory):
    path = tmp_path_factory.mktemp("criteo") / "day_0.tsv"
    write_criteo_tsv(path, 3000, seed=3)
    return path


def test_writer_layout(tsv):
    lines = tsv.read_text().splitlines()
    assert len(lines) == 3000
    fields = [line.split("\t") for line in lines]
    assert all(len(f) == 40 for f in fields)
    assert {f[0] for f in fields} == {"0", "1"}
    integers = [int(x) for f in fields for x in f[1:14] if x]
    assert min(integers) < 0  # negative values as in the real logs
    assert any(x == "" for f in fields for x in f[1:14]) and any(x == "" for f in fields for x in f[14:])
    assert all(len(x) == 8 and int(x, 16) >= 0 for f in fields for x in f[14:] if x)
    rate = np.mean([f[0] == "1" for f in fields])
    assert 0.15 < rate < 0.45
    other = tsv.with_name("again.tsv")
    write_criteo_tsv(other, 3000, seed=3)
    assert other.read_bytes() == tsv.read_bytes()  # a pure function of the seed


def test_preprocess_equals_line_by_line_parse(tsv, tmp_path):
    stats = preprocess_criteo(tsv, tmp_path / "out", ROWS, chunk_lines=500)
    assert (stats.num_lines, stats.num_rows, stats.num_skipped) == (3000, 3000, 0)
    assert stats.lines_per_second > 0 and stats.num_bytes == tsv.stat().st_size
    arrays = open_processed(tmp_path / "out")
    assert isinstance(arrays.dense, np.memmap) and arrays.dense.shape == (3000, 13)
    assert arrays.categorical.dtype == np.int32 and arrays.categorical.shape == (3000, 26)
    assert_matches(arrays, tsv.read_text().splitlines())
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["num_rows"] == 3000 and meta["num_embeddings"] == ROWS
    assert meta["source"]["size"] == tsv.stat().st_size
    assert not [p for p in os.listdir(tmp_path / "out") if "tmp" in p]


def test_chunk_size_does_not_change_the_result(tsv, tmp_path):
    small = tmp_path / "small.tsv"
    small.write_bytes(b"".join(tsv.read_bytes().splitlines(keepends=True)[:200]))
    outputs = []
    for chunk_lines in (1, 7, 10_000):
        preprocess_criteo(small, tmp_path / f"out{chunk_lines}", ROWS, chunk_lines=chunk_lines)
        a = open_processed(tmp_path / f"out{chunk_lines}")
        outputs.append((np.array(a.dense), np.array(a.categorical), np.array(a.labels)))
    for other in outputs[1:]:
        for x, y in zip(outputs[0], other):
            np.testing.assert_array_equal(x, y)


def test_unusual_but_valid_values_take_the_careful_path(tmp_path):
    """Hex values of other widths, upper case, 16 digits, CRLF line ends, no final newline."""
    base = ["1", "0", "-3", "", "123456789012345678", "7", "", "0", "1", "2", "3", "4", "5", "6"]
    cats = ["ff", "0123456789ABCDEF", "", "a", "DeadBeef"] + ["%08x" % (i * 7919) for i in range(21)]
    lines = ["\t".join(base + cats), "\t".join(["0"] + [""] * 13 + [""] * 26)]
    path = tmp_path / "odd.tsv"
    path.write_bytes(("\r\n".join(lines)).encode())
    preprocess_criteo(path, tmp_path / "out", ROWS)
    assert_matches(open_processed(tmp_path / "out"), lines)
    # the fast and careful paths agree on regular data
    regular = ["\t".join(base + ["%08x" % (i * 31 + j) for i in range(26)]) for j in range(50)]
    buf = ("\n".join(regular) + "\n").encode()
    a = np.frombuffer(buf, np.uint8)
    fast, careful = criteo_tsv._parse_regular(a, ROWS), criteo_tsv._parse_careful(a, 1, ROWS)
    assert fast is not None
    for key in ("dense", "categorical", "labels"):
        np.testing.assert_array_equal(getattr(fast, key), getattr(careful, key))


GOOD = "\t".join(["1"] + ["5"] * 13 + ["0a0b0c0d"] * 26)


@pytest.mark.parametrize(
    "bad_line, reason",
    [
        ("\t".join(["1"] + ["5"] * 13 + ["0a0b0c0d"] * 25), "expected 40 tab-separated columns .* found 39"),
        (GOOD.replace("\t5\t", "\t5x\t", 1), r"integer column I1 \(column 2\) holds '5x'"),
        (GOOD.replace("\t5\t", "\t1.5\t", 1), r"integer column I1 \(column 2\) holds '1.5', expected an integer"),
        (GOOD.replace("\t5\t", "\t-\t", 1), r"integer column I1 \(column 2\) holds '-', expected an integer"),
        (GOOD.replace("\t5\t", "\t" + "9" * 19 + "\t", 1),
         "integer column I1 .* holds '9+', expected an integer of at most 18 digits"),
        (GOOD.replace("0a0b0c0d", "0a0b0g0d", 1), r"categorical column C1 \(column 15\) holds '0a0b0g0d'"),
        (GOOD.replace("0a0b0c0d", "0" * 17, 1),
         "categorical column C1 .* holds '0+', expected a hexadecimal string of at most 16 digits"),
        ("2" + GOOD[1:], r"label \(column 1\) holds '2', expected 0 or 1"),
        (GOOD[1:], "label .* holds '', expected 0 or 1"),
        ("", "the line is empty; expected 40 tab-separated columns .* found 1"),
        ("\r", "the line is empty; expected 40 tab-separated columns .* found 1"),
    ],
)
def test_malformed_line_raises_with_line_number(tmp_path, bad_line, reason):
    path = tmp_path / "bad.tsv"
    path.write_text("\n".join([GOOD] * 6 + [bad_line] + [GOOD] * 3) + "\n")
    with pytest.raises(ValueError, match=f"bad.tsv:7: {reason}"):
        preprocess_criteo(path, tmp_path / "out", ROWS, chunk_lines=4)
    assert not (tmp_path / "out" / "meta.json").exists()
    stats = preprocess_criteo(path, tmp_path / "out", ROWS, skip_malformed=True, chunk_lines=4)
    assert (stats.num_lines, stats.num_rows, stats.num_skipped) == (10, 9, 1)
    assert stats.skipped_examples[0].startswith("line 7:")
    assert_matches(open_processed(tmp_path / "out"), [GOOD] * 9)


def test_skip_counts_several_bad_lines_across_chunks(tmp_path):
    lines = [GOOD, "junk", GOOD, "0\tx", GOOD, GOOD.replace("0a0b0c0d", "zz", 1), GOOD]
    path = tmp_path / "bad.tsv"
    path.write_text("\n".join(lines) + "\n")
    stats = preprocess_criteo(path, tmp_path / "out", ROWS, skip_malformed=True, chunk_lines=3)
    assert (stats.num_rows, stats.num_skipped) == (4, 3)
    assert [e.split(":")[0] for e in stats.skipped_examples] == ["line 2", "line 4", "line 6"]


def test_bounded_memory_while_streaming(tsv, tmp_path):
    big = tmp_path / "big.tsv"
    with open(big, "wb") as f:  # ~6 MB: the module's file repeated
        for _ in range(8):
            f.write(tsv.read_bytes())
    size = big.stat().st_size
    tracemalloc.start()
    try:
        stats = preprocess_criteo(big, tmp_path / "out", ROWS, chunk_lines=128)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert stats.num_rows == 24_000 and size > 5_000_000
    assert peak < size / 6, (peak, size)  # chunk-sized (~30 kB of text here), not file-sized


def test_stale_cache_is_rebuilt(tsv, tmp_path):
    path, out = tmp_path / "day.tsv", tmp_path / "cache"
    path.write_bytes(tsv.read_bytes())
    arrays = load_or_preprocess(path, out, ROWS)
    assert arrays.num_rows == 3000 and cache_is_fresh(path, out, ROWS)
    built = (out / "meta.json").stat().st_mtime_ns
    load_or_preprocess(path, out, ROWS)
    assert (out / "meta.json").stat().st_mtime_ns == built  # fresh cache reused
    assert not cache_is_fresh(path, out, ROWS + 1)  # other table size
    write_criteo_tsv(path, 1200, seed=4)  # the source changed
    assert not cache_is_fresh(path, out, ROWS)
    arrays = load_or_preprocess(path, out, ROWS)
    assert arrays.num_rows == 1200
    assert_matches(arrays, path.read_text().splitlines())
    (out / "labels.u8").write_bytes(b"\0")  # a damaged data file
    assert not cache_is_fresh(path, out, ROWS)
    assert load_or_preprocess(path, out, ROWS).num_rows == 1200


def test_a_same_size_file_with_the_old_mtime_is_seen_as_changed(tsv, tmp_path):
    """`cp -p` of another day's file of the same size keeps the mtime: size and mtime alone said the
    cache was fresh and training read the old day's rows."""
    import os

    path, out = tmp_path / "day.tsv", tmp_path / "cache"
    path.write_bytes(tsv.read_bytes())
    load_or_preprocess(path, out, ROWS)
    stat = path.stat()
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[1:] + lines[:1]))  # same bytes in another order: same size
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size and path.stat().st_mtime_ns == stat.st_mtime_ns
    assert not cache_is_fresh(path, out, ROWS)
    assert_matches(load_or_preprocess(path, out, ROWS), path.read_text().splitlines())
    meta = json.loads((out / "meta.json").read_text())
    del meta["source"]["sample_sha256"]  # a cache written before the fingerprint: size and mtime decide
    (out / "meta.json").write_text(json.dumps(meta))
    assert cache_is_fresh(path, out, ROWS)


def test_source_batches(tsv, tmp_path):
    cfg = CriteoConfig(train_path=str(tsv), processed_dir=str(tmp_path / "p"), eval_fraction=0.1,
                       num_embeddings=ROWS)
    source = make_data_source(DataConfig(source="criteo", criteo=cfg))
    assert isinstance(source, CriteoSource)
    assert (source.num_train_samples(), source.num_eval_samples()) == (2700, 300)
    assert source.feature_names == [f"cat_{i}" for i in range(26)] and source.num_dense == 13
    tables = source.tables(8)
    assert len(tables) == 26 and tables[3].name == "t_cat_3" and tables[3].feature_names == ["cat_3"]
    assert all(t.num_embeddings == ROWS for t in tables)
    dense, cats, labels = reference(tsv.read_text().splitlines())
    batches = list(source.train_batches(1000))
    assert [b.batch_size for b in batches] == [1000, 1000, 700]
    b = batches[1]
    assert b.dense.dtype == torch.float32 and b.labels.dtype == torch.float32
    assert b.sparse.values.dtype == torch.int64 and torch.all(b.sparse.lengths == 1)
    b.sparse.validate()
    np.testing.assert_allclose(b.dense.numpy(), dense[1000:2000], rtol=1e-6)
    np.testing.assert_array_equal(b.sparse["cat_5"].values.numpy(), cats[1000:2000, 5])
    np.testing.assert_array_equal(b.labels.numpy(), labels[1000:2000])
    evaluation = list(source.eval_batches(128))
    np.testing.assert_array_equal(torch.cat([e.labels for e in evaluation]).numpy(), labels[2700:])
    assert len(list(source.train_batches(1000, start_batch=2))) == 1


def test_source_shuffle_and_eval_file(tsv, tmp_path):
    eval_path = tmp_path / "eval.tsv"
    write_criteo_tsv(eval_path, 500, seed=3, held_out=True)
    cfg = CriteoConfig(train_path=str(tsv), eval_path=str(eval_path), processed_dir=str(tmp_path / "p"),
                       num_embeddings=ROWS, shuffle=True, seed=5)
    source = CriteoSource(cfg)
    assert (source.num_train_samples(), source.num_eval_samples()) == (3000, 500)
    _, _, labels = reference(eval_path.read_text().splitlines())
    np.testing.assert_array_equal(torch.cat([b.labels for b in source.eval_batches(64)]).numpy(), labels)

    def rows(epoch, start_batch=0):
        # the dense features identify a row; compare their sums in order
        return torch.cat([b.dense.sum(1) for b in source.train_batches(400, epoch, start_batch)])

    first, again, second = rows(0), rows(0), rows(1)
    assert torch.equal(first, again) and not torch.equal(first, second)
    assert torch.equal(torch.sort(first).values, torch.sort(second).values)  # each row once per epoch
    unshuffled = torch.from_numpy(np.array(open_processed(tmp_path / "p" / "train").dense)).sum(1)
    assert torch.equal(torch.sort(first).values, torch.sort(unshuffled).values)
    assert not torch.equal(first, unshuffled)
    assert torch.equal(rows(1, start_batch=3), second[1200:])


def test_source_errors(tmp_path):
    with pytest.raises(ValueError, match="train_path is empty"):
        CriteoSource(CriteoConfig())
    with pytest.raises(FileNotFoundError, match="nope.tsv"):
        CriteoSource(CriteoConfig(train_path=str(tmp_path / "nope.tsv")))
    assert not (tmp_path / "nope.tsv.neorec").exists()
    tsv = tmp_path / "day.tsv"
    tsv.write_text("")
    (tmp_path / "afile").write_text("")
    with pytest.raises(ValueError, match=r"cannot make .*afile.*processed copy \(data.criteo.processed_dir\): "
                                         r"Not a directory"):  # was a bare [Errno 20]
        CriteoSource(CriteoConfig(train_path=str(tsv), processed_dir=str(tmp_path / "afile" / "x")))
    with pytest.raises(ValueError, match=r"num_embeddings must be in \[2, 2\*\*48\]"):
        CriteoConfig(num_embeddings=1)
