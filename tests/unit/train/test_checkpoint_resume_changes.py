"""Resuming into a config that differs from the checkpoint's run: another model or optimizer
(refused, naming the difference), half-precision rows, another global batch, other optimizer or
data settings (used, and said). Split from test_checkpoint.py, whose helpers it shares.

    python -m pytest tests/unit/train/test_checkpoint_resume_changes.py -q
"""

from __future__ import annotations

import pytest
import torch

from neorec.config import load_config
from tests.unit.train.test_checkpoint import checkpoint_args, make_trainer


@pytest.mark.parametrize("change, message", [
    ("model.dense_layers=[16, 4]", r"the checkpoint's model differs from the config's: model.dense_layers \[8, 4\] "
                                   r"-> \[16, 4\] \(set them as the checkpoint has them\)"),
    ("model.over_layers=[16, 8]", r"model.over_layers \[16\] -> \[16, 8\]"),
    ("dense_optimizer.kind='sgd'", "checkpoint has dense optimizer 'adagrad', the config 'sgd'"),
    ("embedding.optimizer.kind='sgd'", r"checkpoint has sparse optimizer 'rowwise_adagrad', the config 'sgd' \(set "
                                       r"embedding.optimizer.kind = 'rowwise_adagrad'\)"),
    ("model.pooling='mean'", r"model.pooling 'sum' -> 'mean' \(set them as the checkpoint has them\)"),
])
def test_resume_into_a_different_model_is_refused_with_the_reason(tmp_path, change, message):
    make_trainer(tmp_path, "train.max_steps=2", *checkpoint_args(tmp_path, 2)).fit()
    with pytest.raises(ValueError, match=message):
        make_trainer(tmp_path, "train.max_steps=4", change, resume=str(tmp_path / "ckpt"), name="resumed").fit()


@pytest.mark.parametrize("saved, resumed", [("dot", "dcn"), ("dcn", "dot")])
def test_resume_into_another_interaction_with_the_same_weight_shapes_is_refused(tmp_path, saved, resumed):
    """3 tables of dim 2: the dot interaction's 2 + 6 pair outputs are as wide as DCN's 4 x 2
    inputs, so with no cross layers every dense weight has the checkpoint's shape; the resume
    went on without a word, the top MLP trained on the other interaction's features."""
    shape = ["data.synthetic.num_tables=3", "data.synthetic.num_embeddings=[60, 200, 400]", "model.embedding_dim=2",
             "model.dense_layers=[8, 2]", "model.dcn_num_layers=0"]
    make_trainer(tmp_path, "train.max_steps=2", *shape, f"model.interaction='{saved}'",
                 *checkpoint_args(tmp_path, 2)).fit()
    with pytest.raises(ValueError, match=f"model.interaction '{saved}' -> '{resumed}'"):
        make_trainer(tmp_path, "train.max_steps=4", *shape, f"model.interaction='{resumed}'",
                     resume=str(tmp_path / "ckpt"), name="resumed").fit()
    if saved == "dot":  # DCN's settings are not compared for a checkpoint of "dot"
        again = make_trainer(tmp_path, "train.max_steps=3", *shape, f"model.interaction='{saved}'",
                             "model.dcn_low_rank=3", resume=str(tmp_path / "ckpt"), name="again")
        again.fit()
        assert again.step == 3
    else:  # ... but they are for one of DCN (low rank with no cross layers: no weight to tell)
        with pytest.raises(ValueError, match=r"model.dcn_low_rank 0 -> 1 \(set them as the checkpoint has them\)"):
            make_trainer(tmp_path, "train.max_steps=3", *shape, f"model.interaction='{saved}'", "model.dcn_low_rank=1",
                         resume=str(tmp_path / "ckpt"), name="again").fit()


