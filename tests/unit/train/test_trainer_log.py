"""The trainer's metrics log: window QPS counts training time only, each epoch's last steps get a
train record of their own, the last step is evaluated once, a resumed run's log holds one final
record, a non-finite loss leaves an error record, replacing an earlier run's log is said, values
that are not finite are null and named in `non_finite`.

    python -m pytest tests/unit/train/test_trainer_log.py -q
"""

from __future__ import annotations

import io
import json

import pytest

import neorec.train.trainer as trainer_module
from neorec.config import load_config
from neorec.train.checkpoint import Checkpointer
from neorec.train.trainer import NonFiniteLossError, Trainer

# 1000 samples / 128 = 8 steps per epoch
SMALL = ["data.synthetic.num_train_samples=1000", "data.synthetic.num_eval_samples=200", "data.batch_size=128",
         "data.eval_batch_size=200", "train.epochs=2", "train.progress=false", "train.eval_every_steps=0",
         "model.embedding_dim=4", "model.dense_layers=[8, 4]", "data.synthetic.num_embeddings=[60, 200, 400, 30]",
         "train.log_every_steps=3"]


def make_trainer(tmp_path, *overrides, resume=None, out=None):
    cfg = load_config("configs/tiny.toml", SMALL + [f"train.output_dir='{tmp_path / 'run'}'", *overrides])
    return Trainer(cfg, out=out or io.StringIO(), resume=resume)


def read_log(tmp_path):
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


class FakeClock:
    """A clock that moves only when told."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


def fake_time(monkeypatch):
    """The trainer's clock: a step takes 1 s, an evaluation 100 s."""
    clock = FakeClock()
    monkeypatch.setattr(trainer_module, "time", clock)
    step, evaluate = Trainer.train_step, Trainer.evaluate

    def timed_step(self, *args, **kwargs):
        clock.now += 1.0
        return step(self, *args, **kwargs)

    def timed_eval(self, *args, **kwargs):
        clock.now += 100.0
        return evaluate(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "train_step", timed_step)
    monkeypatch.setattr(Trainer, "evaluate", timed_eval)


def test_the_step_timeline_leaves_the_epoch_end_evaluation_out(tmp_path, monkeypatch):
    fake_time(monkeypatch)
    trainer = make_trainer(tmp_path, "train.profile=true")  # evaluates at the end of epoch 0
    trainer.fit()
    assert [r["step"] for r in read_log(tmp_path) if r["kind"] == "eval"] == [8]
    assert trainer.timeline.steps == 16 and trainer.timeline.step_seconds == 16.0


def test_window_qps_counts_training_time_only_and_epochs_end_with_a_record(tmp_path, monkeypatch):
    fake_time(monkeypatch)
    trainer = make_trainer(tmp_path, "train.eval_every_steps=4", "train.profile=true")
    trainer.fit()
    assert trainer.timeline.steps == 16 and trainer.timeline.step_seconds == 16.0  # no evaluation in a step
    records = read_log(tmp_path)
    train = [r for r in records if r["kind"] == "train"]
    assert [(r["step"], r["epoch"]) for r in train] == [(3, 0), (6, 0), (8, 0), (9, 1), (12, 1), (15, 1), (16, 1)]
    # full batches: 128 samples a second; the last batch of an epoch has 1000 - 7 * 128 = 104
    assert [round(r["qps"], 6) for r in train] == [128.0, 128.0, 116.0, 128.0, 128.0, 128.0, 104.0]
    assert [r["steps"] for r in train] == [3, 3, 2, 1, 3, 3, 1]  # the short windows say so
    evals = [r["step"] for r in records if r["kind"] == "eval"]
    assert evals == [4, 8, 12]  # step 16 is the last: its evaluation is the final one
    # in step order: the epoch's last train record before the evaluation at that step (step 8 is no
    # multiple of log_every_steps: the eval record came first, then the train record of step 8)
    assert [(r["kind"], r["step"]) for r in records][:5] == [("train", 3), ("eval", 4), ("train", 6), ("train", 8),
                                                               ("eval", 8)]
    final = records[-1]
    assert final["kind"] == "final" and final["step"] == 16 and final["train_seconds"] == 16.0


