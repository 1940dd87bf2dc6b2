"""The benchmark scripts' own plumbing (argument checks, output paths, child errors), without
running the benchmarks themselves (one worker step of ``bench_allocator`` aside, marked slow).

    python -m pytest tests/unit/benchmarks -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "benchmarks")
BENCHMARKS = os.path.normpath(BENCHMARKS)
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)  # the scripts import each other by their bare names


def test_triton_smoke_run_without_out_writes_nothing_and_full_run_writes_into_the_repository():
    from bench_triton_tbe import output_path

    assert output_path(None, True, "bench_triton_tbe") is None  # never over the GPU results
    assert output_path("/tmp/x.json", True, "bench_triton_tbe") == "/tmp/x.json"
    assert output_path("rel.json", False, "bench_triton_cache") == "rel.json"
    default = output_path(None, False, "bench_triton_cache")
    assert default == os.path.join(BENCHMARKS, "results", "bench_triton_cache.json")  # not the cwd's


def test_interaction_blocks_refuses_rounds_that_leave_nothing_after_the_warm_up(capsys):
    import bench_interaction_blocks

    for rounds in ("5", "0", "x"):
        with pytest.raises(SystemExit) as exit_info:
            bench_interaction_blocks.main(["--rounds", rounds])
        assert exit_info.value.code == 2
        assert "--rounds" in capsys.readouterr().err
    assert bench_interaction_blocks.rounds_arg("6") == 6


def _trace(path: str) -> None:
    with open(path, "w") as f:
        json.dump({"traceEvents": [{"ph": "X", "tid": 1, "ts": 10, "dur": 500, "name": "c10d::barrier"}]}, f)


def test_trace_timeline_reads_the_rank_count_from_the_prefix(tmp_path, capsys):
    import trace_timeline

    assert trace_timeline.ranks_of("/tmp/t_pool20_r1") == 1
    assert trace_timeline.ranks_of("/tmp/t_pool20_r2") == 2
    assert trace_timeline.ranks_of("/tmp/t_pool20") is None
    prefix = str(tmp_path / "t_pool20_r1")
    _trace(prefix + "_rank0.json")
    assert trace_timeline.main([prefix]) == 0
    assert "c10d::barrier" in capsys.readouterr().out
    # no _rW suffix: 2 ranks assumed; the missing file is named and --ranks suggested, no traceback
    _trace(str(tmp_path / "other_rank0.json"))
    assert trace_timeline.main([str(tmp_path / "other")]) == 2
    err = capsys.readouterr().err
    assert "other_rank1.json" in err and "--ranks" in err and len(err.strip().splitlines()) == 1
    assert trace_timeline.main([str(tmp_path / "other"), "--ranks", "1"]) == 0


def test_bench_allocator_shows_a_failed_childs_error(monkeypatch, capsys):
    import bench_allocator

    monkeypatch.setattr(bench_allocator, "WORKER", "raise TypeError('child went wrong')")
    assert bench_allocator.main(["--pairs", "1", "--runs", "1", "--steps", "1"]) == 1
    err = capsys.readouterr().err
    assert "TypeError: child went wrong" in err and "failed" in err


@pytest.mark.slow
def test_bench_allocator_worker_runs_against_bench_e2e():
    """One process of the benchmark at its smallest (about 10 s): it must keep up with bench_e2e's
    ``NeorecRunner``. It measures neorec alone and needs no peer installed (bench_e2e's batches
    imported torchrec for batches this benchmark never used)."""
    import bench_allocator

    out = subprocess.run([sys.executable, "-c", bench_allocator.WORKER, BENCHMARKS, "pool1", "0", "1", "1", "1"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["ms"] > 0 and r["max_rss_mb"] > 0 and set(r) == {"ms", "faults", "system_ms", "max_rss_mb"}


def test_planner_measured_correlates_busy_ranks_only_and_ranks_ties_by_their_mean():
    """Idle ranks (predicted 0, measured only their empty call) sat at the origin and inflated the
    correlation; tied values got distinct ranks."""
    from bench_planner_measured import spearman, summarize

    assert spearman([1, 2, 2, 3], [1, 2, 2, 3]) == pytest.approx(1.0)
    assert spearman([1, 1, 1, 2], [4, 3, 2, 5]) == pytest.approx(0.7745966, rel=1e-6)  # ties share rank 1
    busy = [{"world": 2, "plan": "p", "rank": r, "predicted_compute": p, "measured_compute": m,
             "predicted_step": 1.0, "measured_step": 1.0} for r, (p, m) in enumerate([(1.0, 3.0), (2.0, 1.0), (3.0, 2.0)])]
    idle = [{**busy[0], "rank": 9, "predicted_compute": 0.0, "measured_compute": 6e-6}] * 3
    compute = ("points_compute", "pearson_compute", "spearman_compute", "median_ratio_compute")
    assert [summarize(busy + idle)[k] for k in compute] == [summarize(busy)[k] for k in compute]
    assert summarize(busy)["points_compute"] == 3
    assert summarize(busy)["pearson_compute"] == pytest.approx(-0.5)


@pytest.mark.parametrize("script, argv, option", [
    ("bench_tbe", ["--steps", "0"], "--steps"),
    ("bench_aligned_linear", ["--rounds", "0"], "--rounds"),
    ("bench_transport", ["--repeats", "0"], "--repeats"),
    ("bench_e2e", ["--repeats", "-1"], "--repeats"),
    ("bench_sharding", ["--samples", "2000"], "--samples"),  # 0 steps: --max-steps 0 = a whole epoch
    ("bench_sharding", ["--part", "bytes", "--worlds", "0"], "--worlds"),  # printed a table of 0.000 MB
    ("bench_planner_measured", ["--worlds", "2,0"], "--worlds"),  # a traceback after the parsing
])
def test_counts_that_leave_nothing_to_time_are_usage_errors(script, argv, option, capsys):
    """--rounds 0 / --repeats 0 ran the work, then stopped on "no median for empty data"; --steps 0 on
    a division by zero."""
    import importlib

    module = importlib.import_module(script)
    with pytest.raises(SystemExit) as exit_info:
        module.main(argv)
    assert exit_info.value.code == 2
    assert f"argument {option}: must be >= " in capsys.readouterr().err


def test_bench_tbe_takes_no_warm_up():
    import bench_tbe

    config = bench_tbe.BenchConfig("tiny", 2, 50, 8, 4, 2)
    result = bench_tbe.bench_config(config, repeats=1, steps=1, warmup=0, use_fbgemm=False)
    assert all(len(times) == 1 and times[0] > 0 for times in result["all_ms"].values())


def test_bench_e2e_without_its_peers_says_so_before_any_work(monkeypatch, capsys):
    import importlib.util

    import bench_e2e

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchrec" else real(name, *a))
    assert bench_e2e.main(["--quick", "--ranks", "1"]) == 2
    captured = capsys.readouterr()
    assert "torchrec" in captured.err and "benchmarks/requirements-peers.txt" in captured.err
    assert captured.out == ""  # no table header for a run that cannot start


def test_bench_sharding_shows_the_failed_runs_own_error(monkeypatch):
    import bench_sharding

    def failed(command, **kwargs):
        return subprocess.CompletedProcess(command, 1, "", "neorec train (rank 1): error: ValueError: boom\n")

    monkeypatch.setattr(bench_sharding.subprocess, "run", failed)
    with pytest.raises(RuntimeError, match=r"(?s)--nproc 2 failed \(exit 1\):.*rank 1\): error: ValueError: boom"):
        bench_sharding.train_qps(2, 4096, 0)


def test_bench_pipeline_kills_its_ranks_and_removes_their_folder_on_a_timeout(monkeypatch, tmp_path):
    """A timeout left both ranks training on as orphans, and every run left its output folder."""
    import argparse

    import bench_pipeline

    started = []
    real_popen = subprocess.Popen

    def sleeper(command, **kwargs):
        started.append(real_popen([sys.executable, "-c", "import time; time.sleep(120)"]))
        return started[-1]

    monkeypatch.setattr(bench_pipeline.subprocess, "Popen", sleeper)
    monkeypatch.setattr(bench_pipeline.tempfile, "mkdtemp", lambda prefix: str(tmp_path / "out"))
    (tmp_path / "out").mkdir()
    args = argparse.Namespace(steps=1, batch=8, timeout=0.5)
    with pytest.raises(subprocess.TimeoutExpired):
        bench_pipeline.run_variant("plain", args, None, 29500)
    assert len(started) == 2 and all(p.poll() is not None for p in started)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("script", ["bench_triton_tbe", "bench_triton_cache"])
def test_gpu_benchmarks_without_a_gpu_exit_non_zero_and_write_nothing(script, tmp_path, monkeypatch, capsys):
    """They said "no CUDA device here" and exited 0: a CPU run of the documented GPU commands
    counted as a success for a script checking exit codes."""
    import importlib

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    module = importlib.import_module(script)
    out = tmp_path / "r.json"
    assert module.main(["--out", str(out)]) == 2
    assert "no CUDA device here" in capsys.readouterr().err and not out.exists()


def test_bench_checkpoint_quick_keeps_the_options_given(tmp_path):
    """--quick replaced --steps, --intervals, --after and --repeats even when they were given."""
    import json

    import bench_checkpoint

    out = tmp_path / "out.json"
    bench_checkpoint.main(["--quick", "--tracking-only", "--repeats", "1", "--steps", "5", "--out", str(out)])
    args = json.loads(out.read_text())["args"]
    assert (args["steps"], args["repeats"], args["intervals"], args["after"]) == (5, 1, [10, 20], 20)
