"""The benchmark scripts refuse options they cannot run, and an ``--out`` they cannot write, before
any work (usage errors, exit 2). The work itself is replaced here by a function that fails the test
if it is reached, so no benchmark runs, also against a script that does not check.

    python -m pytest tests/unit/benchmarks/test_bench_usage_errors.py -q
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import pytest

BENCHMARKS = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "benchmarks"))
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)  # the scripts import each other by their bare names

# what each script runs once its options are taken: replaced by a tripwire in these tests
WORK = {
    "bench_aligned_linear": ["AlignedLinear"],
    "bench_allocator": [],
    "bench_cache": ["section_hit_rate", "section_train", "section_big_ssd"],
    "bench_checkpoint": ["bytes_and_ne", "tracking_overhead"],
    "bench_e2e": ["run_cell"],
    "bench_floor": ["fma_peak_gflops", "copy_bandwidth", "random_row_ns", "gemm_step_seconds"],
    "bench_interaction_blocks": ["native_available"],
    "bench_pipeline": ["run_variant", "VethPair"],
    "bench_planner": ["run_suite", "run_paper"],
    "bench_planner_measured": ["run_world"],
    "bench_sharding": ["measure_bytes", "measure_speed"],
    "bench_tbe": ["bench_config"],
    "bench_transport": [],
    "bench_triton_cache": ["timing_device"],
    "bench_triton_tbe": ["timing_device"],
    "trace_timeline": ["events"],
}


def _script(name: str, monkeypatch):
    module = importlib.import_module(name)
    for attribute in WORK[name]:
        def tripwire(*args, _name=f"{name}.{attribute}", **kwargs):
            raise AssertionError(f"{_name} ran: the options were not refused before the work")
        monkeypatch.setattr(module, attribute, tripwire)
    return module


def _refused(module, argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        module.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    return err


# ---------------------------------------------------------------------------------- --out
OUT_SCRIPTS = [("bench_tbe", []), ("bench_cache", []), ("bench_checkpoint", []), ("bench_floor", []),
               ("bench_planner", []), ("bench_planner_measured", []), ("bench_sharding", ["--part", "speed"]),
               ("bench_pipeline", ["--network", "loopback"]), ("bench_e2e", []), ("bench_triton_tbe", []),
               ("bench_triton_cache", [])]


@pytest.mark.parametrize("script, argv", OUT_SCRIPTS)
def test_an_out_that_cannot_be_written_is_refused_before_the_work(script, argv, tmp_path, monkeypatch, capsys):
    """Every script made the folder and opened the file only at the end: a run of minutes or hours
    was lost to a --out naming a directory, or a folder under a file."""
    module = _script(script, monkeypatch)
    err = _refused(module, argv + ["--out", str(tmp_path)], capsys)
    assert "argument --out:" in err and "is a directory" in err, err
    (tmp_path / "file").write_text("")
    err = _refused(module, argv + ["--out", str(tmp_path / "file" / "r.json")], capsys)
    assert "argument --out:" in err and "is not a directory" in err, err


def test_check_out_makes_nothing_and_takes_a_writable_file(tmp_path, monkeypatch):
    """It made --out's folders, and a run refused right after for another reason (bench_e2e without
    the peers, the Triton scripts without CUDA) left them; and it refused a writable file in a
    folder it could not write in (--out /dev/null as a user)."""
    import bench_args

    out = tmp_path / "new" / "sub" / "r.json"
    assert bench_args.out_problem(str(out)) is None
    assert not (tmp_path / "new").exists()
    assert "is a directory" in bench_args.out_problem(str(tmp_path / "new") + "/")
    bench_args.check_out(argparse.ArgumentParser(), "")  # no --out: nothing to check
    existing = tmp_path / "ro" / "r.json"
    existing.parent.mkdir()
    existing.write_text("")
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(existing.parent) else real_access(p, mode))
    assert bench_args.out_problem(str(existing)) is None  # written in place
    assert "is not writable" in bench_args.out_problem(str(existing.parent / "other.json"))


# ---------------------------------------------------------------------------------- help texts
class _Parser(Exception):
    pass


@pytest.mark.parametrize("script", sorted(WORK))
def test_every_option_says_what_it_does(script, monkeypatch):
    def grab(self, *args, **kwargs):
        raise _Parser(self)

    module = _script(script, monkeypatch)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", grab)
    with pytest.raises(_Parser) as got:
        module.main([])
    parser = got.value.args[0]
    bare = [action.option_strings[0] for action in parser._actions if action.option_strings and not action.help]
    assert bare == [], f"{script}: options without a help text: {bare}"


# ---------------------------------------------------------------------------------- bench_sharding
def test_bench_sharding_refuses_more_steps_than_the_data_holds(monkeypatch, capsys):
    """--worlds 4 --steps 200: the loop stopped at the data's 122 full batches but divided the bytes
    by 200 (0.960 MB per step for table_wise output_dist instead of 1.573)."""
    module = _script("bench_sharding", monkeypatch)
    err = _refused(module, ["--part", "bytes", "--worlds", "2,4", "--steps", "123"], capsys)
    assert "argument --steps:" in err and "122 full batches at 4 ranks" in err, err
    assert module.full_batches(2) == 244 and module.full_batches(4) == 122  # 500000 samples, 1024 per rank
    counted = []
    monkeypatch.setattr(module, "measure_bytes", lambda world, steps: counted.append((world, steps)) or {})
    module.main(["--part", "bytes", "--worlds", "2,4", "--steps", "122"])
    assert counted == [(2, 122), (4, 122)]


@pytest.mark.parametrize("worlds", ["1", "3", "2,5"])
def test_bench_sharding_refuses_world_sizes_its_plans_cannot_place(worlds, monkeypatch, capsys):
    """--worlds 1 failed inside the spawned ranks: "ranks_per_node must be >= 1 and divide world_size
    1, got 2"."""
    err = _refused(_script("bench_sharding", monkeypatch), ["--part", "bytes", "--worlds", worlds], capsys)
    assert "argument --worlds:" in err, err


