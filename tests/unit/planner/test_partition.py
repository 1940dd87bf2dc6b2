"""The partitioner and planner on plain data: plans validate, memory limits hold, the lower
bound is a bound, hierarchical plans are found, infeasible input names the table and the limit.

    python -m pytest tests/unit/planner/test_partition.py -q
"""

import itertools
import math
import re

import pytest

from neorec.planner.baselines import BASELINES, baseline_loads
from neorec.planner.cost_model import PRECISION_BYTES, PlanSettings, TableSpec, state_bytes_per_row
from neorec.planner.enumerate import Capacity, InfeasiblePlanError, enumerate_options
from neorec.planner.names import TIERS
from neorec.planner.partition import lower_bound
from neorec.planner.planner import plan_tables
from neorec.planner.presets import get_model_preset
from neorec.planner.topology import Topology, zionex
from neorec.sharding.plan import ShardingType

from planner_helpers import random_tables, table_configs, toy_topology


def _weights_per_rank(result):
    """Bytes of weights + optimizer state per rank and tier, recomputed from the ShardingPlan's shards."""
    world = result.topology.world_size
    device, host = [0.0] * world, [0.0] * world
    specs = {t.name: t for t in result.tables}
    for name, entry in result.plan.tables.items():
        tier = result.tiers[name]
        elem = PRECISION_BYTES[entry.precision]
        shards = entry.shards or []
        if entry.sharding_type == ShardingType.DATA_PARALLEL:
            t = specs[name]
            shards = [type("S", (), {"rank": r, "num_rows": t.num_rows, "num_cols": t.dim})() for r in range(world)]
        for s in shards:
            nbytes = s.num_rows * (s.num_cols * elem + state_bytes_per_row(result.settings.optimizer, s.num_cols))
            (device if tier == "device" else host)[s.rank] += nbytes
    return device, host


@pytest.mark.parametrize("seed,num_tables,nodes,per_node,latency", [(0, 12, 1, 4, 0.0), (1, 30, 2, 4, 0.0),
                                                                    (2, 20, 4, 2, 0.0), (3, 12, 1, 4, 2e-5)])
def test_plans_validate_respect_memory_and_beat_baselines(seed, num_tables, nodes, per_node, latency):
    import dataclasses

    tables = random_tables(seed, num_tables)
    # with a latency, the baselines pay it too (it was left out of theirs: 5x "better" than the planner)
    topo = dataclasses.replace(toy_topology(nodes, per_node, device_gb=0.5), collective_latency=latency)
    settings = PlanSettings(batch_size=256)
    result = plan_tables(tables, topo, settings, time_limit=2.0)
    result.plan.validate(table_configs(tables), topo.world_size)
    assert result.plan.ranks_per_node == per_node
    device, _ = _weights_per_rank(result)
    capacity = Capacity.of(topo, settings)
    summaries = result.ranks()
    for r in range(topo.world_size):
        assert device[r] <= summaries[r].memory.device <= capacity.device * (1 + 1e-9)
    # the reported loads are the sums of the placed pieces, the makespan their maximum
    assert result.makespan == pytest.approx(max(s.cost.total for s in summaries))
    assert result.lower_bound <= result.makespan * (1 + 1e-9) <= result.greedy_makespan * (1 + 2e-9)
    assert 0.0 <= result.gap < 0.5
    for name in BASELINES:
        assert result.makespan <= max(baseline_loads(name, tables, topo, settings)) * (1 + 1e-9), name


def test_matches_brute_force_optimum_on_a_tiny_instance():
    tables = [TableSpec(f"t{i}", 1000, 16, pooling=p) for i, p in enumerate([9.0, 7.0, 6.0, 5.0, 4.0, 2.0])]
    topo = toy_topology(1, 2)
    settings = PlanSettings(batch_size=64, sharding_types=("table_wise",))
    result = plan_tables(tables, topo, settings)
    options = {t.name: enumerate_options(t, topo, settings)[0] for t in tables}
    best = math.inf
    for ranks in itertools.product(range(2), repeat=len(tables)):
        loads = [0.0, 0.0]
        for t, r in zip(tables, ranks):
            loads[r] += options[t.name].piece_seconds
        best = min(best, max(loads))
    assert result.makespan == pytest.approx(best)


