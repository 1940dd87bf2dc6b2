"""``neorec train --nproc 2 --plan auto``: the ranks plan for the live world and train on that plan.

    python -m pytest tests/distributed/test_plan_auto.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import workers
from harness import run_ranks

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.toml")
SMALL = ["--set", "data.synthetic.num_train_samples=2000", "--set", "data.synthetic.num_eval_samples=500",
         "--set", "data.batch_size=128", "--no-progress"]


@pytest.mark.parametrize("cached", [False, True])
def test_train_with_plan_auto(tmp_path, cached):
    """(cached: [embedding.location] puts t_feature_2 behind a cache over SSD; the plan keeps it there.)"""
    env = dict(os.environ, NEOREC_CALIBRATION=str(tmp_path / "absent.json"))
    location = ["--set", "embedding.location.default='cached_ssd'", "--set", "embedding.location.min_rows=1500",
                "--set", f"embedding.location.ssd_dir='{tmp_path / 'ssd'}'"] if cached else []
    run = subprocess.run([sys.executable, "-m", "neorec", "train", "--config", TINY, "--nproc", "2", "--plan", "auto",
                          "--max-steps", "3", "--output-dir", str(tmp_path), *SMALL, *location],
                         capture_output=True, text=True, timeout=150, cwd=ROOT, env=env)
    assert run.returncode == 0, run.stderr
    assert "distributed: 2 ranks (gloo)" in run.stdout and run.stdout.count("final eval: AUC") == 1
    assert ("embedding cache: t_feature_2 hit rate" in run.stdout) == cached, run.stdout
    final = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()][-1]
    assert final["kind"] == "final" and final["step"] == 3


def test_plan_auto_is_made_on_rank_0_and_sent_to_the_others(tmp_path):
    """Ranks of other nodes may read other calibration files: rank 0 plans alone and every rank
    trains on its plan; a planning error on rank 0 stops every rank with it instead of leaving
    the others waiting."""
    plans = run_ranks(workers.plan_on_rank_0, 3, tmp_path / "ok", args=(False,), timeout=60)
    assert plans == ["plan of rank 0 " + "é" * 1000] * 3
    errors = run_ranks(workers.plan_on_rank_0, 3, tmp_path / "fail", args=(True,), timeout=60)
    assert errors == ["raised: table 't0' fits no rank (planned on rank 0)"] + \
        ["raised: rank 0 could not plan: table 't0' fits no rank (planned on rank 0)"] * 2


def test_plan_auto_refuses_nodes_of_unequal_size_on_every_rank(tmp_path):
    """Rank 0's node of 1 rank divides a world of 3 (its own check passed), but the other node runs 2:
    every rank sees every rank's LOCAL_WORLD_SIZE and all refuse alike, none waits for a plan."""
    assert run_ranks(workers.ranks_per_node, 3, tmp_path / "even", args=([3, 3, 3],), timeout=60) == ["3"] * 3
    refused = run_ranks(workers.ranks_per_node, 3, tmp_path / "uneven", args=([1, 2, 2],), timeout=60)
    assert refused == ["raised: --plan auto plans for nodes of equal size, but the ranks' LOCAL_WORLD_SIZE differ: "
                       "1 (1 rank) and 2 (2 ranks); make a plan for this world with `neorec plan --topology FILE "
                       "--out plan.json` and pass --plan plan.json"] * 3
