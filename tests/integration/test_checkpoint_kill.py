"""SIGKILL a rank of ``neorec train --nproc 2`` mid-training; ``--resume`` finishes the job with
weights identical to an uninterrupted run (fp32; full and incremental checkpoints). Under
``torchrun --max-restarts`` the restarted workers resume by themselves, with the same result.

    python -m pytest tests/integration/test_checkpoint_kill.py -q
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
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


# on the job's PYTHONPATH: rank 1 of the first attempt SIGKILLs itself once the checkpoint of step 6
# is complete (its save returns after rank 0's manifest); the test polled for the manifest and
# killed from outside, a race with the run's last 12 steps (~0.4 s on a loaded host)
KILL_AFTER_STEP6 = """
import os
if os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
    import signal
    from neorec.train import checkpoint
    save = checkpoint.Checkpointer.save
    def save_then_die(self):
        path = save(self)
        if self.trainer.step == 6:
            os.kill(os.getpid(), signal.SIGKILL)
        return path
    checkpoint.Checkpointer.save = save_then_die
"""


def env_killing_rank1_after_step6(tmp_path: Path) -> dict:
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(KILL_AFTER_STEP6)
    return dict(ENV, PYTHONPATH=os.pathsep.join([str(hook), str(ROOT)]))


def assert_same_final_state(reference, directory: Path):
    step, expected = reference
    resumed_step, actual = final_state(directory)
    assert step == resumed_step == 18
    for key in expected:
        assert torch.equal(expected[key], actual[key]), key


def test_sigkill_a_rank_then_resume_equals_uninterrupted(tmp_path, reference):
    job = subprocess.run(command(tmp_path / "job"), cwd=ROOT, env=env_killing_rank1_after_step6(tmp_path),
                         capture_output=True, text=True, timeout=300)
    assert job.returncode != 0 and "rank 1 of 2 was killed by SIGKILL" in job.stderr, job.stderr
    assert (tmp_path / "job" / "step-000000006" / "manifest.json").exists()
    assert not (tmp_path / "job" / "step-000000009").exists()

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
    job = subprocess.run(torchrun + train_args(tmp_path / "job"), cwd=ROOT, env=env_killing_rank1_after_step6(tmp_path),
                         capture_output=True, text=True, timeout=300)
    stdout, stderr = job.stdout, job.stderr
    assert job.returncode == 0, stderr[-3000:]
    assert "checkpoint: resumed from" in stdout and "step-000000006" in stdout, stdout[-3000:]
    assert_same_final_state(reference, tmp_path / "job")
    job_of = {p.name: json.loads((p / "manifest.json").read_text())["job"] for p in (tmp_path / "job").glob("step-*")}
    prefix = "rdzv:" if rendezvous == "standalone" else "agent:"
    assert len(set(job_of.values())) == 1 and next(iter(job_of.values())).startswith(prefix), job_of