def test_lower_bound_is_at_least_work_over_ranks_and_largest_piece():
    tables = random_tables(3, 10)
    topo = toy_topology(1, 4)
    settings = PlanSettings(batch_size=128)
    options = {t.name: enumerate_options(t, topo, settings) for t in tables}
    bound = lower_bound(options, 4)
    work = sum(min(o.work for o in opts) for opts in options.values()) / 4
    piece = max(min(o.piece_seconds for o in opts) for opts in options.values())
    assert bound >= max(work, piece) * (1 - 1e-12)


def test_hierarchical_table_row_wise_is_found_by_the_search():
    # one hot table too big for a rank but fitting a node; NICs much slower than the node's links
    topo = toy_topology(num_nodes=2, ranks_per_node=4, device_gb=0.3, intra=200e9, inter=2e9)
    hot = TableSpec("hot", 2_000_000, 64, pooling=20.0)   # 512 MB of fp32 rows + state
    small = [TableSpec(f"s{i}", 1000, 16, pooling=1.0) for i in range(6)]
    settings = PlanSettings(batch_size=512, sharding_types=("table_wise", "row_wise", "table_row_wise", "column_wise"))
    result = plan_tables([hot] + small, topo, settings)
    entry = result.plan.tables["hot"]
    assert entry.sharding_type == ShardingType.TABLE_ROW_WISE
    assert len({result.plan.node_of(s.rank) for s in entry.shards}) == 1 and len(entry.shards) == 4
    result.plan.validate(table_configs([hot] + small), 8)


def test_precision_and_tier_are_relaxed_only_when_needed():
    topo = toy_topology(1, 2, device_gb=0.05, host_gb=1.0)
    settings = PlanSettings(batch_size=16, precisions=("fp32", "fp16"), tiers=("device", "dram"))
    small = plan_tables([TableSpec("a", 10_000, 16)], topo, settings)
    assert small.plan.tables["a"].precision == "fp32" and small.tiers["a"] == "device"
    big = plan_tables([TableSpec("a", 1_000_000, 32), TableSpec("b", 1000, 8)], topo, settings)  # 128 MB at fp32
    assert "dram" in big.tiers.values() or "fp16" in {e.precision for e in big.plan.tables.values()}


def test_infeasible_input_names_the_table_and_the_limit():
    topo = toy_topology(1, 2, device_gb=0.01)
    settings = PlanSettings(batch_size=8)
    with pytest.raises(InfeasiblePlanError, match=r"table 'huge'.*tightest limit: .*device memory.*GiB"):
        plan_tables([TableSpec("ok", 100, 8), TableSpec("huge", 10_000_000, 64)], topo, settings)
    with pytest.raises(InfeasiblePlanError, match=r"table 'picky': the constraints exclude every option.*"
                                                  r"usable on 1 ranks: \[\] \(row_wise needs 2 or more ranks\)"):
        plan_tables([TableSpec("picky", 100, 8, sharding_types=("row_wise",))], toy_topology(1, 1), settings)
    with pytest.raises(InfeasiblePlanError, match=r"usable on 8 ranks: \[\] \(row_wise needs at least one row per "
                                                  r"rank \(3 rows, 8 ranks\); column_wise needs dim 1 to split"):
        plan_tables([TableSpec("tiny", 3, 1, sharding_types=("row_wise", "column_wise"))], toy_topology(1, 8),
                    settings)
    # each fits alone, not all together: the message says by how much (it named one table that
    # found no room on one rank, as if the cluster were nearly full)
    many = [TableSpec(f"m{i}", 300_000, 8) for i in range(4)]   # 9.6 MB each, 2 ranks x 8.5 MB
    with pytest.raises(InfeasiblePlanError, match=r"no plan fits: the tables need at least 41.\d\d MiB of device "
                                                  r"memory in all \(each at its smallest option; the largest: 'm0', "
                                                  r"'m1', 'm2'\), and the 2 ranks hold 16.\d\d MiB \(254%\)"):
        plan_tables(many, topo, settings)


def test_deterministic_without_time_limit():
    tables = random_tables(4, 25)
    topo = toy_topology(2, 4)
    a = plan_tables(tables, topo, PlanSettings(batch_size=64), time_limit=math.inf, max_rounds=50)
    b = plan_tables(tables, topo, PlanSettings(batch_size=64), time_limit=math.inf, max_rounds=50)
    assert a.plan.to_json() == b.plan.to_json()