def test_a_resumed_run_has_one_final_record_and_keeps_the_earlier_end_as_an_eval(tmp_path):
    ckpt = [f"checkpoint.dir='{tmp_path / 'ckpt'}'", "checkpoint.every_steps=4"]
    make_trainer(tmp_path, "train.epochs=1", *ckpt).fit()
    result = make_trainer(tmp_path, *ckpt, resume=str(tmp_path / "ckpt")).fit()
    assert (result.first_step, result.steps, result.samples) == (8, 16, 1000)  # samples: this run's
    records = read_log(tmp_path)
    assert records[-1]["first_step"] == 8 and records[-1]["samples"] == 1000
    assert [(r["kind"], r["step"]) for r in records if r["kind"] != "train"] == [("eval", 8), ("final", 16)]
    after = [r for r in records if r["kind"] == "train" and r["step"] > 8]
    assert after[0]["steps"] == after[0]["step"] - 8  # the first window after resuming counts its own steps only
    earlier = records[[r["kind"] for r in records].index("eval")]
    assert earlier["epoch"] == 0 and 0 < earlier["auc"] < 1 and "qps" not in earlier and "first_step" not in earlier


class Killed(BaseException):
    """Stands for a SIGKILL right after a checkpoint is complete."""


@pytest.mark.parametrize("when", ["eval_every_steps", "epoch_end"])
def test_a_run_killed_right_after_a_checkpoint_loses_no_record(tmp_path, monkeypatch, when):
    """A step's checkpoint was saved before its train record and its eval: a run killed between the
    two resumed after the step and never wrote them (the epoch's eval was lost even without a kill:
    resuming from an epoch's last step goes on with the next epoch). The records come first now, and
    a killed and resumed run logs what an uninterrupted one does."""
    settings = (["train.eval_every_steps=2", "checkpoint.every_steps=2"] if when == "eval_every_steps" else
                ["train.eval_every_steps=0", "checkpoint.every_steps=8"])  # 8 steps an epoch
    kill_at = 4 if when == "eval_every_steps" else 8

    def run(folder, resume=None):
        return make_trainer(folder, f"checkpoint.dir='{folder / 'ckpt'}'", *settings, resume=resume)

    run(tmp_path / "straight").fit()
    after_step = Checkpointer.after_step

    def killed_after_the_save(self, epoch, batch_in_epoch):
        after_step(self, epoch, batch_in_epoch)
        if self.trainer.step == kill_at:
            raise Killed()

    monkeypatch.setattr(Checkpointer, "after_step", killed_after_the_save)
    with pytest.raises(Killed):
        run(tmp_path / "killed").fit()
    monkeypatch.setattr(Checkpointer, "after_step", after_step)
    run(tmp_path / "killed", resume=str(tmp_path / "killed" / "ckpt")).fit()

    def records(folder):
        return [(r["kind"], r["step"], r["epoch"], r.get("steps"), r.get("loss"), r.get("auc"))
                for r in read_log(folder) if r["kind"] != "final"]

    straight = records(tmp_path / "straight")
    assert ("eval", kill_at, 0, None) == straight[[r[:2] for r in straight].index(("eval", kill_at))][:4]
    assert records(tmp_path / "killed") == straight


def test_a_non_finite_loss_names_its_step_and_leaves_an_error_record(tmp_path):
    trainer = make_trainer(tmp_path)
    calls = {"n": 0}
    loss_fn = trainer.loss_fn

    def nan_at_third(logits, labels):
        calls["n"] += 1
        loss = loss_fn(logits, labels)
        return loss * float("nan") if calls["n"] == 3 else loss

    trainer.loss_fn = nan_at_third
    with pytest.raises(NonFiniteLossError, match="training loss is nan at step 3;"):
        trainer.fit()
    last = read_log(tmp_path)[-1]
    assert last["kind"] == "error" and last["step"] == 3 and "loss is nan at step 3" in last["message"]
    assert trainer.step == 2  # the update of step 3 never ran