# ---------------------------------------------------------------------------------- bench_checkpoint
@pytest.mark.parametrize("argv, said", [
    (["--quick", "--steps", "15"], "20 is more than --steps 15"),  # --quick's default intervals 10,20
    (["--steps", "5", "--intervals", "10"], "10 is more than --steps 5"),
    (["--steps", "40", "--intervals", "10,50"], "50 is more than --steps 40"),
])
def test_bench_checkpoint_refuses_intervals_longer_than_the_run(argv, said, monkeypatch, capsys):
    """No checkpoint was taken: StatisticsError after all the training."""
    err = _refused(_script("bench_checkpoint", monkeypatch), argv, capsys)
    assert "argument --intervals:" in err and said in err, err
    assert ("--quick's default --intervals 10,20" in err) == ("--quick" in argv), err


def test_bench_checkpoint_quick_defaults_pass_their_own_check(monkeypatch, tmp_path):
    module = _script("bench_checkpoint", monkeypatch)
    ran = []
    monkeypatch.setattr(module, "bytes_and_ne", lambda args, intervals, tmp, results: ran.append(intervals))
    monkeypatch.setattr(module, "tracking_overhead", lambda args: {"step_ms_off": 1.0, "step_ms_on": 1.0,
                                                                   "ratio_on_off": 1.0, "tables": ""})
    assert module.main(["--quick"]) == 0
    assert module.main(["--quick", "--steps", "15", "--intervals", "5,15"]) == 0
    assert ran == [[10, 20], [5, 15]]


# ---------------------------------------------------------------------------------- bench_planner
@pytest.mark.parametrize("argv, option", [
    (["--models", "bogus"], "--models"),  # refused only after the suite had run
    (["--models", "dlrm-criteo-kaggle"], "--models"),  # no paper QPS: a TypeError after the suite
    (["--models", ","], "--models"),
    (["--time-limit", "-1"], "--time-limit"),
    (["--time-limit", "nan"], "--time-limit"),
])
def test_bench_planner_refuses_unknown_models_and_negative_time_limits(argv, option, monkeypatch, capsys):
    err = _refused(_script("bench_planner", monkeypatch), argv, capsys)
    assert f"argument {option}:" in err, err


def test_bench_planner_takes_the_paper_presets_and_no_search(monkeypatch):
    module = _script("bench_planner", monkeypatch)
    seen = []
    monkeypatch.setattr(module, "run_suite", lambda tasks, limit: seen.append(limit) or {})
    monkeypatch.setattr(module, "run_paper", lambda rounds, models: seen.append(models) or {})
    module.main(["--models", "neo-model-f, neo-model-i", "--time-limit", "0"])
    assert seen == [0.0, ["neo-model-f", "neo-model-i"]]
    assert module.PAPER_MODELS == ("neo-model-a", "neo-model-f", "neo-model-i")


# ---------------------------------------------------------------------------------- the others
@pytest.mark.parametrize("script, argv, said", [
    ("bench_tbe", ["--configs", ","], "argument --configs: no config"),  # ran nothing, exit 0
    ("bench_pipeline", ["--network", "loopback", "--variants", ","], "argument --variants: no variant"),
    ("bench_pipeline", ["--network", "loopback", "--timeout", "0"], "argument --timeout:"),
    ("trace_timeline", ["/nonexistent/t_pool20_r2", "--start", "5", "--end", "1"], "argument --end:"),
])
def test_empty_selections_and_empty_ranges_are_refused(script, argv, said, monkeypatch, capsys):
    err = _refused(_script(script, monkeypatch), argv, capsys)
    assert said in err, err


@pytest.mark.parametrize("argv, repeats", [([], 7), (["--quick"], 3), (["--quick", "--repeats", "5"], 5),
                                           (["--repeats", "2"], 2)])
def test_bench_tbe_quick_keeps_a_given_repeats(argv, repeats, monkeypatch):
    """--quick replaced --repeats with 3 even when --repeats was given."""
    module = _script("bench_tbe", monkeypatch)
    seen = []

    def bench_config(config, count, steps, warmup, use_fbgemm):
        seen.append(count)
        return {"median_ms": {"neorec": 1.0, "neorec_torch": 1.0}}

    monkeypatch.setattr(module, "bench_config", bench_config)
    assert module.main(argv + ["--configs", "pool1", "--no-fbgemm"]) == 0
    assert seen == [repeats]


@pytest.mark.parametrize("script", ["bench_triton_tbe", "bench_triton_cache"])
def test_gpu_benchmarks_document_their_exit_status_without_cuda(script):
    """The docstrings said "Without CUDA it says so and exits 0"; the scripts exit 2 (RESULTS.md too)."""
    doc = importlib.import_module(script).__doc__
    assert "exits 2" in doc and "exits 0" not in doc