def test_model_f_fits_16_zionex_nodes_with_fp16_rows_dram_and_row_wise_across_nodes():
    preset = get_model_preset("neo-model-f")
    assert sum(t.num_parameters for t in preset.tables) == pytest.approx(12e12, rel=1e-6)
    topo = zionex(16)
    result = plan_tables(preset.tables, topo, preset.settings, time_limit=1.0)
    result.plan.validate(table_configs(preset.tables), 128, tiers=TIERS)
    assert result.settings.optimizer == "rowwise_adagrad"
    assert "fp16" in {e.precision for e in result.plan.tables.values()}
    assert any(tier in ("dram", "cached_dram") for tier in result.tiers.values())
    assert {n: e.tier for n, e in result.plan.tables.items()} == result.tiers  # the plan keeps the tiers
    assert result.plan.validate(table_configs(preset.tables), 128) is result.plan  # training places them
    with pytest.raises(ValueError, match="cannot place.*--tiers device"):  # a caller of the device only
        result.plan.validate(table_configs(preset.tables), 128, tiers=("device",))
    nodes = {result.plan.node_of(s.rank) for e in result.plan.tables.values() for s in e.shards
             if e.sharding_type == ShardingType.ROW_WISE}
    assert len(nodes) > 1
    # and fp32 alone does not fit
    with pytest.raises(InfeasiblePlanError, match=r"no plan fits: the tables need at least [\d.]+ TiB of host DRAM in "
                                                  r"all .*\(1\d\d%\)"):
        plan_tables(preset.tables, topo, PlanSettings(batch_size=512, precisions=("fp32",),
                                                      tiers=("device", "cached_dram", "dram")), time_limit=0.5)


def test_evaluate_plan_reproduces_the_planner_costs_and_scores_other_plans():
    from neorec.planner.planner import evaluate_plan
    from neorec.sharding import default_plan

    tables = random_tables(6, 15)
    topo = toy_topology(2, 2)
    settings = PlanSettings(batch_size=128)
    result = plan_tables(tables, topo, settings, time_limit=1.0)
    again = evaluate_plan(result.plan, tables, topo, settings, result.tiers)
    assert again.makespan == pytest.approx(result.makespan)
    assert [s.cost.total for s in again.ranks()] == pytest.approx([s.cost.total for s in result.ranks()])
    other = evaluate_plan(default_plan(table_configs(tables), 4, 2), tables, topo, settings)
    assert other.makespan >= result.makespan * (1 - 1e-9)


def test_relaxed_plans_keep_the_preferred_precision_where_it_fits():
    # one big table needs fp16 to fit; the small ones keep fp32
    topo = toy_topology(1, 2, device_gb=0.05)
    settings = PlanSettings(batch_size=16, precisions=("fp32", "fp16"))
    tables = [TableSpec("big", 1_000_000, 32)] + [TableSpec(f"s{i}", 1000, 64) for i in range(4)]
    result = plan_tables(tables, topo, settings)
    assert result.plan.tables["big"].precision == "fp16"
    assert {result.plan.tables[f"s{i}"].precision for i in range(4)} == {"fp32"}
    result.plan.validate(table_configs(tables), 2)


