"""The core check: sharded training on 2 and 4 gloo ranks equals single-process training on the
same global batches: predictions at every step, all embedding rows (shards gathered), dense
weights, and predictions of the trained models. Every sharding type alone and a mixed plan, with
SGD and with row-wise AdaGrad; batches with empty bags, a feature with no id on some ranks, an
uneven last batch and a batch smaller than the world.

    python -m pytest tests/distributed/test_sharded_training.py -q

One spawn per world size runs all cases (a rank per process, one thread each, a deadline).
"""

from __future__ import annotations

import pytest

import cases
import workers
from harness import run_ranks

SELECTED = [(kind, optimizer, False, False) for kind in cases.KINDS for optimizer in ("sgd", "rowwise_adagrad")]
SELECTED += [("mixed", "sgd", True, False), ("mixed", "rowwise_adagrad", True, False)]
# documented deviation: column pieces keep their own row-wise AdaGrad statistic
DEVIATION = ("column_wise", "rowwise_adagrad", False, True)
NAMES = [workers.case_name(*case) for case in SELECTED]


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def outcomes(request, tmp_path_factory):
    world = request.param
    results = run_ranks(workers.equivalence, world, tmp_path_factory.mktemp(f"world{world}"),
                        args=(SELECTED + [DEVIATION],))
    return world, results


@pytest.mark.parametrize("name", NAMES)
def test_sharded_training_equals_single_process(outcomes, name):
    world, results = outcomes
    for rank, result in enumerate(results):
        assert result[name] == "ok", f"world {world}, rank {rank}, {name}:\n{result[name]}"


def test_column_pieces_with_rowwise_adagrad_differ_from_the_unsharded_model(outcomes):
    """Row-wise AdaGrad's statistic is per column piece, so the unsharded model is not the
    reference there (the piece-split model is, see above)."""
    _, results = outcomes
    name = workers.case_name(*DEVIATION)
    assert all(result[name] != "ok" for result in results)


def test_a_state_dict_of_another_plan_is_refused_before_any_row_moves(tmp_path):
    """Pieces with this rank's names and shapes holding other rows (a row-wise table's halves and a
    column-wise table's halves swapped between the ranks): load_state_dict took them, and the
    tables came out with rows 0-2 at rows 3-5 and their columns swapped."""
    results = run_ranks(workers.state_dict_across_plans, 2, tmp_path)
    for rank, result in enumerate(results):
        assert result["same"] == "True", (rank, result)
        assert result["other"].startswith(f"load_state_dict: the state dict's pieces on rank {rank} hold "), (rank, result)
        assert "saved under another sharding plan" in result["other"], (rank, result)
        assert result["other unchanged"] == "True", (rank, result)


def test_load_table_weight_refuses_a_value_beyond_fp16_rather_than_storing_inf(tmp_path):
    results = run_ranks(workers.load_table_weight_beyond_fp16, 2, tmp_path)
    assert results[0].startswith("accepted"), results  # rank 0's rows 0-2 hold nothing out of range
    assert results[1] == ("table piece 't@1': its row 1 holds 100000, beyond the largest fp16 value (65504); "
                          "refusing to store it as inf (keep this table's rows in fp32)"), results
