"""The pipelined distributed Trainer equals the plain loop bit for bit on 2 gloo ranks (sharded
embeddings, data-parallel MLPs, evaluations between steps while a launched input all-to-all is
pending): every step's loss, every table (gathered from the shards), every dense weight.

    python -m pytest tests/distributed/test_pipeline_and_qcomm.py -q
"""

from __future__ import annotations

import json

import pytest

import pipeline_workers
from harness import run_ranks


def test_pipelined_sharded_training_equals_plain_loop_bit_for_bit(tmp_path):
    results = run_ranks(pipeline_workers.pipeline_parity, 2, tmp_path,
                        args=(str(tmp_path), ["train.eval_every_steps=8"]))
    for rank, report in enumerate(results):
        assert report["steps"] == (16, 16), report  # 1000 samples, global batch 64
        # the plain run launches nothing; the pipelined one launches batches 2..16 ahead and uses them
        assert report["counts"] == {"launched": 15, "used": 15}, report
        assert report["tables_equal"] and report["dense_equal"] and report["eval_equal"], (rank, report)
    assert results[0]["num_losses"] == 16 and results[0]["losses_equal"], results[0]
    timeline = json.loads((tmp_path / "piped" / "timeline.json").read_text())  # rank 0's, profiled run
    assert timeline["steps"] == 16 and timeline["world_size"] == 2 and timeline["pipeline"] is True
    blocked = timeline["exposed_comm"]["ms_per_step_by_collective"]
    assert {"input_dist.header", "input_dist", "output_dist", "output_dist.backward"} <= set(blocked), blocked
    assert 0.0 < timeline["exposed_comm"]["fraction"] < 1.0
    assert timeline["comm_bytes"]["output_dist"] > 0 and timeline["phases"]["input_dist"]["seconds"] > 0


def test_quantized_exchange_matches_fp32_within_bounds_and_shrinks_bytes(tmp_path):
    results = run_ranks(pipeline_workers.codec_exchange, 2, tmp_path)
    # relative bounds of the codecs (qcomm.py), on the block's scale: fp16 2^-11, bf16 2^-8,
    # int8 half a step of the row range (rows of N(0, 0.1^2) values: range < 1, gradients < 1e-5)
    bounds = {"fp32": 0.0, "fp16": 2.0 ** -11, "bf16": 2.0 ** -8, "int8": 1.0 / 255}
    for rank, out in enumerate(results):
        fp32_bytes, dim = out["fp32_bytes"]["x"], 7 + 4 * rank  # the worker's block widths

        def padded(n):  # every block is padded to a multiple of 4 bytes
            return (n + 3) // 4 * 4

        mixed = out["int8/fp16"]  # forward and backward codecs chosen separately
        assert mixed["forward_error"] == out["int8"]["forward_error"]
        assert mixed["backward_error"] == out["fp16"]["backward_error"]
        assert mixed["bytes"]["x"] == out["int8"]["bytes"]["x"]
        assert mixed["bytes"]["x.backward"] == out["fp16"]["bytes"]["x.backward"]
        for codec, bound in bounds.items():
            entry = out[codec]
            assert entry["forward_error"] <= bound * entry["forward_scale"], (codec, entry)
            assert entry["backward_error"] <= bound * entry["backward_scale"] * 1.0001, (codec, entry)
            assert entry["no_grad_equal"], codec
        assert out["fp32"]["forward_error"] == 0.0 and out["fp32"]["backward_error"] == 0.0
        assert out["fp32"]["bytes"]["x"] == fp32_bytes
        assert out["fp16"]["bytes"]["x"] == padded(fp32_bytes // 2 + 4)  # one block to the other rank, 4-byte scale
        assert out["bf16"]["bytes"]["x"] == padded(fp32_bytes // 2)
        assert out["int8"]["bytes"]["x"] == padded(fp32_bytes // (4 * dim) * (dim + 8))  # rows x (codes + min, step)
        assert out["fp16"]["bytes"]["x.backward"] == padded(out["fp32"]["bytes"]["x.backward"] // 2 + 4)


def test_two_rank_training_with_each_codec_ends_within_0_3_percent_ne_of_fp32(tmp_path):
    results = run_ranks(pipeline_workers.codec_training, 2, tmp_path, args=(str(tmp_path),))
    for out in results:
        reference = out["fp32"]["ne"]
        assert reference < 0.98, out  # it learned something
        for codec in ("fp16", "bf16", "int8"):
            assert abs(out[codec]["ne"] - reference) <= 0.003 * reference, (codec, out)
        assert out["fp16"]["bytes"] < 0.51 * out["fp32"]["bytes"]
        assert out["fp16"]["backward_bytes"] < 0.51 * out["fp32"]["backward_bytes"]
        assert out["bf16"]["bytes"] * 2 == out["fp32"]["bytes"]
    print({codec: round(v["ne"], 5) for codec, v in results[0].items()})


@pytest.mark.parametrize("how", ["load", "id"])
def test_a_batch_unusable_on_one_rank_stops_after_the_step_before_it_with_that_ranks_own_error(tmp_path, how):
    """Load failure: the failing rank launched no look-ahead exchange while the others did, so its next
    collective (step 2's gradient all-to-all) met their header exchange and gloo aborted the healthy
    rank ("collective mismatch"), hiding the error. Bad id: the rank raised at once, losing step 2.
    Now it launches an empty exchange in its place, trains step 2 as the plain loop does, and raises
    its own error."""
    results = run_ranks(pipeline_workers.fail_on_one_rank, 2, tmp_path, args=(str(tmp_path), how, True), timeout=120)
    if how == "load":
        assert results[1] == "step 2: OSError: injected: batch 3 could not be read on rank 1", results
    else:
        assert results[1].startswith("step 2: ValueError: feature ") and "id 1000000000 is outside" in results[1], results
    assert results[0].startswith("step 2: RuntimeError: ") and "Connection closed by peer" in results[0], results


@pytest.mark.parametrize("pipeline", [True, False])
def test_a_source_failing_past_the_epochs_last_batch_on_one_rank_is_never_read(tmp_path, pipeline):
    """Rank 1's source raised when asked for a batch after the epoch's last: with the pipeline it
    launched an empty look-ahead exchange the other rank (whose source simply ended) did not, so
    gloo aborted it (SIGABRT, "collective mismatch") and its error was never shown; the plain loop
    stopped there too. Both loops now take the epoch's own number of batches, the same on every
    rank, and read no further."""
    results = run_ranks(pipeline_workers.fail_on_one_rank, 2, tmp_path, args=(str(tmp_path), "end", pipeline),
                        timeout=120)
    assert results[0] == results[1] and results[0].startswith("finished at step "), results


def test_a_rank_failing_mid_step_stops_with_its_own_error(tmp_path):
    """A step that raises on one rank between forward and backward must not complete the id
    exchange launched for the next batch (the other rank is in another collective: gloo aborted
    the process and the error was never shown); the failing rank ends with its own error, the
    other with a lost peer."""
    results = run_ranks(pipeline_workers.fail_between_forward_and_backward, 2, tmp_path, args=(str(tmp_path),),
                        timeout=120)
    assert results[1] == "raised: injected failure after the forward of step 3"
    assert results[0].startswith("raised: "), results[0]