def test_a_config_whose_layer_sizes_are_tuples_resumes_its_own_checkpoint(tmp_path):
    """The saved config holds lists (JSON): tuples given in Python were said to differ from them."""
    import dataclasses
    import io

    from neorec.train.trainer import Trainer

    make_trainer(tmp_path, "train.max_steps=2", *checkpoint_args(tmp_path, 2)).fit()
    cfg = make_trainer(tmp_path, "train.max_steps=3", name="resumed").cfg
    cfg.model = dataclasses.replace(cfg.model, dense_layers=tuple(cfg.model.dense_layers),
                                    over_layers=tuple(cfg.model.over_layers))
    resumed = Trainer(cfg, out=io.StringIO(), resume=str(tmp_path / "ckpt"))
    resumed.fit()
    assert resumed.step == 3


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_resume_an_fp32_checkpoint_into_half_precision_rows(tmp_path, precision):
    trainer = make_trainer(tmp_path, "train.max_steps=3", *checkpoint_args(tmp_path, 3))
    trainer.fit()
    restored = make_trainer(tmp_path, "train.max_steps=3", f"embedding.storage.precision='{precision}'",
                            resume=str(tmp_path / "ckpt"), name="restored")
    restored.fit()  # nothing left to train: the rows are the checkpoint's, rounded to the storage type
    assert restored.step == 3
    assert "nothing left to train: resumed at step 3, and the run ends at step 3" in restored.out.getvalue()
    assert "restart from their seed" in restored.out.getvalue()  # the fp32 run had no rounding generator
    dtype = getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[precision])
    for table in trainer.model.sparse_arch.tbe.tables:
        saved = trainer.model.sparse_arch.tbe.get_table_weight(table.name)
        back = restored.model.sparse_arch.tbe.get_table_weight(table.name)
        assert torch.equal(back.float(), saved.to(dtype).float()), table.name


def test_resume_into_half_precision_rows_refuses_a_row_beyond_its_range_naming_the_checkpoint(tmp_path):
    """A value beyond fp16's range became inf on the resume, without a word; the run then stopped on
    a NaN loss whose message blamed the learning rates or the input features."""
    trainer = make_trainer(tmp_path, "train.max_steps=2", *checkpoint_args(tmp_path, 2))
    trainer.fit()
    tbe = trainer.model.sparse_arch.tbe
    weight = tbe.get_table_weight("t_feature_0")
    weight[5, 1] = 1e5
    tbe.set_table_weight("t_feature_0", weight)
    trainer.step = 3
    trainer.checkpointer.save()
    with pytest.raises(ValueError, match=r"^--resume .*step-0*3: set_table_weight\('t_feature_0'\): row 5 holds "
                                         r"100000, beyond the largest fp16 value \(65504\)"):
        make_trainer(tmp_path, "train.max_steps=4", "embedding.storage.precision='fp16'",
                     resume=str(tmp_path / "ckpt"), name="restored").fit()


def test_resume_with_a_global_batch_that_does_not_divide_the_epoch_suggests_one(tmp_path):
    make_trainer(tmp_path, "train.max_steps=3", *checkpoint_args(tmp_path, 3)).fit()  # 3 x 128 samples done
    with pytest.raises(ValueError, match=r"384 samples of epoch 0 .* global batches of 256 .*; e.g. "
                                         r"data.batch_size=192 on 1 rank\(s\) continues it"):
        make_trainer(tmp_path, "data.batch_size=256", resume=str(tmp_path / "ckpt"), name="r256").fit()
    resumed = make_trainer(tmp_path, "data.batch_size=192", "train.max_steps=4", resume=str(tmp_path / "ckpt"),
                           name="r192")
    assert resumed.fit().samples == 192 and resumed.step == 4


def test_resume_at_the_end_of_an_epoch_takes_any_global_batch(tmp_path):
    """An epoch of 1000 samples in batches of 128 ends with a short batch of 104: a checkpoint
    there continues with the next epoch whatever the new global batch (here 100)."""
    make_trainer(tmp_path, "train.max_steps=8", *checkpoint_args(tmp_path, 8)).fit()  # the whole epoch 0
    resumed = make_trainer(tmp_path, "data.batch_size=100", "train.max_steps=9", resume=str(tmp_path / "ckpt"),
                           name="r100")
    assert resumed.fit().samples == 100 and resumed.step == 9
    assert resumed.checkpointer.position.epoch == 1 and resumed.checkpointer.position.batch_in_epoch == 1


