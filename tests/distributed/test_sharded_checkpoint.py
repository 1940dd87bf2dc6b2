"""Sharded checkpoints: saved on 2 ranks (mixed plan), restored on 1 process and on 4 ranks with
another plan: identical embeddings and dense weights (bit for bit) and predictions.

    python -m pytest tests/distributed/test_sharded_checkpoint.py -q
"""

from __future__ import annotations

import io

import torch

import checkpoint_workers
from checkpoint_workers import snapshot
from harness import run_ranks
from neorec.embedding import TableConfig
from neorec.sharding import ShardingPlan, column_wise, data_parallel, row_wise, table_wise
from neorec.train.checkpoint import verify_checkpoint
from neorec.train.trainer import Trainer
from workers import small_config

TABLES = [TableConfig(f"t_feature_{i}", rows, 8) for i, rows in enumerate([60, 200, 25])]


def assert_same(restored, saved):
    """Tables and dense weights bit for bit; predictions up to float summation order (a sharded
    forward adds row-wise partial sums and runs the MLPs on smaller batches)."""
    for key in restored:
        if key == "logits":
            torch.testing.assert_close(restored[key], saved[key], rtol=1e-5, atol=1e-6)
        elif key != "step":
            assert torch.equal(restored[key], saved[key]), key


def test_save_on_2_ranks_restore_on_1_and_4_with_another_plan(tmp_path):
    save_plan = ShardingPlan({TABLES[0].name: column_wise(TABLES[0], [1, 0], widths=[3, 5]),
                              TABLES[1].name: row_wise(TABLES[1], [0, 1]),
                              TABLES[2].name: data_parallel()}, 2).to_json()
    other_plan = ShardingPlan({TABLES[0].name: row_wise(TABLES[0], [3, 1, 0, 2]),
                               TABLES[1].name: column_wise(TABLES[1], [2, 3]),
                               TABLES[2].name: table_wise(TABLES[2], 1)}, 4).to_json()
    overrides = [f"checkpoint.dir='{tmp_path / 'ckpt'}'", "checkpoint.every_steps=2", "train.max_steps=5",
                 "checkpoint.incremental=true", "checkpoint.full_when_fraction_exceeds=100.0",
                 'embedding.optimizer.kind="sgd"']
    saved = run_ranks(checkpoint_workers.train_or_resume, 2, tmp_path / "save",
                      args=(str(tmp_path), save_plan, overrides, None))[0]
    manifest = verify_checkpoint(tmp_path / "ckpt" / "step-000000005")
    assert manifest["kind"] == "incremental" and manifest["world_size"] == 2 and len(manifest["chain"]) == 3
    assert set(manifest["files"]) == {"rank0.pt", "rank1.pt", "dense.pt"}

    single = Trainer(small_config(str(tmp_path / "run1"), 128, 64, overrides), out=io.StringIO(),
                     resume=str(tmp_path / "ckpt"))
    single.fit()  # step 5 = max_steps: restores, trains nothing
    restored = snapshot(single, False)
    assert single.step == 5 and restored.keys() == saved.keys() - {"step"}
    assert_same(restored, saved)

    four = run_ranks(checkpoint_workers.train_or_resume, 4, tmp_path / "four",
                     args=(str(tmp_path), other_plan, overrides, str(tmp_path / "ckpt")))
    for result in four:
        assert int(result["step"]) == 5
        assert_same(result, saved)


def test_fp16_replicas_stay_equal_on_every_rank_and_resume_bit_for_bit(tmp_path):
    """fp16 rows with stochastic rounding and row-wise AdaGrad state: the data-parallel table's
    copies drew their rounding noise from each rank's shard generator, so they drifted apart and a
    checkpoint (which keeps rank 0's copy) could not continue like the uninterrupted run."""
    plan = ShardingPlan({TABLES[0].name: table_wise(TABLES[0], 0), TABLES[1].name: row_wise(TABLES[1], [0, 1]),
                         TABLES[2].name: data_parallel()}, 2).to_json()
    common = ["checkpoint.every_steps=3", "train.max_steps=6", 'embedding.storage.precision="fp16"',
              'embedding.optimizer.kind="rowwise_adagrad"']
    straight = run_ranks(checkpoint_workers.train_or_resume, 2, tmp_path / "straight",
                         args=(str(tmp_path / "a"), plan, common + [f"checkpoint.dir='{tmp_path / 'ckpt'}'"], None))
    replica = TABLES[2].name
    assert torch.equal(straight[0][replica], straight[1][replica])
    resumed = run_ranks(checkpoint_workers.train_or_resume, 2, tmp_path / "resumed",
                        args=(str(tmp_path / "b"), plan, common + [f"checkpoint.dir='{tmp_path / 'ckpt2'}'"],
                              str(tmp_path / "ckpt" / "step-000000003")))
    for before, after in zip(straight, resumed):
        assert int(after["step"]) == 6
        assert_same(after, before)
