"""SIGKILL a rank of ``neorec train --nproc 2`` mid-training; ``--resume`` finishes the job with
weights identical to an uninterrupted run (fp32; full and incremental checkpoints).

    python -m pytest tests/integration/test_checkpoint_kill.py -q
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from neorec.config import load_config
from neorec.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.toml")
SMALL = ["data.synthetic.num_train_samples=1200", "data.synthetic.num_eval_samples=200", "data.batch_size=64",
         "data.eval_batch_size=200", "train.epochs=3", "train.max_steps=18", "checkpoint.every_steps=3",
         "checkpoint.incremental=true", "checkpoint.full_when_fraction_exceeds=1.5", "train.num_threads=1"]


def command(directory: Path, *extra):
    sets = [a for s in SMALL + [f"checkpoint.dir='{directory}'", f"train.output_dir='{directory / 'out'}'"]
            for a in ("--set", s)]
    return [sys.executable, "-m", "neorec", "train", "--config", TINY, "--nproc", "2", "--no-progress", *sets, *extra]


def children(pid: int):
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def final_state(directory: Path):
    cfg = load_config(TINY, SMALL + [f"train.output_dir='{directory / 'check'}'", "train.progress=false"])
    trainer = Trainer(cfg, out=io.StringIO(), resume=str(directory))
    trainer.fit()  # at max_steps already: restores only
    tbe = trainer.model.sparse_arch.tbe
    state = {t.name: tbe.get_table_weight(t.name) for t in tbe.tables}
    state.update({f"{t.name}.m": tbe.get_optimizer_state(t.name)["momentum1"] for t in tbe.tables})
    state.update({k: v for k, v in trainer.model.state_dict().items() if not k.startswith("sparse_arch")})
    return trainer.step, state


def test_sigkill_a_rank_then_resume_equals_uninterrupted(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    reference = subprocess.run(command(tmp_path / "ref"), cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert reference.returncode == 0, reference.stderr

    job = subprocess.Popen(command(tmp_path / "job"), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 200
    while not (tmp_path / "job" / "step-000000006" / "manifest.json").exists():
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()
        time.sleep(0.02)
    ranks = children(job.pid)
    assert len(ranks) == 2
    os.kill(max(ranks), signal.SIGKILL)  # the younger child: rank 1
    _, stderr = job.communicate(timeout=120)
    assert job.returncode != 0, "the job finished before the kill; the test needs a slower run"
    assert not (tmp_path / "job" / "step-000000018").exists()

    resumed = subprocess.run(command(tmp_path / "job", "--resume", str(tmp_path / "job")), cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "checkpoint: resumed from" in resumed.stdout

    step, expected = final_state(tmp_path / "ref")
    resumed_step, actual = final_state(tmp_path / "job")
    assert step == resumed_step == 18
    for key in expected:
        assert torch.equal(expected[key], actual[key]), key
