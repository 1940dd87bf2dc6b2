"""``benchmarks/bench_cache.py``'s options, without running the benchmark.

    python -m pytest tests/unit/benchmarks/test_bench_cache_args.py -q
"""

from __future__ import annotations

import os
import sys

import pytest

BENCHMARKS = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "benchmarks"))
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)  # the scripts import each other by their bare names


def test_an_unknown_section_is_refused_with_the_known_ones(capsys):
    """``--sections nope --smoke`` ran nothing and exited 0 without a word."""
    import bench_cache

    with pytest.raises(SystemExit) as exit_info:
        bench_cache.main(["--sections", "nope", "--smoke"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--sections: invalid choice: 'nope'" in err, err
    assert all(f"'{name}'" in err for name in ("hit-rate", "train", "big-ssd")), err
    args = bench_cache.build_parser().parse_args(["--sections", "train", "big-ssd"])
    assert args.sections == ["train", "big-ssd"]
    assert bench_cache.build_parser().parse_args([]).sections == list(bench_cache.SECTIONS)


def test_every_option_says_what_it_does():
    import bench_cache

    bare = [action.option_strings[0] for action in bench_cache.build_parser()._actions
            if action.option_strings and not action.help]
    assert bare == [], f"options without a help text: {bare}"


def _no_sections(monkeypatch):
    import bench_cache

    for name in ("section_hit_rate", "section_train", "section_big_ssd"):
        def tripwire(*args, _name=name, **kwargs):
            raise AssertionError(f"{_name} ran: the options were not refused before the work")
        monkeypatch.setattr(bench_cache, name, tripwire)
    return bench_cache


@pytest.mark.parametrize("argv, option", [
    (["--warmup", "5", "--batches", "5"], "--warmup"),  # LRU/LFU stats never reset, Belady 0, exit 0
    (["--warmup", "200", "--batches", "100"], "--warmup"),
    (["--fractions", "0"], "--fractions"),  # silently dropped
    (["--fractions", "0.1", "1.5"], "--fractions"),
    (["--skews", "-1"], "--skews"),
    (["--skews", "nan"], "--skews"),
    (["--big-steps", "1"], "--big-steps"),  # the child's medians of no data
    (["--data-limit-gb", "0"], "--data-limit-gb"),  # a MemoryError after the other sections had run
    (["--data-limit-gb", "inf"], "--data-limit-gb"),
])
def test_options_that_cannot_give_figures_are_refused_before_the_work(argv, option, monkeypatch, capsys):
    bench_cache = _no_sections(monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        bench_cache.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: " in err, err


def test_smoke_sizes_replace_the_given_ones_before_the_check():
    import bench_cache

    args = bench_cache.parse_args(["--smoke", "--warmup", "5000", "--big-steps", "2", "--skews", "0"])
    assert (args.warmup, args.batches, args.big_steps, args.skews) == (10, 40, 5, [1.05])
    args = bench_cache.parse_args(["--skews", "0", "1.05", "--fractions", "1", "--big-steps", "2"])
    assert (args.skews, args.fractions, args.big_steps) == ([0.0, 1.05], [1.0], 2)


def test_a_cache_size_smaller_than_a_batch_is_said_not_dropped(capsys):
    """A fraction whose cache could not hold one batch's distinct ids was skipped without a word."""
    import argparse

    import bench_cache

    args = argparse.Namespace(rows=2000, batches=3, ids_per_batch=256, warmup=1, ways=8, skews=[1.05],
                              fractions=[0.01, 0.5])
    report = bench_cache.section_hit_rate(args)
    out = capsys.readouterr().out
    assert [row["cache_fraction"] for row in report["results"]] == [0.5]
    assert [(row["cache_fraction"], row["slots"]) for row in report["skipped"]] == [(0.01, 24)]
    assert "not run: a batch has" in out and "more than the cache's 24 slots" in out, out


@pytest.mark.slow
def test_the_resident_variant_has_no_hit_rate_in_strict_json(tmp_path):
    """The training section wrote a bare NaN (not JSON) as the hit rate of the variant without a
    cache. A tiny run of the section (about 5 s)."""
    import json
    import warnings

    import bench_cache

    args = bench_cache.build_parser().parse_args(["--tables", "2000", "500", "100", "--batch-size", "64", "--warmup-steps", "1",
                                   "--steps", "1", "--rounds", "1", "--threads", "1", "--dim", "8"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the tiny caches grow to a batch
        report = bench_cache.section_train(args, str(tmp_path))
    text = json.dumps(report, allow_nan=False)  # raised on NaN
    hits = {row["variant"]: row["hit_rate"] for row in json.loads(text)["results"]}
    assert hits["resident"] is None and all(0 <= hit <= 1 for name, hit in hits.items() if name != "resident")
