"""``neorec train --nproc 2 --plan auto``: the ranks plan for the live world and train on that plan.

    python -m pytest tests/distributed/test_plan_auto.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.toml")
SMALL = ["--set", "data.synthetic.num_train_samples=2000", "--set", "data.synthetic.num_eval_samples=500",
         "--set", "data.batch_size=128", "--no-progress"]


def test_train_with_plan_auto(tmp_path):
    env = dict(os.environ, NEOREC_CALIBRATION=str(tmp_path / "absent.json"))
    run = subprocess.run([sys.executable, "-m", "neorec", "train", "--config", TINY, "--nproc", "2", "--plan", "auto",
                          "--max-steps", "3", "--output-dir", str(tmp_path), *SMALL],
                         capture_output=True, text=True, timeout=150, cwd=ROOT, env=env)
    assert run.returncode == 0, run.stderr
    assert "distributed: 2 ranks (gloo)" in run.stdout and run.stdout.count("final eval: AUC") == 1
    final = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()][-1]
    assert final["kind"] == "final" and final["step"] == 3