def test_a_resume_with_another_global_batch_counts_what_is_left_in_its_own_batches(tmp_path):
    """Step 12 of batches of 128 (epoch 1, 512 samples in) resumed with batches of 256: 2 steps are
    left (to step 14), but the end step was counted as 2 epochs of the new batches (8): "nothing
    left to train ... ends at step 8", then it trained, past its progress bar's total."""
    make_trainer(tmp_path, "train.max_steps=12", *checkpoint_args(tmp_path, 12)).fit()
    resumed = make_trainer(tmp_path, "data.batch_size=256", resume=str(tmp_path / "ckpt"), name="r256")
    result = resumed.fit()
    assert resumed.step == 14 and result.samples == 2 * 256 - 24  # the epoch's last batch is short
    assert "nothing left to train" not in resumed.out.getvalue()


def test_a_resume_with_other_optimizer_settings_uses_them_and_says_so(tmp_path):
    """The dense optimizer took the checkpoint's learning rate, eps and weight decay over the
    config's (the sparse one follows the config), silently."""
    make_trainer(tmp_path, "train.max_steps=3", *checkpoint_args(tmp_path, 3)).fit()
    changed = ["dense_optimizer.learning_rate=0.5", "dense_optimizer.weight_decay=0.001",
               "embedding.optimizer.learning_rate=0.25"]
    resumed = make_trainer(tmp_path, "train.max_steps=6", *changed, resume=str(tmp_path / "ckpt"), name="resumed")
    resumed.fit()
    assert [(g["lr"], g["weight_decay"]) for g in resumed.dense_optimizer.param_groups] == [(0.5, 0.001)]
    said = resumed.out.getvalue()
    assert ("checkpoint: resuming step-000000003 with other optimizer settings than its run's, which apply from "
            "here: embedding.optimizer.learning_rate 0.1 -> 0.25, dense_optimizer.learning_rate 0.05 -> 0.5, "
            "dense_optimizer.weight_decay 0.0 -> 0.001") in said, said


def test_a_resume_with_other_data_settings_says_so(tmp_path):
    """Another seed or skew of the data went on silently from the checkpoint's position in a
    different stream of samples (and a different eval set); settings that leave the samples as
    they are (the batch size, which is checked, the prefetch depth) say nothing."""
    make_trainer(tmp_path, "train.max_steps=3", *checkpoint_args(tmp_path, 3)).fit()
    same = make_trainer(tmp_path, "train.max_steps=4", "data.prefetch_batches=1", resume=str(tmp_path / "ckpt"),
                        name="same")
    same.fit()
    assert "data settings" not in same.out.getvalue()
    changed = make_trainer(tmp_path, "train.max_steps=4", "data.synthetic.seed=99", "data.synthetic.zipf_alpha=1.5",
                           resume=str(tmp_path / "ckpt" / "step-000000003"), name="changed")
    changed.fit()
    said = changed.out.getvalue()
    assert ("checkpoint: resuming step-000000003 with other data settings than its run's: data.synthetic.seed "
            "1234 -> 99, data.synthetic.zipf_alpha 1.05 -> 1.5; the samples from here are not the rest of its run's "
            "(some may be trained twice, others never)") in said, said


def test_data_settings_that_leave_the_training_samples_as_they_are_are_not_named():
    """The eval set's size, another eval file and another spelling of the same training file had
    been named as a change of the samples ("some may be trained twice, others never")."""
    from neorec.train.checkpoint_manifest import _changed_data_settings

    def changed(before, after):
        return _changed_data_settings(load_config(None, before).to_dict(), load_config(None, after).to_dict())

    assert changed([], ["data.synthetic.num_eval_samples=50000", "data.prefetch_batches=1"]) == []
    criteo = ["data.source='criteo'", "data.criteo.train_path='day_0.tsv'", "data.criteo.eval_path='e.tsv'"]
    assert changed(criteo, [*criteo, "data.criteo.train_path='./day_0.tsv'", "data.criteo.eval_path='e2.tsv'",
                            "data.criteo.chunk_lines=64"]) == []
    assert changed(criteo, [*criteo, "data.criteo.train_path='day_1.tsv'", "data.criteo.eval_path=''"]) == [
        "data.criteo.eval_path 'e.tsv' -> ''", "data.criteo.train_path 'day_0.tsv' -> 'day_1.tsv'"]
    assert changed([], ["data.source='movielens'"]) == ["data.source 'synthetic' -> 'movielens'"]
