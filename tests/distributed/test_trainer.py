"""The distributed Trainer on 2 gloo ranks equals the single-process Trainer on the same global
batches: losses, final eval (AUC gathered from all ranks), tables and dense weights; the last
global batch of the epoch is uneven (1000 samples, global batch 128 or 96), eval batches too.
Only rank 0 prints and writes the metrics log.

    python -m pytest tests/distributed/test_trainer.py -q
"""

from __future__ import annotations

import json

import pytest

import workers
from harness import run_ranks
from neorec.embedding import TableConfig
from neorec.sharding import ShardingPlan, column_wise, data_parallel, row_wise


def mixed_plan_json() -> str:
    tables = [TableConfig(f"t_feature_{i}", rows, 8) for i, rows in enumerate([60, 200, 25])]
    return ShardingPlan({
        tables[0].name: column_wise(tables[0], [1, 0]),
        tables[1].name: row_wise(tables[1], [0, 1]),
        tables[2].name: data_parallel(),
    }, 2).to_json()


# the mixed plan has a column-wise table: SGD there (row-wise AdaGrad keeps per-piece statistics)
@pytest.mark.parametrize("plan,local_batch,sparse", [("default", 64, "rowwise_adagrad"), ("mixed", 48, "sgd")])
def test_distributed_trainer_equals_single_process(tmp_path, plan, local_batch, sparse):
    plan_json = "" if plan == "default" else mixed_plan_json()
    overrides = [f'embedding.optimizer.kind="{sparse}"']
    results = run_ranks(workers.trainer_equivalence, 2, tmp_path,
                        args=(str(tmp_path), plan_json, local_batch, overrides))
    assert results[0]["steps"] == -(-1000 // (2 * local_batch))
    assert "eval @ step" not in results[1]["out"] and results[1]["out"] == ""
    records = [json.loads(line) for line in (tmp_path / "dist" / "metrics.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in records].count("final") == 1
    assert all(r.get("loss", 0.0) >= 0.0 for r in records)
    if plan == "mixed":
        assert json.loads(results[0]["plan"]) == json.loads(plan_json)


def test_eval_predictions_are_gathered_on_rank_0_alone(tmp_path):
    """Every rank gathered every eval prediction and computed the same metrics (~120 bytes per eval
    sample on each rank); rank 0 now gathers them and broadcasts the figures (checked against the
    single process above)."""
    results = run_ranks(workers.gather_on_main, 3, tmp_path)
    assert results == [[0.0, 1.0, 20.0, 21.0, 22.0, 23.0], None, None]


def test_text_is_broadcast_from_a_subgroups_first_rank(tmp_path):
    """``broadcast_text`` took its ``src`` (a rank of the group) for a global rank: on a group
    whose first rank is not global rank 0 every rank failed."""
    assert run_ranks(workers.broadcast_on_subgroup, 3, tmp_path) == [None, "from global rank 1",
                                                                     "from global rank 1"]


def test_two_ranks_on_one_gpu_are_refused_on_every_rank(tmp_path):
    """One GPU visible per rank was taken for "a launcher gave each rank its own", but a
    CUDA_VISIBLE_DEVICES set for the whole node shows every rank the same one: NCCL failed with
    "Duplicate GPU detected" or hung. The ranks now compare their GPUs' UUIDs."""
    shared = run_ranks(workers.distinct_gpus, 3, tmp_path / "a", args=(["GPU-a", "GPU-b", "GPU-a"],))
    assert all(r.startswith("ranks [0, 2] run on one GPU (GPU-a)") for r in shared), shared
    assert run_ranks(workers.distinct_gpus, 2, tmp_path / "b", args=(["GPU-a", "GPU-b"],)) == ["ok", "ok"]


def test_a_failure_computing_the_eval_metrics_on_rank_0_stops_every_rank(tmp_path):
    """With rank 0 alone computing the metrics, its error left the other ranks waiting in the
    broadcast of the figures until the launcher or the process group's timeout stopped them."""
    results = run_ranks(workers.eval_failing_on_rank_0, 2, tmp_path, args=(str(tmp_path),), timeout=60)
    assert results == ["MemoryError: injected: no memory for the eval sort",
                       "RuntimeError: evaluation: rank 0 failed computing the metrics (its error is in its output)"]