@pytest.mark.parametrize("checkpoints", [False, True])
def test_a_last_update_that_diverges_fails_the_run_without_a_checkpoint_of_it(tmp_path, checkpoints):
    """The loss is checked before each update, so the last step's update never was: with dense
    weights of inf / NaN the final checkpoint was saved as complete, the final eval printed NaN
    and the run ended with exit 0 (a resume from it then failed at once)."""
    saving = [f"checkpoint.dir='{tmp_path / 'ckpt'}'", "checkpoint.every_steps=1"] if checkpoints else []
    trainer = make_trainer(tmp_path, "train.max_steps=2", *saving)
    train_step = trainer.train_step

    def diverging(*args, **kwargs):  # step 2's update leaves a dense weight infinite
        loss = train_step(*args, **kwargs)
        if trainer.step == 2:
            next(trainer.model.parameters()).data[0] = float("inf")
        return loss

    trainer.train_step = diverging
    with pytest.raises(NonFiniteLossError, match=r"dense weight \S+ is not finite after step 2: the update diverged"):
        trainer.fit()
    last = read_log(tmp_path)[-1]
    assert last["kind"] == "error" and last["step"] == 2 and "is not finite after step 2" in last["message"]
    if checkpoints:  # step 1's, not step 2's
        assert [p.parent.name for p in (tmp_path / "ckpt").glob("step-*/manifest.json")] == ["step-000000001"]


@pytest.mark.parametrize("checked", [True, False])
def test_embedding_rows_the_last_update_made_nan_fail_the_run(tmp_path, checked):
    """Rows are buffers, not parameters: a check of the dense weights alone saved a checkpoint of
    NaN rows as complete. The rows of the fused modules are checked too; rows it cannot see (in a
    cached table's store: ``checked=False`` stands for them) fail the final evaluation."""
    trainer = make_trainer(tmp_path, "train.max_steps=2", f"checkpoint.dir='{tmp_path / 'ckpt'}'",
                           "checkpoint.every_steps=1")
    train_step = trainer.train_step

    def poisoning(*args, **kwargs):  # step 2's update leaves every row NaN (a diverged sparse update)
        loss = train_step(*args, **kwargs)
        if trainer.step == 2:
            trainer.model.sparse_arch.tbe.weights.fill_(float("nan"))
        return loss

    trainer.train_step = poisoning
    if not checked:
        trainer.check_weights_finite = lambda: None
    message = (r"table 't_feature_\d' row 0 \(embedding row\) is not finite after step 2: the update diverged; "
               r"stopping without saving it \(lower the learning rates\); its last complete checkpoint is of step 1: "
               r"--resume \S+ckpt$" if checked else "the final evaluation predicted NaN for 200 samples after step 2")
    with pytest.raises(NonFiniteLossError, match=message):
        trainer.fit()
    last = read_log(tmp_path)[-1]
    assert last["kind"] == "error" and last["step"] == 2 and last["epoch"] == 0, last
    if checked:  # step 1's checkpoint, not step 2's
        assert [p.parent.name for p in (tmp_path / "ckpt").glob("step-*/manifest.json")] == ["step-000000001"]


def test_a_new_run_says_that_it_replaces_an_earlier_runs_log(tmp_path):
    first, second = io.StringIO(), io.StringIO()
    make_trainer(tmp_path, "train.max_steps=2", out=first).fit()
    assert "replacing" not in first.getvalue()
    make_trainer(tmp_path, "train.max_steps=2", out=second).fit()
    assert f"train.output_dir {tmp_path / 'run'}: replacing the metrics.jsonl" in second.getvalue()
    assert [r["kind"] for r in read_log(tmp_path)] == ["train", "final"]


def test_a_new_run_removes_an_earlier_runs_timeline(tmp_path):
    """A run without --profile in a folder where an earlier run profiled left that run's
    timeline.json beside its own log, as if it were this run's."""
    make_trainer(tmp_path, "train.max_steps=2", "train.profile=true").fit()
    assert (tmp_path / "run" / "timeline.json").is_file()
    out = io.StringIO()
    make_trainer(tmp_path, "train.max_steps=2", out=out).fit()
    assert not (tmp_path / "run" / "timeline.json").exists()
    assert f"train.output_dir {tmp_path / 'run'}: removed the timeline.json of an earlier run" in out.getvalue()


