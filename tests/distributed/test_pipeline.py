"""The pipelined distributed Trainer equals the plain loop bit for bit on 2 gloo ranks (sharded
embeddings, data-parallel MLPs, evaluations between steps while a launched input all-to-all is
pending): every step's loss, every table (gathered from the shards), every dense weight.

    python -m pytest tests/distributed/test_pipeline.py -q
"""

from __future__ import annotations

import pipeline_workers
from harness import run_ranks


def test_pipelined_sharded_training_equals_plain_loop_bit_for_bit(tmp_path):
    results = run_ranks(pipeline_workers.pipeline_parity, 2, tmp_path, args=(str(tmp_path), ["train.eval_every_steps=8"]))
    for rank, report in enumerate(results):
        assert report["steps"] == (16, 16), report  # 1000 samples, global batch 64
        # the plain run launches nothing; the pipelined one launches batches 2..16 ahead and uses them
        assert report["counts"] == {"launched": 15, "used": 15}, report
        assert report["tables_equal"] and report["dense_equal"] and report["eval_equal"], (rank, report)
    assert results[0]["num_losses"] == 16 and results[0]["losses_equal"], results[0]
