"""Checkpoints and restarts: a worker that torchrun restarts (``checkpoint.auto_resume``) goes on
from where its run saved, decided before its model is built (no initial rows drawn, the checkpoint
verified once), says what it skips, and starts fresh when nothing was saved.

    python -m pytest tests/unit/train/test_checkpoint_restart.py -q
"""

from __future__ import annotations

import pytest

from neorec.train.checkpoint_manifest import UNKNOWN_JOB, saved_by_this_job
from tests.unit.train.test_checkpoint import assert_identical, checkpoint_args, checkpoint_names, make_trainer, snapshot


def test_auto_resume_when_restarted_by_torchrun(tmp_path, monkeypatch):
    """The restarted worker draws no initial rows (it decided to resume only after building the
    model, so it drew them all) and verifies the checkpoint it restores once (it did so twice)."""
    import neorec.train.checkpoint as checkpoint
    import neorec.train.checkpoint_manifest as checkpoint_manifest
    from neorec.embedding.init_stream import TableInit

    make_trainer(tmp_path, "train.max_steps=4", *checkpoint_args(tmp_path, 2)).fit()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    draws, verified = [], []
    verify = checkpoint.verify_checkpoint
    for module in (checkpoint, checkpoint_manifest):  # (wherever a checkpoint is verified)
        monkeypatch.setattr(module, "verify_checkpoint", lambda path: verified.append(path.name) or verify(path))
    block = TableInit._block
    with monkeypatch.context() as patch:
        patch.setattr(TableInit, "_block", lambda init, k: draws.append((init.name, k)) or block(init, k))
        restarted = make_trainer(tmp_path, "train.max_steps=6", *checkpoint_args(tmp_path, 2), name="restarted")
    assert draws == []
    assert restarted.fit().samples == 2 * 128 and restarted.step == 6
    assert "resumed from" in restarted.out.getvalue() and verified == ["step-000000004"]
    saved = checkpoint_names(tmp_path / "ckpt")
    # not resuming (auto_resume off, or not a restart): a fresh run, refused beside the first run's checkpoints
    off = make_trainer(tmp_path, "train.max_steps=2", *checkpoint_args(tmp_path, 2, "checkpoint.auto_resume=false"),
                       name="off")
    with pytest.raises(ValueError, match="already holds checkpoints of another run"):
        off.fit()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    fresh = make_trainer(tmp_path, "train.max_steps=2", *checkpoint_args(tmp_path, 2), name="fresh")
    with pytest.raises(ValueError, match="already holds checkpoints of another run"):
        fresh.fit()
    assert checkpoint_names(tmp_path / "ckpt") == saved and "resumed" not in fresh.out.getvalue()
    alone = make_trainer(tmp_path, "train.max_steps=2", *checkpoint_args(tmp_path, 2, "checkpoint.dir='" +
                                                                           str(tmp_path / "other") + "'"), name="alone")
    assert alone.fit().samples == 2 * 128 and "resumed" not in alone.out.getvalue()  # fresh, in its own directory


def test_a_restarted_worker_says_the_checkpoints_it_skips_or_that_it_starts_fresh(tmp_path, monkeypatch):
    """A torn newest checkpoint is reported and the one before it restored; with none complete the
    restarted worker says so and trains as a fresh run does (drawing its initial rows)."""
    make_trainer(tmp_path, "train.max_steps=4", *checkpoint_args(tmp_path, 2)).fit()
    (tmp_path / "ckpt" / "step-000000004" / "dense.pt").write_bytes(b"torn")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    restarted = make_trainer(tmp_path, "train.max_steps=6", *checkpoint_args(tmp_path, 2), name="restarted")
    restarted.fit()
    said = restarted.out.getvalue()
    assert "step-000000004 is incomplete or corrupt" in said and "using the previous complete one" in said
    assert f"resumed from {tmp_path / 'ckpt' / 'step-000000002'}" in said and restarted.step == 6
    empty = [f"checkpoint.dir='{tmp_path / 'empty'}'", "checkpoint.every_steps=100"]
    fresh = make_trainer(tmp_path, "train.max_steps=3", *empty, name="fresh")
    fresh.fit()
    assert f"restarted by torchrun, but {tmp_path / 'empty'} holds no complete checkpoint: starting fresh" in (
        fresh.out.getvalue())
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    reference = make_trainer(tmp_path, "train.max_steps=3", name="reference")
    reference.fit()
    assert_identical(snapshot(reference), snapshot(fresh))


def test_a_run_started_with_resume_comes_back_from_its_own_checkpoints_after_a_restart(tmp_path, monkeypatch):
    """Restarted by torchrun, a run started with --resume went back to that checkpoint, then found
    its own later ones in checkpoint.dir and refused them as another run's: every restart failed."""
    make_trainer(tmp_path, "train.max_steps=2", *checkpoint_args(tmp_path, 2)).fit()
    other = [f"checkpoint.dir='{tmp_path / 'ckpt2'}'", "checkpoint.every_steps=2"]
    make_trainer(tmp_path, "train.max_steps=4", *other, resume=str(tmp_path / "ckpt"), name="second").fit()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # the same command, restarted after step 4
    restarted = make_trainer(tmp_path, "train.max_steps=6", *other, resume=str(tmp_path / "ckpt"), name="again")
    assert restarted.fit().samples == 2 * 128 and restarted.step == 6
    said = restarted.out.getvalue()
    assert f"restarted by torchrun: resuming from {tmp_path / 'ckpt2'}, where this run saved, not from --resume" in said
    reference = make_trainer(tmp_path, "train.max_steps=6", name="reference")
    reference.fit()
    assert_identical(snapshot(reference), snapshot(restarted))