def test_a_resumed_run_keeps_only_the_records_of_the_runs_its_checkpoint_descends_from(tmp_path):
    """Resuming into a folder where another run wrote since kept that run's records up to the
    checkpoint's step, silently mixing two runs in one log. Every record now carries its run's id,
    a checkpoint lists the runs it descends from, and a resumed run keeps only their records: not
    another run's, not a branch resumed from an earlier checkpoint of the same run."""
    def kinds(records):
        return [(r["kind"], r["step"]) for r in records]

    checkpoint = [f"checkpoint.dir='{tmp_path / 'ckpt'}'", "checkpoint.every_steps=4", "train.log_every_steps=2"]
    make_trainer(tmp_path, *checkpoint, "train.max_steps=4").fit()
    first = read_log(tmp_path)
    run = first[0]["run"]
    assert len(run) == 16 and {r["run"] for r in first} == {run}
    make_trainer(tmp_path, "train.max_steps=6", "train.seed=7", "train.log_every_steps=1").fit()  # another run
    assert run not in {r["run"] for r in read_log(tmp_path)}
    out = io.StringIO()
    make_trainer(tmp_path, *checkpoint, "train.max_steps=8", resume=str(tmp_path / "ckpt"), out=out).fit()
    assert f"train.output_dir {tmp_path / 'run'}: replacing the metrics.jsonl and config.json of another run " \
           "(not the resumed checkpoint's)" in out.getvalue()
    # (the other run replaced the first one's records: the log goes on from the checkpoint's step)
    records = read_log(tmp_path)
    assert kinds(records) == [("train", 6), ("train", 8), ("final", 8)]
    second = records[0]["run"]
    assert second != run and {r["run"] for r in records} == {second}

    out = io.StringIO()  # resumed into the folder its runs wrote: nothing replaced
    make_trainer(tmp_path, *checkpoint, "train.max_steps=12", resume=str(tmp_path / "ckpt"), out=out).fit()
    assert "replacing" not in out.getvalue()
    records = read_log(tmp_path)
    third = records[-1]["run"]
    assert kinds(records) == [("train", 6), ("train", 8), ("eval", 8), ("train", 10), ("train", 12), ("final", 12)]
    assert [r["run"] for r in records] == [second] * 3 + [third] * 3

    # a branch: resumed from step 8 with another learning rate; then the run resumed from step 12
    branch = [f"checkpoint.dir='{tmp_path / 'branch'}'", "checkpoint.every_steps=4", "train.log_every_steps=2"]
    make_trainer(tmp_path, *branch, "train.max_steps=12", "dense_optimizer.learning_rate=0.5",
                 resume=str(tmp_path / "ckpt" / "step-000000008")).fit()
    assert kinds(read_log(tmp_path))[-3:] == [("train", 10), ("train", 12), ("final", 12)]
    out = io.StringIO()
    make_trainer(tmp_path, *checkpoint, "train.max_steps=14", resume=str(tmp_path / "ckpt"), out=out).fit()
    records = read_log(tmp_path)
    # the branch's steps 10 and 12 are not this run's; its ancestors' records stay (it said "replacing")
    assert f"train.output_dir {tmp_path / 'run'}: metrics.jsonl keeps the 3 records of the resumed checkpoint's " \
           "runs up to step 12 and drops those of another run" in out.getvalue()
    assert kinds(records) == [("train", 6), ("train", 8), ("eval", 8), ("train", 14), ("final", 14)]
    assert {r["run"] for r in records[:3]} == {second}


