"""SIGKILL a rank of ``neorec train --nproc 2`` mid-training; ``--resume`` finishes the job with
weights identical to an uninterrupted run (fp32; full and incremental checkpoints). Under
``torchrun --max-restarts`` the restarted workers resume by themselves, with the same result.

    python -m pytest tests/integration/test_checkpoint_kill.py -q
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from neorec.config import load_config
from neorec.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.toml")
SMALL = ["data.synthetic.num_train_samples=1200", "data.synthetic.num_eval_samples=200", "data.batch_size=64",
         "data.eval_batch_size=200", "train.epochs=3", "train.max_steps=18", "checkpoint.every_steps=3",
         "checkpoint.incremental=true", "checkpoint.full_when_fraction_exceeds=1.5", "train.num_threads=1"]


def train_args(directory: Path):
    sets = [a for s in SMALL + [f"checkpoint.dir='{directory}'", f"train.output_dir='{directory / 'out'}'"]
            for a in ("--set", s)]
    return ["train", "--config", TINY, "--no-progress", *sets]


def command(directory: Path, *extra):
    return [sys.executable, "-m", "neorec", *train_args(directory), "--nproc", "2", *extra]


ENV = dict(os.environ, PYTHONPATH=str(ROOT))


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
    restore_only = [s for s in SMALL if not s.startswith("checkpoint.")]  # (saving nothing: no checkpoint keys)
    cfg = load_config(TINY, restore_only + [f"train.output_dir='{directory / 'check'}'", "train.progress=false"])
    trainer = Trainer(cfg, out=io.StringIO(), resume=str(directory))
    trainer.fit()  # at max_steps already: restores only
    tbe = trainer.model.sparse_arch.tbe
    state = {t.name: tbe.get_table_weight(t.name) for t in tbe.tables}
    state.update({f"{t.name}.m": tbe.get_optimizer_state(t.name)["momentum1"] for t in tbe.tables})
    state.update({k: v for k, v in trainer.model.state_dict().items() if not k.startswith("sparse_arch")})
    return trainer.step, state


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(step, state) of the uninterrupted 2-rank run."""
    directory = tmp_path_factory.mktemp("ref")
    run = subprocess.run(command(directory), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return final_state(directory)


def kill_rank1_after_step6(job: subprocess.Popen, directory: Path, workers_of: int) -> None:
    """Wait for the checkpoint of step 6, then SIGKILL rank 1 (the younger child of ``workers_of``)."""
    deadline = time.monotonic() + 200
    while not (directory / "step-000000006" / "manifest.json").exists():
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()
        time.sleep(0.02)
    ranks = children(workers_of)
    assert len(ranks) == 2
    os.kill(max(ranks), signal.SIGKILL)


def assert_same_final_state(reference, directory: Path):
    step, expected = reference
    resumed_step, actual = final_state(directory)
    assert step == resumed_step == 18
    for key in expected:
        assert torch.equal(expected[key], actual[key]), key


def test_sigkill_a_rank_then_resume_equals_uninterrupted(tmp_path, reference):
    job = subprocess.Popen(command(tmp_path / "job"), cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    kill_rank1_after_step6(job, tmp_path / "job", job.pid)
    _, stderr = job.communicate(timeout=120)
    assert job.returncode != 0, "the job finished before the kill; the test needs a slower run"
    assert not (tmp_path / "job" / "step-000000018").exists()

    resumed = subprocess.run(command(tmp_path / "job", "--resume", str(tmp_path / "job")), cwd=ROOT, env=ENV,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "checkpoint: resumed from" in resumed.stdout

    assert_same_final_state(reference, tmp_path / "job")


@pytest.mark.parametrize("rendezvous", ["standalone", "default"])
def test_torchrun_restart_resumes_by_itself(tmp_path, reference, rendezvous):
    # torchrun restarts both workers after the kill; they join a fresh attempt (their own key prefix in
    # the agent's store) and continue from the newest complete checkpoint (checkpoint.auto_resume),
    # which their job saved: --standalone draws a rendezvous id; by default it is "none" for every job
    # and the job is the agent process
    import socket

    if rendezvous == "standalone":
        how = ["--standalone"]
    else:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            how = ["--master-addr", "127.0.0.1", "--master-port", str(probe.getsockname()[1])]
    torchrun = [sys.executable, "-m", "torch.distributed.run", *how, "--nproc-per-node", "2",
                "--max-restarts", "2", "-m", "neorec"]
    job = subprocess.Popen(torchrun + train_args(tmp_path / "job"), cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    kill_rank1_after_step6(job, tmp_path / "job", job.pid)  # the agent runs in torchrun's process
    stdout, stderr = job.communicate(timeout=300)
    assert job.returncode == 0, stderr[-3000:]
    assert "checkpoint: resumed from" in stdout, stdout[-3000:]
    assert_same_final_state(reference, tmp_path / "job")
    job_of = {p.name: json.loads((p / "manifest.json").read_text())["job"] for p in (tmp_path / "job").glob("step-*")}
    prefix = "rdzv:" if rendezvous == "standalone" else "agent:"
    assert len(set(job_of.values())) == 1 and next(iter(job_of.values())).startswith(prefix), job_of
