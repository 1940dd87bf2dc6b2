"""The simulator: phases add up, pipelining hides only what it may, QPS and scaling arithmetic.

    python -m pytest tests/unit/planner/test_simulate.py -q
"""

import pytest

from neorec.planner.cost_model import PlanSettings, TableSpec
from neorec.planner.planner import plan_tables
from neorec.planner.presets import DenseModel, get_model_preset
from neorec.planner.simulate import scaling, simulate
from neorec.planner.topology import zionex

from planner_helpers import random_tables, toy_topology


def test_phases_sum_and_pipelining_hides_input_and_allreduce_only():
    topo = toy_topology(2, 4)
    result = plan_tables(random_tables(5, 16), topo, PlanSettings(batch_size=128), time_limit=1.0)
    dense = DenseModel(mflops_per_sample=50.0, num_parameters=10_000_000)
    sim = simulate(result, dense)
    assert sim.iteration_seconds == pytest.approx(sum(sim.phases.values()))
    hidden = sim.iteration_seconds - sim.pipelined_iteration_seconds
    assert 0 <= hidden <= sim.phases["input_alltoall"] + sim.phases["allreduce"] + 1e-15
    assert sim.phases["dense_backward"] == pytest.approx(2 * 50e6 * 128 / topo.compute_flops)
    assert sim.qps == pytest.approx(8 * 128 / sim.iteration_seconds)
    # the slowest rank of each phase is at least what the partitioner's slowest rank spends there
    ranks = result.ranks()
    assert sim.phases["lookup_forward"] == pytest.approx(max(r.cost.lookup_forward for r in ranks))


def test_one_rank_has_no_communication():
    result = plan_tables([TableSpec("a", 1000, 16, 3.0)], toy_topology(1, 1), PlanSettings(batch_size=64))
    sim = simulate(result, DenseModel(1.0, 1000))
    for key in ("input_alltoall", "output_alltoall", "gradient_alltoall", "allreduce"):
        assert sim.phases[key] == 0.0


def test_scaling_rows_and_efficiency():
    preset = get_model_preset("dlrm-criteo-kaggle")
    rows = scaling(preset.tables, zionex(), preset.settings, preset.dense, nodes=(1, 2), time_limit=0.5)
    assert [r["nodes"] for r in rows] == [1, 2] and [r["ranks"] for r in rows] == [8, 16]
    assert rows[0]["efficiency"] == pytest.approx(1.0)
    assert rows[1]["efficiency"] == pytest.approx(rows[1]["pipelined_qps"] / (2 * rows[0]["pipelined_qps"]))
    assert 0 < rows[1]["efficiency"] <= 1.0 + 1e-9  # crossing nodes never makes a rank faster here


def test_fixed_call_cost_lands_on_ranks_with_pieces_only():
    import dataclasses

    topo = toy_topology(1, 2)
    tables = [TableSpec("a", 1000, 16, 3.0)]
    settings = PlanSettings(batch_size=64, sharding_types=("table_wise",))
    plain = simulate(plan_tables(tables, topo, settings), DenseModel())
    costly = simulate(plan_tables(tables, dataclasses.replace(topo, lookup_call_seconds=0.5), settings), DenseModel())
    assert costly.phases["lookup_forward"] == pytest.approx(plain.phases["lookup_forward"] + 0.5)


def test_scaling_shows_a_size_the_model_does_not_fit_as_a_row():
    topo = toy_topology(2, 1, device_gb=0.25)
    tables = [TableSpec("big", 10_000_000, 8)]   # 360 MB with its state: needs both ranks
    rows = scaling(tables, topo, PlanSettings(batch_size=16), DenseModel(), nodes=(1, 2), time_limit=0.5)
    assert [r["nodes"] for r in rows] == [1, 2]
    assert "table 'big'" in rows[0]["error"] and rows[0]["efficiency"] is None and "qps" not in rows[0]
    assert "error" not in rows[1] and rows[1]["efficiency"] == pytest.approx(1.0)  # relative to the first that fits
