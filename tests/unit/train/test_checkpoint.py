"""Checkpoints on one process: save / resume equals uninterrupted training (bit for bit, fp32),
incremental = full, corrupt checkpoints detected and the previous complete one used, modified-row
tracking of the fused module (quantized rows: test_checkpoint_quantized.py).

    python -m pytest tests/unit/train/test_checkpoint.py -q
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
import torch

from neorec.config import load_config
from neorec.train.checkpoint import find_latest_complete, verify_checkpoint
from neorec.train.checkpoint_files import load_tensors
from neorec.train.trainer import Trainer

SMALL = ["data.synthetic.num_train_samples=1000", "data.synthetic.num_eval_samples=200", "data.batch_size=128",
         "data.eval_batch_size=200", "train.epochs=2", "train.progress=false", "train.eval_every_steps=0",
         "model.embedding_dim=4", "model.dense_layers=[8, 4]", "data.synthetic.num_embeddings=[60, 200, 400, 30]"]


def make_trainer(tmp_path, *overrides, resume=None, name="run"):
    cfg = load_config("configs/tiny.toml", SMALL + [f"train.output_dir='{tmp_path / name}'", *overrides])
    return Trainer(cfg, out=io.StringIO(), resume=resume)


def snapshot(trainer):
    tbe = trainer.model.sparse_arch.tbe
    out = {}
    for table in tbe.tables:
        out[f"{table.name}.w"] = tbe.get_table_weight(table.name)
        for key, value in tbe.get_optimizer_state(table.name).items():
            out[f"{table.name}.{key}"] = value
    for key, value in trainer.model.state_dict().items():
        if not key.startswith("sparse_arch"):
            out[key] = value.clone()
    for index, state in trainer.dense_optimizer.state_dict()["state"].items():
        for key, value in state.items():
            out[f"opt{index}.{key}"] = torch.as_tensor(value).clone()
    out["step"] = torch.tensor(trainer.step)
    return out


def assert_identical(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def checkpoint_names(root):
    """What a checkpoint folder holds, but the lock a run keeps there while it trains."""
    from neorec.files import DIR_LOCK

    return sorted(p.name for p in root.iterdir() if p.name != DIR_LOCK)


def checkpoint_args(tmp_path, every, *extra):
    return [f"checkpoint.dir='{tmp_path / 'ckpt'}'", f"checkpoint.every_steps={every}", *extra]


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adam"])
def test_resume_equals_uninterrupted_training(tmp_path, optimizer):
    # 8 batches per epoch (the last one 104 samples); stop at step 5, resume to step 12 (epoch 2)
    kind = f"embedding.optimizer.kind='{optimizer}'"
    reference = make_trainer(tmp_path, kind, "train.max_steps=12", name="ref")
    reference.fit()
    first = make_trainer(tmp_path, kind, "train.max_steps=5", *checkpoint_args(tmp_path, 5))
    first.fit()
    resumed = make_trainer(tmp_path, kind, "train.max_steps=12", resume=str(tmp_path / "ckpt"), name="resumed")
    result = resumed.fit()
    assert result.steps == 12 and result.samples == 2 * 128 + 104 + 4 * 128  # 3 more of epoch 0 (the last 104), 4 of epoch 1
    assert_identical(snapshot(reference), snapshot(resumed))


def test_resume_at_epoch_end_and_after_the_end(tmp_path):
    reference = make_trainer(tmp_path, "train.max_steps=0", name="ref")  # 2 epochs = 16 steps
    reference.fit()
    make_trainer(tmp_path, "train.max_steps=8", *checkpoint_args(tmp_path, 4)).fit()
    resumed = make_trainer(tmp_path, *checkpoint_args(tmp_path, 4), resume=str(tmp_path / "ckpt"), name="resumed")
    assert resumed.fit().samples == 1000
    assert_identical(snapshot(reference), snapshot(resumed))
    again = make_trainer(tmp_path, resume=str(tmp_path / "ckpt"), name="again")  # nothing left to train
    assert again.fit().samples == 0 and again.step == 16
    # resumed without checkpoint.dir: it saved nothing, and did not say so
    assert f"checkpoint: this run saves no checkpoints (checkpoint.dir is empty); to save as it goes: --set " \
           f"checkpoint.dir='\"{tmp_path / 'ckpt'}\"' --set checkpoint.every_steps=N" in again.out.getvalue()
    assert "saves no checkpoints" not in resumed.out.getvalue()


def test_the_hint_to_save_never_names_a_folder_that_holds_later_checkpoints(tmp_path):
    """Resumed from step 4 of a folder that also holds step 8, the hint named that folder, and a
    run following it was refused (it holds checkpoints after the step resumed from)."""
    make_trainer(tmp_path, "train.max_steps=8", *checkpoint_args(tmp_path, 4)).fit()
    rewound = make_trainer(tmp_path, "train.max_steps=5", resume=str(tmp_path / "ckpt" / "step-000000004"),
                           name="rewound")
    rewound.fit()
    folder = f"{tmp_path / 'ckpt'}-from-step-4"
    assert (f"to save as it goes: --set checkpoint.dir='\"{folder}\"' --set checkpoint.every_steps=N"
            in rewound.out.getvalue()), rewound.out.getvalue()
    following = make_trainer(tmp_path, "train.max_steps=6", f"checkpoint.dir='{folder}'", "checkpoint.every_steps=1",
                             resume=str(tmp_path / "ckpt" / "step-000000004"), name="following")
    following.fit()
    assert checkpoint_names(Path(folder))[-1] == "step-000000006"


def test_a_checkpoint_copied_under_a_name_is_never_made_a_checkpoint_dir(tmp_path):
    """Resumed from a full checkpoint copied to "best", the run's hint named "best" itself as a
    checkpoint.dir; following it put step-N folders inside the checkpoint, and the next
    --resume best was refused with advice to run the very command refused."""
    import shutil

    make_trainer(tmp_path, "train.max_steps=4", *checkpoint_args(tmp_path, 4)).fit()
    best = tmp_path / "best"
    shutil.copytree(tmp_path / "ckpt" / "step-000000004", best)
    again = make_trainer(tmp_path, "train.max_steps=6", resume=str(best), name="again")
    again.fit()
    said = again.out.getvalue()
    assert "resumed from" in said and again.step == 6
    assert "to save as it goes: --set checkpoint.dir='\"DIR\"' --set checkpoint.every_steps=N" in said, said
    inside = make_trainer(tmp_path, "train.max_steps=6", f"checkpoint.dir='{best}'", "checkpoint.every_steps=2",
                          resume=str(best), name="inside")
    with pytest.raises(ValueError, match=f"checkpoint.dir {best} is a checkpoint itself"):
        inside.fit()
    assert sorted(p.name for p in best.iterdir() if p.is_dir()) == []


def test_resumed_run_continues_the_metrics_log(tmp_path):
    # checkpoints at steps 4 and 8; the "crashed" run logs up to step 10, so steps 9-10 are trained again
    log_args = ["train.log_every_steps=2", "checkpoint.save_final=false", *checkpoint_args(tmp_path, 4)]
    make_trainer(tmp_path, "train.max_steps=10", *log_args).fit()
    path = tmp_path / "run" / "metrics.jsonl"
    with path.open("a") as f:
        f.write('{"kind": "train", "st')  # a line torn by the crash
    make_trainer(tmp_path, "train.max_steps=14", *log_args, resume=str(tmp_path / "ckpt")).fit()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    train_steps = [r["step"] for r in records if r["kind"] == "train"]
    assert train_steps == [2, 4, 6, 8, 10, 12, 14]  # 2-8 from the first run, 10-14 from the resumed one
    assert [r["step"] for r in records if r["kind"] == "final"] == [14]
    fresh = make_trainer(tmp_path, "train.max_steps=2", *log_args[:2], name="run")  # no resume: a new log
    fresh.fit()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [2, 2]  # train, final


def test_incremental_equals_full(tmp_path):
    extra = ["checkpoint.incremental=true", "checkpoint.full_when_fraction_exceeds=100.0", "checkpoint.keep_last=10"]
    trainer = make_trainer(tmp_path, "train.max_steps=9", *checkpoint_args(tmp_path, 3, *extra))
    trainer.fit()
    kinds = [record["kind"] for record in trainer.checkpointer.bytes_written]
    assert kinds == ["full", "incremental", "incremental"]
    sizes = [record["embedding_bytes"] for record in trainer.checkpointer.bytes_written]
    assert sizes[1] < sizes[0] and sizes[2] < sizes[0]
    manifest = verify_checkpoint(tmp_path / "ckpt" / "step-000000009")
    assert manifest["chain"] == ["step-000000003", "step-000000006", "step-000000009"]
    restored = make_trainer(tmp_path, "train.max_steps=9", resume=str(tmp_path / "ckpt"), name="restored")
    restored.fit()  # nothing left to train: the state is the checkpoint's
    assert_identical(snapshot(trainer), snapshot(restored))
    # and training on from an incremental chain equals training on without interruption
    reference = make_trainer(tmp_path, "train.max_steps=12", name="ref")
    reference.fit()
    resumed = make_trainer(tmp_path, "train.max_steps=12", resume=str(tmp_path / "ckpt"), name="resumed")
    resumed.fit()
    assert_identical(snapshot(reference), snapshot(resumed))


def test_full_checkpoint_when_increments_grow(tmp_path):
    extra = ["checkpoint.incremental=true", "checkpoint.full_when_fraction_exceeds=0.9", "checkpoint.keep_last=10"]
    trainer = make_trainer(tmp_path, "train.max_steps=8", *checkpoint_args(tmp_path, 1, *extra))
    trainer.fit()
    records = trainer.checkpointer.bytes_written
    kinds = [r["kind"] for r in records]
    assert kinds[0] == "full" and "incremental" in kinds and kinds.count("full") >= 2
    full_bytes = records[0]["embedding_bytes"]
    since_full = 0
    for record in records[1:]:  # the increments since a full one stay under 0.9 of a full one (+ file overhead)
        since_full = 0 if record["kind"] == "full" else since_full + record["embedding_bytes"]
        assert since_full <= 0.9 * full_bytes + 4096


@pytest.mark.parametrize("row_bits", [32, 8, 2])
def test_the_full_or_incremental_choice_counts_every_tensor_an_increment_writes(tmp_path, monkeypatch, row_bits):
    """The estimate left out the 8-byte id an increment writes for each row: with small rows an
    increment was 22% (fp32) to 57% (2-bit rows) larger than estimated, so increments went on past
    full_when_fraction_exceeds. Now the estimates are the bytes of the tensors written."""
    import neorec.train.checkpoint as checkpoint
    from neorec.train.checkpoint_files import load_tensors

    estimates = []
    real = checkpoint.Checkpointer._payload_bytes
    monkeypatch.setattr(checkpoint.Checkpointer, "_payload_bytes",
                        lambda self: estimates.append(real(self)) or estimates[-1])
    extra = ["checkpoint.incremental=true", "checkpoint.full_when_fraction_exceeds=100.0", "checkpoint.keep_last=10",
             f"checkpoint.row_bits={row_bits}"]
    make_trainer(tmp_path, "train.max_steps=4", *checkpoint_args(tmp_path, 1, *extra)).fit()

    def payload(step):
        files = (tmp_path / "ckpt" / f"step-{step:09d}").glob("rank*.pt")
        return sum(t.nbytes for f in files for t in load_tensors(f).values())

    assert len(estimates) == 3  # (the first checkpoint is full without asking)
    for step, (full, incremental) in enumerate(estimates, start=2):
        assert incremental == payload(step) and full == payload(1), (step, incremental, payload(step))
        assert incremental < full


def test_saving_a_step_again_removes_what_an_earlier_try_left_in_its_folder(tmp_path):
    """A save killed before its rename left `.rank0.pt.<pid>.tmp`, as large as the rank's file, in
    the step's folder; rewritten and complete, the folder kept it (and rank files of another world
    size) for as long as the checkpoint was kept: a full base of an incremental chain, for long."""
    make_trainer(tmp_path, "train.max_steps=4", *checkpoint_args(tmp_path, 2, "checkpoint.keep_last=10")).fit()
    step4 = tmp_path / "ckpt" / "step-000000004"
    kept = sorted(p.name for p in step4.iterdir())
    (step4 / "manifest.json").unlink()  # torn: the run was killed while saving step 4 ...
    leftovers = [".rank0.pt.4194304.tmp", "rank3.pt", "rank3-1.pt", "rank3.json"]  # ... and an older world's try
    for name in leftovers:
        (step4 / name).write_bytes(b"x" * 1000)
    (step4 / "notes.txt").write_text("not neorec's")
    resumed = make_trainer(tmp_path, "train.max_steps=6", *checkpoint_args(tmp_path, 2, "checkpoint.keep_last=10"),
                           resume=str(tmp_path / "ckpt"), name="resumed")
    resumed.fit()
    assert "resumed from " + str(tmp_path / "ckpt" / "step-000000002") in resumed.out.getvalue()
    assert sorted(p.name for p in step4.iterdir()) == sorted(kept + ["notes.txt"])
    assert verify_checkpoint(step4)["step"] == 4


def test_corrupt_checkpoints_are_detected_and_skipped(tmp_path):
    make_trainer(tmp_path, "train.max_steps=9", *checkpoint_args(tmp_path, 3)).fit()
    root = tmp_path / "ckpt"
    newest, middle = root / "step-000000009", root / "step-000000006"
    data = bytearray((newest / "rank0.pt").read_bytes())
    data[len(data) // 2] ^= 0x10  # one flipped bit
    (newest / "rank0.pt").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="sha256"):
        verify_checkpoint(newest)
    dense = (middle / "dense.pt").read_bytes()
    (middle / "dense.pt").write_bytes(dense[: len(dense) // 2])  # truncated
    with pytest.raises(ValueError, match="truncated"):
        verify_checkpoint(middle)
    log = io.StringIO()
    path, manifest = find_latest_complete(root, out=log)
    assert path.name == "step-000000003" and manifest["step"] == 3
    assert "step-000000009 is incomplete or corrupt" in log.getvalue()
    assert "step-000000006 is incomplete or corrupt" in log.getvalue()
    # a checkpoint named by the user is used or refused, never replaced by an older one
    with pytest.raises(ValueError, match=r"step-000000009 is incomplete or corrupt \(.*sha256.*\); the newest "
                       r"complete one before it is .*step-000000003 \(--resume .*step-000000003\)"):
        make_trainer(tmp_path, resume=str(newest), name="named").fit()
    named = make_trainer(tmp_path, "train.max_steps=4", resume=str(root / "step-000000003"), name="named3")
    named.fit()
    assert named.step == 4
    (root / "step-000000003" / "manifest.json").unlink()  # torn: never completed
    with pytest.raises(ValueError, match=r"step-000000006 is incomplete or corrupt \(.*truncated.*\)$"):
        make_trainer(tmp_path, resume=str(middle), name="named6").fit()
    assert find_latest_complete(root, out=io.StringIO()) is None
    with pytest.raises(ValueError, match="no complete checkpoint"):
        make_trainer(tmp_path, resume=str(root), name="resumed").fit()


def test_resume_from_a_corrupt_increment_falls_back(tmp_path):
    extra = ["checkpoint.incremental=true", "checkpoint.full_when_fraction_exceeds=100.0", "checkpoint.keep_last=10"]
    make_trainer(tmp_path, "train.max_steps=6", *checkpoint_args(tmp_path, 2, *extra)).fit()
    root = tmp_path / "ckpt"
    manifest = json.loads((root / "step-000000004" / "manifest.json").read_text())
    assert manifest["kind"] == "incremental"
    (root / "step-000000004" / "rank0.pt").write_bytes(b"garbage")  # breaks 4 and 6 (its chain holds 4)
    out = io.StringIO()
    trainer = make_trainer(tmp_path, "train.max_steps=2", resume=str(root), name="resumed")
    trainer.out = out
    trainer.fit()
    assert trainer.step == 2 and "using the previous complete one" in out.getvalue()


def test_a_flipped_bit_or_a_missing_key_in_a_manifest_is_corruption(tmp_path):
    """The manifest holds the data position and the pieces; its own bytes had no checksum: one
    flipped bit (batch_in_epoch 5 -> 7) resumed two batches later, silently skipping them."""
    make_trainer(tmp_path, "train.max_steps=5", *checkpoint_args(tmp_path, 5)).fit()
    path = tmp_path / "ckpt" / "step-000000005"
    good = (path / "manifest.json").read_text()
    assert '"batch_in_epoch": 5' in good
    (path / "manifest.json").write_text(good.replace('"batch_in_epoch": 5', '"batch_in_epoch": 7'))
    with pytest.raises(ValueError, match="manifest.json fails its sha256 checksum"):
        verify_checkpoint(path)
    with pytest.raises(ValueError, match=r"--resume: .*step-000000005 is incomplete or corrupt \(manifest.json fails"):
        make_trainer(tmp_path, resume=str(path), name="flipped").fit()
    manifest = json.loads(good)
    del manifest["tables"], manifest["manifest_sha256"]  # hand-edited, or written by a buggy tool
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"incomplete or corrupt \(manifest.json lacks tables \(corrupt\)\)"):
        make_trainer(tmp_path, resume=str(path), name="missing").fit()


def test_a_full_checkpoint_restores_under_any_folder_name_and_bases_must_be_its_own(tmp_path):
    """A full checkpoint copied to archive/best was refused (its chain named step-000000004, looked
    up beside it), or, next to another run's step-000000004, restored that run's embeddings."""
    make_trainer(tmp_path, "train.max_steps=4", *checkpoint_args(tmp_path, 4)).fit()
    make_trainer(tmp_path, "train.max_steps=4", "train.seed=7", f"checkpoint.dir='{tmp_path / 'other'}'",
                 "checkpoint.every_steps=4", name="other").fit()
    archive = tmp_path / "archive"
    shutil.copytree(tmp_path / "ckpt" / "step-000000004", archive / "best")
    shutil.copytree(tmp_path / "other" / "step-000000004", archive / "step-000000004")  # another run's
    best = make_trainer(tmp_path, "train.max_steps=4", resume=str(archive / "best"), name="best")
    best.fit()
    own = make_trainer(tmp_path, "train.max_steps=4", resume=str(tmp_path / "ckpt"), name="own")
    own.fit()
    assert_identical(snapshot(own), snapshot(best))
    # an increment finds its bases by name beside it: they must be the ones it was saved on
    extra = ["checkpoint.incremental=true", "checkpoint.full_when_fraction_exceeds=100.0", "checkpoint.keep_last=10"]
    root = tmp_path / "inc"
    make_trainer(tmp_path, "train.max_steps=4", f"checkpoint.dir='{root}'", "checkpoint.every_steps=2", *extra,
                 name="inc").fit()
    assert json.loads((root / "step-000000004" / "manifest.json").read_text())["kind"] == "incremental"
    verify_checkpoint(root / "step-000000004")
    shutil.rmtree(root / "step-000000002")
    shutil.copytree(tmp_path / "other" / "step-000000004", root / "step-000000002")  # a stranger in its place
    with pytest.raises(ValueError, match="its base checkpoint .*step-000000002 is not the one it was saved on"):
        verify_checkpoint(root / "step-000000004")


def test_a_renamed_checkpoint_in_its_own_folder_resumes_and_goes_on_incrementally(tmp_path):
    """After a resume from a checkpoint renamed inside checkpoint.dir, the chain went on with its old
    name: the next increment looked for its base under that name and failed."""
    extra = ["checkpoint.incremental=true", "checkpoint.full_when_fraction_exceeds=100.0", "checkpoint.keep_last=10"]
    make_trainer(tmp_path, "train.max_steps=4", *checkpoint_args(tmp_path, 4, *extra)).fit()
    root = tmp_path / "ckpt"
    (root / "step-000000004").rename(root / "best")
    resumed = make_trainer(tmp_path, "train.max_steps=6", *checkpoint_args(tmp_path, 2, *extra),
                           resume=str(root / "best"), name="resumed")
    resumed.fit()
    manifest = verify_checkpoint(root / "step-000000006")
    assert manifest["kind"] == "incremental" and manifest["chain"] == ["best", "step-000000006"]
    again = make_trainer(tmp_path, "train.max_steps=6", resume=str(root), name="again")
    again.fit()
    assert_identical(snapshot(resumed), snapshot(again))


def test_tensor_files_are_not_unpickled(tmp_path):
    import pickle

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    path = tmp_path / "evil.pt"
    path.write_bytes(pickle.dumps(Evil(), protocol=2))
    with pytest.raises(ValueError, match="cannot be read"):
        load_tensors(path)  # torch.load(weights_only=True) refuses the global instead of calling it


def test_modified_row_tracking():
    from neorec.embedding.config import SparseOptimizerConfig, TableConfig
    from neorec.embedding.tbe import TableBatchedEmbeddingBags
    from neorec.sparse.jagged import KeyedJaggedTensor

    tables = [TableConfig("a", 10, 4, ["fa"]), TableConfig("b", 7, 8, ["fb"]), TableConfig("c", 5, 4, ["fc"])]
    tbe = TableBatchedEmbeddingBags(tables, SparseOptimizerConfig(kind="sgd", learning_rate=0.1))
    kjt = KeyedJaggedTensor(["fa", "fb", "fc"], torch.tensor([3, 3, 9, 0, 6, 4]), torch.tensor([2, 1, 1, 1, 1, 0]))
    with pytest.raises(ValueError, match="track_modified_rows"):
        tbe.take_modified_rows("a")
    tbe.track_modified_rows()
    tbe(kjt).values.sum().backward()
    assert tbe.take_modified_rows("a").tolist() == [3, 9]
    assert tbe.take_modified_rows("b").tolist() == [0, 6]
    assert tbe.take_modified_rows("c").tolist() == [4]
    assert tbe.take_modified_rows("a").tolist() == []  # taken: cleared
    before = tbe.get_table_weight("a")
    tbe(kjt).values.sum().backward()
    changed = (tbe.get_table_weight("a") != before).any(1).nonzero().squeeze(1)
    assert tbe.take_modified_rows("a").tolist() == changed.tolist() == [3, 9]


def test_missing_base_of_an_increment_is_named(tmp_path):
    extra = ["checkpoint.incremental=true", "checkpoint.full_when_fraction_exceeds=100.0", "checkpoint.keep_last=10"]
    make_trainer(tmp_path, "train.max_steps=4", *checkpoint_args(tmp_path, 2, *extra)).fit()
    root = tmp_path / "ckpt"
    assert json.loads((root / "step-000000004" / "manifest.json").read_text())["kind"] == "incremental"
    (root / "step-000000002" / "manifest.json").unlink()  # the full checkpoint the increment builds on
    with pytest.raises(ValueError, match="its base checkpoint step-000000002: no manifest.json"):
        verify_checkpoint(root / "step-000000004")
    alone = tmp_path / "copied" / "x"  # the increment copied without its base: not "not completed"
    shutil.copytree(root / "step-000000004", alone)
    with pytest.raises(ValueError, match=r"its base checkpoint step-000000002 is not beside it \(.*copied/"
                                         r"step-000000002 does not exist\); an incremental checkpoint needs the "
                                         r"checkpoints it builds on \(step-000000002\) in the same folder"):
        verify_checkpoint(alone)


@pytest.mark.parametrize("setting", ["train.output_dir", "checkpoint.dir"])
def test_unwritable_output_is_refused_before_training(tmp_path, setting):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=f"{setting} '.*a_file/sub' is not a writable directory"):
        make_trainer(tmp_path, f"{setting}='{blocker / 'sub'}'")
    with pytest.raises(ValueError, match=f"{setting} '.*a_file' is a file, not a directory"):
        make_trainer(tmp_path, f"{setting}='{blocker}'")


def test_config_or_plan_given_a_directory_says_so(tmp_path):
    from neorec.config import load_config
    from neorec.files import read_json_file

    with pytest.raises(ValueError, match="is a directory; give a .toml file"):
        load_config(tmp_path)
    with pytest.raises(ValueError, match="sharding plan '.*' is a directory; give a .json file"):
        read_json_file(tmp_path, "sharding plan")


def test_a_rewound_run_never_prunes_or_mixes_with_the_future_it_left(tmp_path):
    """Resuming from an older checkpoint into the same checkpoint.dir: its newer complete
    checkpoints (the abandoned future) stop the run before training, untouched; a torn or corrupt
    newer one does not (resume skips it) and is neither counted by keep_last nor removed."""
    root = tmp_path / "ckpt"
    make_trainer(tmp_path, "train.max_steps=8", *checkpoint_args(tmp_path, 2, "checkpoint.keep_last=3")).fit()
    assert checkpoint_names(root) == ["step-000000004", "step-000000006", "step-000000008"]
    rewound = make_trainer(tmp_path, "train.max_steps=7", *checkpoint_args(tmp_path, 1, "checkpoint.keep_last=1"),
                           resume=str(root / "step-000000004"), name="rewound")
    with pytest.raises(ValueError, match=r"checkpoints after step 4, the one resumed from \(step-000000008, "
                                         r"step-000000006\): the future of the run being rewound"):
        rewound.fit()
    assert checkpoint_names(root) == ["step-000000004", "step-000000006", "step-000000008"]
    shutil.move(str(root / "step-000000008"), str(tmp_path / "kept-8"))
    data = bytearray((root / "step-000000006" / "rank0.pt").read_bytes())
    data[len(data) // 2] ^= 0x10  # corrupt: resuming from the directory skips it
    (root / "step-000000006" / "rank0.pt").write_bytes(bytes(data))
    rewound = make_trainer(tmp_path, "train.max_steps=5", *checkpoint_args(tmp_path, 1, "checkpoint.keep_last=1"),
                           resume=str(root), name="rewound2")
    rewound.fit()
    assert rewound.step == 5 and "step-000000006 is incomplete or corrupt" in rewound.out.getvalue()
    # keep_last=1 among this run's own: step 4 (resumed from) pruned, step 5 kept; the corrupt 6 left alone
    assert checkpoint_names(root) == ["step-000000005", "step-000000006"]


def test_a_closed_standard_output_is_not_a_failed_checkpoint(tmp_path):
    """`neorec train | head`: the line reporting a complete checkpoint hit a closed pipe, and the
    BrokenPipeError (an OSError) was reported as "could not write the checkpoint"."""

    class ClosedPipe(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    trainer = make_trainer(tmp_path, "train.max_steps=2", *checkpoint_args(tmp_path, 2))
    trainer.fit()
    trainer.out, trainer.step = ClosedPipe(), 3
    with pytest.raises(BrokenPipeError):
        trainer.checkpointer.save()
    assert verify_checkpoint(tmp_path / "ckpt" / "step-000000003")["step"] == 3  # it was written


def test_checkpoints_are_taken_when_min_rows_keeps_every_table_on_the_device(tmp_path):
    """default = cached_ssd with min_rows above every table's size places nothing off the device,
    yet checkpoints were refused as "of cached tables" (and an empty cached collection was built)."""
    from neorec.embedding import EmbeddingBagCollection

    settings = ["embedding.location.default='cached_ssd'", "embedding.location.min_rows=100000",
                *checkpoint_args(tmp_path, 3)]
    trainer = make_trainer(tmp_path, *settings, "train.max_steps=3")
    trainer.fit()
    assert type(trainer.model.sparse_arch) is EmbeddingBagCollection
    verify_checkpoint(tmp_path / "ckpt" / "step-000000003")


def test_a_checkpoint_that_cannot_be_written_says_which_one_and_where_to_resume(tmp_path, monkeypatch):
    """A full disk stopped the run with a bare "[Errno 28] No space left on device" and the usage
    exit code 2: no step, no path, no word of the checkpoint to go on from."""
    import errno

    import neorec.train.checkpoint as checkpoint
    from neorec.cli import main

    real = checkpoint.save_tensors

    def full_disk_at_step_4(path, tensors):
        if "step-000000004" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, tensors)

    monkeypatch.setattr(checkpoint, "save_tensors", full_disk_at_step_4)
    trainer = make_trainer(tmp_path, "train.max_steps=6", *checkpoint_args(tmp_path, 2))
    with pytest.raises(checkpoint.CheckpointWriteError) as error:
        trainer.fit()
    message = str(error.value)
    assert message.startswith(f"could not write the checkpoint of step 4 in {tmp_path / 'ckpt'} (No space left on "
                              f"device: {tmp_path / 'ckpt' / 'step-000000004' / 'rank0.pt'}); training stopped; its "
                              f"last complete checkpoint is of step 2: --resume {tmp_path / 'ckpt'} goes on from there")
    assert verify_checkpoint(tmp_path / "ckpt" / "step-000000002")["step"] == 2
    # resumed from another folder, nothing saved here yet: named its checkpoint.dir, which holds none
    from neorec.train.cli import _resume_hint

    elsewhere = make_trainer(tmp_path, "train.max_steps=6", f"checkpoint.dir='{tmp_path / 'other'}'",
                             "checkpoint.every_steps=4", resume=str(tmp_path / "ckpt"), name="elsewhere")
    with pytest.raises(checkpoint.CheckpointWriteError) as error:
        elsewhere.fit()
    origin = tmp_path / "ckpt" / "step-000000002"
    assert str(error.value).endswith(f"its last complete checkpoint is of step 2: --resume {origin} goes on from there")
    assert _resume_hint(elsewhere) == f"; its last checkpoint is of step 2: --resume {origin} goes on from there"
    rc = main(["train", "--config", "configs/tiny.toml", *[f"--set={s}" for s in SMALL], "--no-progress",
               "--output-dir", str(tmp_path / "cli"), "--set", f"checkpoint.dir='{tmp_path / 'ckpt2'}'",
               "--set", "checkpoint.every_steps=2", "--set", "train.max_steps=6"])
    assert rc == 1  # a failed run, not a misused command
    monkeypatch.setattr(checkpoint, "save_tensors", real)
    elsewhere = make_trainer(tmp_path, "train.max_steps=6", f"checkpoint.dir='{tmp_path / 'other'}'",
                             "checkpoint.every_steps=4", resume=str(tmp_path / "ckpt"), name="saved")
    elsewhere.fit()  # saved step 4 here, then its final step 6: checkpoint.dir is where it goes on
    assert _resume_hint(elsewhere) == f"; its last checkpoint is of step 6: --resume {tmp_path / 'other'} goes on from there"