def test_a_checkpoint_from_before_run_ids_keeps_the_records_without_one(tmp_path):
    """A checkpoint saved before runs had ids (no "runs" in its manifest) resumes with the log's
    records that have no id, and a later resume keeps them too."""
    from neorec.train import checkpoint as checkpoint_module

    checkpoint = [f"checkpoint.dir='{tmp_path / 'ckpt'}'", "checkpoint.every_steps=4", "train.log_every_steps=2"]
    make_trainer(tmp_path, *checkpoint, "train.max_steps=4").fit()
    log = tmp_path / "run" / "metrics.jsonl"  # as written then: no run ids, manifests without "runs"
    log.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "run"}) + "\n" for r in read_log(tmp_path)))
    manifest = tmp_path / "ckpt" / "step-000000004" / checkpoint_module.MANIFEST
    data = json.loads(manifest.read_text())
    data.pop("runs")
    data["manifest_sha256"] = checkpoint_module._manifest_digest(data)
    manifest.write_text(json.dumps(data))
    for steps in (8, 12):
        out = io.StringIO()
        make_trainer(tmp_path, *checkpoint, f"train.max_steps={steps}", resume=str(tmp_path / "ckpt"), out=out).fit()
        assert "replacing" not in out.getvalue()
    records = read_log(tmp_path)
    assert [(r["kind"], r["step"]) for r in records][:3] == [("train", 2), ("train", 4), ("eval", 4)]
    assert [r.get("run") for r in records[:3]] == [None] * 3 and records[-1]["kind"] == "final"


def test_the_summary_of_a_resumed_run_says_which_steps_it_trained(capsys):
    from neorec.train.cli import _print_result
    from neorec.train.trainer import TrainResult

    _print_result(TrainResult(steps=70, samples=5120, train_seconds=2.0, qps=2560.0, first_step=50))
    assert "training: 70 steps (20 after resuming at step 50), 5,120 samples in 2.0 s" in capsys.readouterr().out


@pytest.mark.parametrize("setting", ["train.output_dir", "checkpoint.dir"])
def test_a_second_run_on_the_same_output_or_checkpoint_folder_is_refused(tmp_path, setting):
    """Two runs on one folder interleaved metrics.jsonl (torn lines, two final records) or
    overwrote and pruned each other's checkpoints while both reported them saved."""
    import os

    from neorec.files import DIR_LOCK, lock_file

    folder = tmp_path / "run" if setting == "train.output_dir" else tmp_path / "ckpt"
    trainer = make_trainer(tmp_path, "train.max_steps=2", f"checkpoint.dir='{tmp_path / 'ckpt'}'")
    other_run = lock_file(folder / DIR_LOCK)  # what the first run holds while it trains
    try:
        with pytest.raises(ValueError, match=f"{setting} '{folder}' is in use by another run \\(process {os.getpid()}\\)"):
            trainer.fit()
    finally:
        os.close(other_run)
    assert trainer.fit().steps == 2  # free again: this run goes on
    again = make_trainer(tmp_path, "train.max_steps=3", f"checkpoint.dir='{tmp_path / 'ckpt'}'",
                         resume=str(tmp_path / "ckpt"))
    assert again.fit().steps == 3  # a run's own locks are released when it ends


def test_progress_to_a_file_is_plain_lines_not_a_redrawn_bar(tmp_path, monkeypatch):
    """Into a file or pipe the bar was one ever-growing line of "\\r" redraws (one per log record)."""
    monkeypatch.setattr(trainer_module, "PROGRESS_LINE_SECONDS", 0.0)
    out = io.StringIO()  # not a terminal
    make_trainer(tmp_path, "train.progress=true", "train.max_steps=6", out=out).fit()
    text = out.getvalue()
    assert "\r" not in text
    assert "step 3/6: loss " in text and "step 6/6: loss " in text and "samples/s" in text


def test_a_notebook_cell_gets_the_bar_not_plain_lines(tmp_path, monkeypatch):
    """A Jupyter notebook's stdout is not a tty, so it got a plain line every 30 s instead of the bar."""
    monkeypatch.setattr(trainer_module, "PROGRESS_LINE_SECONDS", 0.0)
    OutStream = type("OutStream", (io.StringIO,), {"__module__": "ipykernel.iostream"})  # ipykernel's class
    out = OutStream()
    make_trainer(tmp_path, "train.progress=true", "train.max_steps=6", out=out).fit()
    text = out.getvalue()
    assert "\r" in text and "6/6" in text  # tqdm's redrawn bar
    assert "step 3/6: loss " not in text  # and not the plain lines as well
    assert trainer_module.redraws_lines(io.StringIO()) is False


