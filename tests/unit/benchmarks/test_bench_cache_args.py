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