def test_a_restart_goes_on_only_from_checkpoints_its_own_job_saved(tmp_path, monkeypatch):
    """A first attempt refused beside another run's checkpoints (or rewinding past its own run's
    future) exits non-zero; torchrun restarted it, and the restart resumed the newest checkpoint
    there as its own: the other run's weights, trained on, exit 0. Checkpoints now record their
    torchrun job; a restart of another job behaves as its first attempt did."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    make_trainer(tmp_path, "train.max_steps=4", *checkpoint_args(tmp_path, 2)).fit()
    saved = checkpoint_names(tmp_path / "ckpt")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
    for attempt in ("0", "1"):  # a fresh run of another job, then its restart
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
        other = make_trainer(tmp_path, "train.max_steps=6", *checkpoint_args(tmp_path, 2), name=f"b{attempt}")
        with pytest.raises(ValueError, match="already holds checkpoints of another run"):
            other.fit()
        assert "resumed" not in other.out.getvalue() and checkpoint_names(tmp_path / "ckpt") == saved
    assert "step-000000004) was not saved by this job: not resuming it" in other.out.getvalue()
    rewind = str(tmp_path / "ckpt" / "step-000000002")
    for attempt in ("0", "1"):  # job c rewinds job a's run to step 2: refused, restarted or not
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-c")
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
        again = make_trainer(tmp_path, "train.max_steps=6", *checkpoint_args(tmp_path, 2), resume=rewind,
                             name=f"c{attempt}")
        with pytest.raises(ValueError, match="already holds checkpoints after step 2, the one resumed from"):
            again.fit()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")  # job a's own restart goes on from its step 4
    restarted = make_trainer(tmp_path, "train.max_steps=6", *checkpoint_args(tmp_path, 2), name="a1")
    assert restarted.fit().samples == 2 * 128 and restarted.step == 6
    assert f"resumed from {tmp_path / 'ckpt' / 'step-000000004'}" in restarted.out.getvalue()


def test_job_identity_is_the_rendezvous_id_or_the_single_nodes_agent(monkeypatch):
    import os

    from neorec.train.checkpoint_manifest import UNKNOWN_JOB, job_identity

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert job_identity() is None  # not under torchrun
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    assert job_identity() == "rdzv:job-7"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default id: the same for every job
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    agent = job_identity()
    assert agent is not None and agent.startswith("agent:") and f":{os.getppid()}:" in agent
    assert job_identity() == agent
    monkeypatch.setenv("WORLD_SIZE", "4")  # two nodes: their agents differ, so nothing tells the job
    assert job_identity() == UNKNOWN_JOB


def test_a_job_that_cannot_name_itself_goes_on_after_shrinking_to_one_node():
    """A multi-node job with the default rendezvous id saved with no job; restarted on one node
    (an elastic scale-down), it named itself by its agent and refused its own checkpoints."""
    agent = "agent:host:7:123"
    assert saved_by_this_job({"job": UNKNOWN_JOB}, agent)  # saved on 2 nodes, restarted on 1
    assert saved_by_this_job({"job": agent}, UNKNOWN_JOB)  # saved on 1 node, restarted on 2
    assert saved_by_this_job({"job": agent}, agent)
    assert not saved_by_this_job({"job": "agent:host:8:456"}, agent)  # another job on this node
    assert not saved_by_this_job({"job": None}, agent)  # a run outside torchrun
    assert not saved_by_this_job({}, "rdzv:job-1")  # (manifests from before the job was recorded)


def test_the_launcher_checks_the_checkpoint_the_ranks_will_take(tmp_path):
    """A torn newest checkpoint: the --nproc launcher checked it anyway (its manifest parses) and
    refused a resume the ranks would have made from the one before it, with a batch-size hint
    the ranks then refused against that one. It now skips what is missing or truncated, as the
    ranks do (checksums stay theirs: the launcher hashes nothing)."""
    from neorec.train.checkpoint_manifest import check_resume_before_launch

    first = make_trainer(tmp_path, "train.max_steps=3", *checkpoint_args(tmp_path, 1))
    first.fit()  # 128 samples a step: steps 2 and 3 done, 256 and 384 samples of the epoch
    cfg, source = first.cfg, first.source
    with pytest.raises(ValueError, match="384 samples of epoch 0"):  # 384 is no whole number of 2 x 128
        check_resume_before_launch(tmp_path / "ckpt", cfg, source, 2)
    (tmp_path / "ckpt" / "step-000000003" / "dense.pt").write_bytes(b"torn")
    check_resume_before_launch(tmp_path / "ckpt", cfg, source, 2)  # the ranks take step 2: 256 samples
    with pytest.raises(ValueError, match="256 samples of epoch 0"):
        check_resume_before_launch(tmp_path / "ckpt", cfg, source, 3)