def test_building_a_large_model_says_so(tmp_path, monkeypatch):
    """Drawing the initial rows of a large model (and filling its row stores) takes minutes with
    nothing on the screen: a model of ``BUILD_NOTICE_BYTES`` or more says it is building, as a line
    before and after into a file, as a bar of the bytes drawn on a terminal; a smaller one (or
    train.progress=false) says nothing."""
    rows = 4 * 4 * (60 + 200 + 400 + 30)  # fp32, embedding_dim 4
    monkeypatch.setattr(trainer_module, "BUILD_NOTICE_BYTES", rows)
    out = io.StringIO()
    make_trainer(tmp_path, "train.progress=true", out=out)
    lines = out.getvalue().splitlines()
    assert lines[0] == "building the model: 4 tables, 10.78 KiB of embedding rows (in fp32)", lines
    assert lines[1].startswith("model built in ") and lines[1].endswith(" s") and len(lines) == 2, lines
    OutStream = type("OutStream", (io.StringIO,), {"__module__": "ipykernel.iostream"})  # redraws lines
    out = OutStream()
    make_trainer(tmp_path, "train.progress=true", out=out)
    assert "initial rows: " in out.getvalue() and "11.0kB" in out.getvalue(), out.getvalue()
    for settings, notice in [(["train.progress=false"], rows), (["train.progress=true"], rows + 1)]:
        monkeypatch.setattr(trainer_module, "BUILD_NOTICE_BYTES", notice)
        out = io.StringIO()
        make_trainer(tmp_path, *settings, out=out)
        assert out.getvalue() == ""
    # a resumed run draws no initial rows (the checkpoint sets them): nothing to say
    checkpoint = [f"checkpoint.dir='{tmp_path / 'ckpt'}'", "checkpoint.every_steps=2", "train.max_steps=2"]
    make_trainer(tmp_path, *checkpoint).fit()
    monkeypatch.setattr(trainer_module, "BUILD_NOTICE_BYTES", rows)
    out = io.StringIO()
    make_trainer(tmp_path, "train.progress=true", *checkpoint, resume=str(tmp_path / "ckpt"), out=out)
    assert "building the model" not in out.getvalue()


def test_values_that_are_not_finite_are_null_and_named_with_what_they_were(tmp_path):
    """NE and log loss of a confident wrong prediction are inf; NaN means undefined. Both were
    written as null, so the log could not tell "infinitely bad" from "not computable"."""
    from neorec.train.metrics_log import MetricsLog

    log = MetricsLog(tmp_path / "run" / "metrics.jsonl", run="r")
    log.write({"kind": "eval", "step": 1, "auc": 0.5, "ne": float("inf"), "log_loss": float("inf"),
               "calibration": float("nan"), "ctr": 0.25})
    log.write({"kind": "eval", "step": 2, "auc": 0.6, "ne": 0.9})
    log.close()
    first, second = read_log(tmp_path)  # (json.loads would take NaN / Infinity: look at the text too)
    assert "Infinity" not in (tmp_path / "run" / "metrics.jsonl").read_text()
    assert first["ne"] is None and first["log_loss"] is None and first["calibration"] is None
    assert first["non_finite"] == {"ne": "inf", "log_loss": "inf", "calibration": "nan"}
    assert first["auc"] == 0.5 and first["ctr"] == 0.25
    assert "non_finite" not in second and second["ne"] == 0.9


def test_a_final_record_kept_as_an_eval_record_drops_the_ended_runs_counters(tmp_path):
    """A resumed run keeps the earlier run's final record as the eval record it is; it kept the
    cache counters of that run's whole life, which no eval record carries."""
    from neorec.train.metrics_log import MetricsLog

    path = tmp_path / "run" / "metrics.jsonl"
    log = MetricsLog(path, run="a")
    log.write({"kind": "train", "step": 30, "loss": 0.5})
    log.write({"kind": "final", "step": 30, "first_step": 0, "samples": 960, "train_seconds": 1.0, "qps": 960.0,
               "auc": 0.7, "ne": 0.9, "cache": {"t_0": {"lookups": 10, "hits": 5, "hit_rate": 0.5}}})
    log.close()
    MetricsLog(path, continue_after_step=30, epoch=0, run="b", keep_runs=("a",)).close()
    train, kept = read_log(tmp_path)
    assert kept == {"kind": "eval", "step": 30, "epoch": 0, "auc": 0.7, "ne": 0.9, "run": "a"}