def _place_reference(state, option, by_memory):
    """``_State.place`` written plainly: check every rank, then take the k smallest keys."""
    k, world, size = option.num_pieces, state.world, state.per_node
    key = (lambda r: (state.fill(r), state.load[r], r)) if by_memory else (lambda r: (state.load[r], r))
    if option.placement == "all":
        return tuple(range(world)) if all(state.fits(r, option) for r in range(world)) else None
    if option.placement == "any":
        room = sorted((r for r in range(world) if state.fits(r, option)), key=key)
        return tuple(sorted(room[:k])) if len(room) >= k else None
    best = None
    for node in range(world // size):
        room = sorted((r for r in range(node * size, (node + 1) * size) if state.fits(r, option)), key=key)
        if len(room) < k:
            continue
        peak = max(state.fill(r) if by_memory else state.load[r] for r in room[:k])
        if best is None or peak < best[0] - 1e-12:
            best = (peak, tuple(sorted(room[:k])))
    return None if best is None else best[1]


def test_placement_takes_the_least_loaded_ranks_with_room():
    """The partitioner's fast placement (ranks walked in cached load / fill order) against the
    plain rule, on random loads and memory with ties, nearly full ranks and every placement kind."""
    import random

    from neorec.planner.cost_model import Cost, Memory
    from neorec.planner.enumerate import ShardOption
    from neorec.planner.partition import Placement, _State

    rng = random.Random(0)
    checked = 0
    for trial in range(60):
        nodes, per_node = rng.choice([(1, 4), (2, 4), (4, 2), (3, 8)])
        topo = toy_topology(nodes, per_node)
        state = _State(topo, Capacity(device=100.0, host=50.0, ssd=0.0))
        options = []
        for i in range(12):
            placement = rng.choice(["any", "node", "all"])
            pieces = {"all": state.world, "node": rng.randint(1, per_node), "any": rng.randint(1, state.world)}[placement]
            memory = Memory(device=rng.choice([0.0, 5.0, 20.0, 40.0]), host=rng.choice([0.0, 10.0]))
            cost = Cost(lookup_forward=rng.choice([0.5, 1.0, 1.0, 2.5]))  # repeated values: ties in load
            options.append(ShardOption(f"t{i}", ShardingType.TABLE_WISE, pieces, placement, "device", "fp32",
                                       cost, memory))
        for option in options:
            for by_memory in (False, True):
                expected = _place_reference(state, option, by_memory)
                assert state.place(option, by_memory) == expected, (trial, option, by_memory)
                checked += expected is not None
            ranks = state.place(option, rng.random() < 0.5)
            if ranks is not None:
                state.apply(Placement(option, ranks), +1)
    assert checked > 200  # most placements found room; the rest were refused by both


def _preferred_options_that_fit(result, settings):
    """Tables of the final plan with a more preferred option that fits in the memory the other
    tables leave (placed as the partitioner places)."""
    from neorec.planner.partition import _State
    from neorec.planner.planner import _preference

    capacity = Capacity.of(result.topology, result.settings)
    state = _State(result.topology, capacity)
    for p in result.placements.values():
        state.apply(p, +1)
    preference, specs, found = _preference(settings), {t.name: t for t in result.tables}, []
    for name, p in result.placements.items():
        state.apply(p, -1)
        better = [o for o in enumerate_options(specs[name], result.topology, result.settings, capacity)
                  if preference(o) < preference(p.option) and state.place(o) is not None]
        if better:
            found.append((name, p.option.describe(), better[0].describe()))
        state.apply(p, +1)
    return found


@pytest.mark.parametrize("seed,num_tables,nodes,per_node,device_gb,host_gb,tiers", [
    (6, 6, 2, 4, 0.0024, 0.0, ("device",)),                 # fp16 where fp32 fits after the search
    (37, 6, 1, 2, 0.0533, 0.1065, ("device", "dram")),
    (153, 19, 1, 2, 0.0848, 0.1697, ("device", "dram")),    # dram where the device fits after the search
])
def test_final_plan_keeps_the_most_preferred_option_memory_allows(seed, num_tables, nodes, per_node, device_gb,
                                                                  host_gb, tiers):
    """README: each table keeps the most preferred tier, then precision, that memory allows, in
    the final plan (the search after the preference pass can free memory)."""
    tables = random_tables(seed, num_tables)
    settings = PlanSettings(batch_size=16, precisions=("fp32", "fp16"), tiers=tiers)
    result = plan_tables(tables, toy_topology(nodes, per_node, device_gb=device_gb, host_gb=host_gb), settings,
                         time_limit=math.inf, max_rounds=200)
    assert _preferred_options_that_fit(result, settings) == []
    result.plan.validate(table_configs(tables), nodes * per_node, tiers=TIERS)


def test_plan_carries_the_tier_and_evaluate_plan_reads_it():
    from neorec.planner.planner import evaluate_plan

    topo = toy_topology(1, 2, device_gb=0.05, host_gb=1.0)
    settings = PlanSettings(batch_size=16, tiers=("dram",))
    tables = [TableSpec("a", 10_000, 16), TableSpec("b", 1000, 8)]
    result = plan_tables(tables, topo, settings)
    assert {e.tier for e in result.plan.tables.values()} == {"dram"}
    again = evaluate_plan(result.plan, tables, topo, settings)   # no tiers given: the plan's own
    assert again.tiers == result.tiers and again.makespan == pytest.approx(result.makespan)


def test_small_memory_limits_are_given_in_readable_units():
    topo = toy_topology(1, 2, device_gb=1e-5)   # 10 kB per rank: limits in KiB, not "0.00 GiB"
    settings = PlanSettings(batch_size=8, precisions=("fp32", "fp16"))
    with pytest.raises(InfeasiblePlanError, match=r"table 'big'.*tightest limit: .*device memory: needs [\d.,]+ "
                                                  r"(KiB|MiB) per rank, a rank has [\d.]+ KiB") as info:
        plan_tables([TableSpec("big", 100_000, 8)], topo, settings)
    assert "0.00 GiB" not in str(info.value)


def test_a_tier_the_topology_lacks_still_gives_a_tightest_limit():
    with pytest.raises(InfeasiblePlanError, match=r"tightest limit: .*SSD share: needs .* the topology has none"):
        plan_tables([TableSpec("a", 100, 8)], toy_topology(1, 2), PlanSettings(batch_size=8, tiers=("cached_ssd",)))


def test_a_table_whose_own_lists_exclude_every_option_is_told_so_directly():
    for key, value in (("precisions", ("bf16",)), ("tiers", ("dram",)), ("sharding_types", ("row_wise",))):
        with pytest.raises(InfeasiblePlanError) as info:
            plan_tables([TableSpec("picky", 100, 8, **{key: value})], toy_topology(1, 2),
                        PlanSettings(batch_size=8, precisions=("fp32", "fp16"), sharding_types=("table_wise",)))
        message = str(info.value)
        assert f"table 'picky': the constraints exclude every option: its own {key} {list(value)} share none" in message
        assert "needs" not in message   # no sharding-type reasons that do not matter


def test_tables_that_fit_alone_but_not_together_give_the_limit_in_readable_units():
    topo = toy_topology(1, 2, device_gb=2e-4)   # 166 KiB per rank for tables
    many = [TableSpec(f"m{i}", 3000, 8) for i in range(3)]   # 105 KiB each: 95% of the whole, one per rank
    with pytest.raises(InfeasiblePlanError, match=r"tightest limit: .*would hold [\d.]+ KiB of [\d.]+ KiB; the tables "
                                                  r"need at least [\d.]+ KiB of device memory in all .* \(95%\)") as info:
        plan_tables(many, topo, PlanSettings(batch_size=1, sharding_types=("table_wise",)))
    assert "0.00 GiB" not in str(info.value)


def test_the_time_limit_bounds_the_search_not_enumeration_or_greedy_starts(monkeypatch):
    """The deadline was set before the options were enumerated: enumeration and the greedy starts
    of relaxation levels that did not fit used it up, and the plan that fit got no search at all
    (Neo Model-A on one node: "0 search rounds" at the default 10 s). Now only search time counts,
    shared by the plan's partitions: each gets what the earlier ones' searches left."""
    import time

    import neorec.planner.planner as planner
    from neorec.planner.partition import PartitionResult

    limits = []
    real = planner.partition

    def partition(*args, **kwargs):
        limits.append(kwargs["time_limit"])
        if len(limits) == 1:   # the first level (fp32 only): a slow greedy start that does not fit
            time.sleep(0.3)
            raise InfeasiblePlanError("does not fit")
        result = real(*args, **kwargs)
        return PartitionResult(result.placements, result.loads, result.makespan, result.lower_bound, result.rounds,
                               result.greedy_makespan, search_seconds=0.4)  # as if it searched 0.4 s

    enumerate_options = planner.enumerate_options
    monkeypatch.setattr(planner, "enumerate_options", lambda *a: time.sleep(0.2) or enumerate_options(*a))
    monkeypatch.setattr(planner, "partition", partition)
    plan_tables([TableSpec("a", 100, 8)], toy_topology(1, 2), PlanSettings(batch_size=8, precisions=("fp32", "fp16")),
                time_limit=1.0)
    assert limits == [1.0, 1.0], limits  # 0.2 s of each enumeration and the 0.3 s greedy start: not counted
    budget = [1.0]  # the partitions of one plan (a mixed plan is partitioned again) share the search time
    options = {"a": enumerate_options(TableSpec("a", 100, 8), toy_topology(1, 2), PlanSettings(batch_size=8))}
    capacity = Capacity.of(toy_topology(1, 2), PlanSettings(batch_size=8))
    for _ in range(2):
        planner._partition(options, toy_topology(1, 2), capacity, budget, 10, None)
    assert limits[2:] == [1.0, pytest.approx(0.6)] and budget[0] == pytest.approx(0.2)


def test_tight_packings_that_least_full_placement_misses_are_found_by_best_fit():
    """Seven tables filling 3 ranks to 92-97%: placing each on the least full rank leaves gaps no
    remaining table fits, and the planner said "the cluster is too full" (or, with fp16 allowed,
    stored a table in fp16); best-fit decreasing finds an all-fp32 packing."""
    fractions = [0.6, 0.5, 0.35, 0.4, 0.2, 0.5, 0.35]
    tables = [TableSpec(f"t{i}", int(f * 0.97e9 / 4 / 64), 64, 1.0) for i, f in enumerate(fractions)]
    topo = toy_topology(1, 3, device_gb=1.0)
    settings = PlanSettings(batch_size=1, sharding_types=("table_wise",), optimizer="sgd",
                            device_reserve_fraction=0.0, precisions=("fp32", "fp16"))
    result = plan_tables(tables, topo, settings, time_limit=1.0)
    assert {p.option.precision for p in result.placements.values()} == {"fp32"}
    capacity = Capacity.of(topo, result.settings).device
    assert max(r.memory.device for r in result.ranks()) <= capacity * (1 + 1e-9)


def test_data_parallel_is_offered_on_the_device_tier_only():
    """Training refuses a data-parallel table off the device (every rank would hold a whole replica
    in a store of its own), so the planner does not offer one: a plan it makes always trains."""
    topo = toy_topology(1, 2, device_gb=1.0, host_gb=4.0)
    settings = PlanSettings(batch_size=16, tiers=("device", "cached_dram", "dram"))
    options = enumerate_options(TableSpec("t", 1000, 8, 2.0), topo, settings)
    kinds = {(o.sharding_type, o.tier) for o in options}
    assert (ShardingType.DATA_PARALLEL, "device") in kinds
    assert {tier for kind, tier in kinds if kind == ShardingType.DATA_PARALLEL} == {"device"}
    assert {"cached_dram", "dram"} <= {tier for _, tier in kinds}  # other layouts keep those tiers
    dram_only = plan_tables([TableSpec(f"t{i}", 100, 8, 1.0) for i in range(6)], topo,
                            PlanSettings(batch_size=16, tiers=("dram",)), time_limit=0)
    assert dram_only.plan.check_replicas_on_device() is dram_only.plan

    only_replicas = TableSpec("t", 1000, 8, 2.0, sharding_types=("data_parallel",))
    with pytest.raises(InfeasiblePlanError, match="data_parallel is offered on the device tier only"):
        enumerate_options(only_replicas, topo, PlanSettings(batch_size=16, tiers=("dram",)))


def test_tables_that_are_not_table_specs_are_named_with_how_to_make_them():
    """The README's own TableConfig list failed deep in the enumeration ("'TableConfig' object has
    no attribute 'sharding_types'")."""
    from neorec.embedding import TableConfig

    with pytest.raises(TypeError, match=r"tables must be TableSpec\(name, num_rows, dim, pooling=ids per sample\), got "
                                        r"a TableConfig; for an embedding TableConfig t: TableSpec\(t.name"):
        plan_tables([TableConfig("t", 100, 8)], zionex(1), PlanSettings(batch_size=64))


def test_a_need_that_is_mostly_a_steps_buffers_says_so_and_not_to_add_nodes():
    """24 tables of 100 rows, pooling 50, batch 4096: the need is the double-buffered ids and pooled
    outputs, which grow with the ranks; the message said to add nodes (229% at every size) and
    named only the tables' parameters."""
    tables = [TableSpec(f"t{i}", 100, 64, 50.0, sharding_types=("table_wise", "row_wise", "column_wise"))
              for i in range(24)]
    for nodes in (1, 2):
        topo = Topology("small-gpus", nodes, 2, 64 * 2**20, 1e11, 1e10, 2e10, 0, 0, 1e11, 1e10, 1e13, 2e-5)
        with pytest.raises(InfeasiblePlanError) as error:
            plan_tables(tables, topo, PlanSettings(batch_size=4096), time_limit=0.1)
        message = str(error.value)
        assert re.search(r"no plan fits: the tables need at least [\d.]+ MiB of device memory in all .*\(([\d.]+) MiB "
                         r"of it a step's ids and pooled outputs, which grow with the batch size per rank and the "
                         r"number of ranks: lower the batch size\), and the \d ranks hold", message), message
        assert "add nodes" not in message
    table = TableSpec("one", 100, 64, 50.0, sharding_types=("table_wise",))
    with pytest.raises(InfeasiblePlanError, match=r"table 'one' .* fits no rank .*device memory: needs [\d.]+ MiB per "
                                                  r"rank, a rank has [\d.]+ [KM]iB \([\d.]+ MiB of it a step's ids"):
        plan_tables([table], Topology("g", 1, 2, 2**20, 1e11, 0, 2e10, 0, 0, 1e11, 1e10, 1e13, 2e-5),
                    PlanSettings(batch_size=4096), time_limit=0.1)
