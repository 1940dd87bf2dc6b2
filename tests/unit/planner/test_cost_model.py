"""The cost model: traffic and memory of each sharding type, checked by hand-computed numbers.

    python -m pytest tests/unit/planner/test_cost_model.py -q
"""

import pytest
import torch

from neorec.planner.cost_model import (PlanSettings, TableSpec, allreduce_seconds, alltoall_seconds,
                                       piece_cost)
from neorec.planner.topology import Topology, dgx_h100, get_topology, zionex
from neorec.sharding.plan import ShardingType

from planner_helpers import toy_topology

TABLE = TableSpec("t", num_rows=1000, dim=64, pooling=4.0)


def test_alltoall_splits_intra_and_inter_node_bytes():
    topo = toy_topology(num_nodes=2, ranks_per_node=4, intra=100.0, inter=10.0)
    # 8 ranks: of 800 bytes, 300 go to the 3 node peers, 400 to the other node; the NIC is slower
    assert alltoall_seconds(800.0, topo) == pytest.approx(max(300 / 100, 400 / 10))
    assert alltoall_seconds(800.0, toy_topology(1, 4, intra=100.0)) == pytest.approx(600 / 100)
    assert alltoall_seconds(800.0, toy_topology(1, 1)) == 0.0


def test_allreduce_is_hierarchical():
    topo = toy_topology(num_nodes=4, ranks_per_node=2, intra=100.0, inter=10.0)
    expected = 2 * 1 / 2 * 1000 / 100 + 2 * 3 / 4 * 1000 / (2 * 10)
    assert allreduce_seconds(1000.0, topo) == pytest.approx(expected)


def test_row_wise_pays_full_width_partial_sums_and_column_wise_a_slice():
    topo = toy_topology(1, 4)
    s = PlanSettings(batch_size=100)
    tw, _ = piece_cost(TABLE, ShardingType.TABLE_WISE, 1, "device", "fp32", topo, s)
    rw, _ = piece_cost(TABLE, ShardingType.ROW_WISE, 4, "device", "fp32", topo, s)
    cw, _ = piece_cost(TABLE, ShardingType.COLUMN_WISE, 4, "device", "fp32", topo, s)
    assert rw.output_comm == pytest.approx(tw.output_comm)          # G x 64 partial sums per piece
    assert cw.output_comm == pytest.approx(tw.output_comm / 4)      # G x 16 per piece
    assert rw.lookup_forward == pytest.approx(tw.lookup_forward / 4)  # a quarter of the ids
    assert cw.lookup_forward == pytest.approx(tw.lookup_forward / 4)  # all ids, a quarter of the bytes
    # the bytes: 400 global samples x 4 ids x 64 x 4 bytes read forward
    assert tw.lookup_forward == pytest.approx(400 * 4 * 64 * 4 / topo.device_bandwidth)
    assert tw.gradient_comm == tw.output_comm and tw.allreduce == 0.0


def test_data_parallel_all_reduces_the_table_and_skips_the_alltoall():
    topo = toy_topology(1, 4)
    dp, memory = piece_cost(TABLE, ShardingType.DATA_PARALLEL, 4, "device", "fp32", topo, PlanSettings(batch_size=100))
    assert dp.input_comm == dp.output_comm == dp.gradient_comm == 0.0
    gradient = 1000 * (64 + 1) * 4  # fp32 gradient + a look-up count per row, all-reduced, kept between steps
    assert dp.allreduce == pytest.approx(allreduce_seconds(gradient, topo, latency=False))
    assert memory.device == 1000 * (64 * 4 + 4) + gradient  # the table + row-wise AdaGrad state + the buffer


def test_memory_by_precision_optimizer_and_tier():
    topo = toy_topology(1, 1)
    base = dict(batch_size=1)
    _, fp32 = piece_cost(TABLE, ShardingType.TABLE_WISE, 1, "device", "fp32", topo, PlanSettings(**base, optimizer="sgd"))
    _, fp16 = piece_cost(TABLE, ShardingType.TABLE_WISE, 1, "device", "fp16", topo, PlanSettings(**base, optimizer="sgd"))
    buffers = 2 * (4 * 8 + 1 * 8 + 64 * 4)  # ids + lengths and one pooled row, double-buffered
    assert fp32.device == 1000 * 64 * 4 + buffers
    assert fp16.device == 1000 * 64 * 2 + buffers
    _, ada = piece_cost(TABLE, ShardingType.TABLE_WISE, 1, "device", "fp32", topo, PlanSettings(**base, optimizer="adagrad"))
    assert ada.device == 1000 * 64 * 8 + buffers
    _, dram = piece_cost(TABLE, ShardingType.TABLE_WISE, 1, "dram", "fp16", topo, PlanSettings(**base))
    assert dram.host == 1000 * (64 * 2 + 4) and dram.device == buffers
    _, cached = piece_cost(TABLE, ShardingType.TABLE_WISE, 1, "cached_dram", "fp16", topo,
                           PlanSettings(**base, cache_fraction=0.1))
    # 100 rows of cache in whole sets of 32 ways: 128 slots, each with 33 bytes of metadata
    assert cached.host == 1000 * (64 * 2 + 4) and cached.device == 128 * (64 * 4 + 4 + 33) + buffers


@pytest.mark.parametrize("dim, precision, policy, optimizer, fraction", [
    (4, "fp32", "lru", "rowwise_adagrad", 0.1), (64, "fp16", "lfu", "adam", 0.1), (7, "fp16", "lru", "sgd", 0.37),
    (5, "int8", "lfu", "rowwise_adagrad", 0.02), (16, "bf16", "lru", "adagrad", 1.0)])
def test_cached_tier_memory_is_what_training_allocates(dim, precision, policy, optimizer, fraction):
    """The planner counted int(fraction x rows) cache slots of rows and state alone; training makes
    ceil(fraction x rows) rounded up to whole sets and keeps 33 bytes of metadata per slot (2.65x
    the count for a 100k x 4 table), and its store records are padded to 4 bytes, with an int8
    row's scale and bias and an LFU count (int8 stores could not be planned at all)."""
    from neorec.embedding import SparseOptimizerConfig, TableConfig
    from neorec.embedding.cached import CachedEmbeddingBagCollection
    from neorec.embedding.locations import TableLocation

    rows = 1000
    table = TableSpec("t", rows, dim)
    settings = PlanSettings(batch_size=1, optimizer=optimizer, cache_fraction=fraction, cache_policy=policy,
                            cache_ways=8)
    _, planned = piece_cost(table, ShardingType.TABLE_WISE, 1, "cached_dram", precision, toy_topology(1, 1), settings)
    location = TableLocation("cached_dram", cache_fraction=fraction, ways=8, policy=policy, precision=precision)
    collection = CachedEmbeddingBagCollection([TableConfig("t", rows, dim)], SparseOptimizerConfig(optimizer),
                                              locations={"t": location})
    cache = collection.caches["t"]
    slots = cache.weights.numel() * 4 + sum(v.numel() * v.element_size() for v in cache.state.values())
    metadata = sum(t.numel() * t.element_size() for t in (cache.slot_rows, cache.last_use, cache.counts,
                                                          cache.dirty, cache.pinned_until))
    buffers = 2 * (1 * 8 + 1 * 8 + dim * 4)
    assert planned.device == slots + metadata + buffers
    assert planned.host == cache.store.records.numel()  # the store's bytes, record for record
    collection.close()


@pytest.mark.filterwarnings("ignore:cache of table .* growing it:RuntimeWarning")
def test_a_cache_is_planned_at_the_size_a_batch_grows_it_to():
    """The planner counted a cache at cache_fraction of the rows; a batch needing more distinct
    rows grows it in training (1.25 x those rows), so device memory ran past the plan (tiny.toml's
    tables: 128 slots planned, 448 in training). Uniform ids: the planned size is what one batch
    grows the cache to."""
    from neorec.embedding import SparseOptimizerConfig, TableConfig
    from neorec.embedding.cached import CachedEmbeddingBagCollection
    from neorec.embedding.locations import TableLocation
    from neorec.sparse import KeyedJaggedTensor

    rows, dim, batch, pooling = 2000, 8, 256, 4
    settings = PlanSettings(batch_size=batch, optimizer="sgd", cache_fraction=0.05, cache_ways=8)
    _, planned = piece_cost(TableSpec("t", rows, dim, pooling=pooling), ShardingType.TABLE_WISE, 1, "cached_dram",
                            "fp32", toy_topology(1, 1), settings)
    per_slot = dim * 4 + 33
    buffers = 2 * ((batch * pooling + batch) * 8 + batch * dim * 4)
    planned_slots = (planned.device - buffers) / per_slot
    assert planned_slots == 1008  # 2000 x (1 - (1 - 1/2000)^1024) = 801 distinct rows, x 1.25, whole sets
    collection = CachedEmbeddingBagCollection([TableConfig("t", rows, dim)], SparseOptimizerConfig("sgd", 0.1),
                                              locations={"t": TableLocation("cached_dram", cache_fraction=0.05, ways=8)})
    assert collection.caches["t"].num_slots == 104  # what the planner used to count
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, rows, (batch * pooling,), generator=generator)
    collection(KeyedJaggedTensor(["t"], ids, torch.full((batch,), pooling))).values.sum().backward()
    grown = collection.caches["t"].num_slots
    assert abs(grown - planned_slots) <= 0.05 * planned_slots, (grown, planned_slots)
    collection.close()


def test_slower_tiers_cost_more():
    topo = zionex(1)
    s = PlanSettings(batch_size=512)
    times = [piece_cost(TABLE, ShardingType.TABLE_WISE, 1, tier, "fp32", topo, s)[0].compute
             for tier in ("device", "cached_dram", "dram")]
    assert times[0] < times[1] < times[2]


def test_topology_presets_and_json(tmp_path, monkeypatch):
    z = get_topology("zionex")
    assert (z.num_nodes, z.ranks_per_node, z.world_size) == (16, 8, 128)
    assert z.inter_node_bandwidth == 25e9 and z.device_bandwidth == 1555e9
    assert dgx_h100().device_bandwidth == 3350e9
    path = tmp_path / "topo.json"
    z.with_nodes(2).save(path)
    assert Topology.load(path) == z.with_nodes(2)
    assert get_topology(str(path)).world_size == 16
    with pytest.raises(ValueError, match="unknown topology 'nope'"):
        get_topology("nope")
    monkeypatch.setenv("NEOREC_CALIBRATION", str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="not calibrated yet.*neorec plan --calibrate"):
        get_topology("local-cpu")
    monkeypatch.setenv("NEOREC_CALIBRATION", str(path))
    assert get_topology("local-cpu").world_size == 16
    with pytest.raises(ValueError, match="device_bandwidth must be > 0"):
        Topology("bad", 1, 1, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0)


def test_bad_specs_and_settings_are_rejected():
    with pytest.raises(ValueError, match="table 'x': num_rows"):
        TableSpec("x", 0, 4)
    with pytest.raises(ValueError, match="tiers"):
        TableSpec("x", 10, 4, tiers=("hbm",))
    with pytest.raises(ValueError, match="optimizer must be one of"):
        PlanSettings(optimizer="lamb")
    with pytest.raises(ValueError, match="precisions"):
        PlanSettings(precisions=("int4",))


def test_bytes_agree_with_the_collectives_byte_counts_of_bench_sharding():
    """At 1 B/s per link the seconds are bytes: the model's traffic for bench_sharding's reference
    job on 2 ranks equals what CommStats counted at the collectives (benchmarks/RESULTS.md,
    Sharding: MB per step)."""
    tables = [TableSpec(f"t{i}", r, 16, 2.0) for i, r in enumerate([100000, 50000, 20000, 10000, 5000, 2000, 1000, 100])]
    topo = Topology("unit", 1, 2, 1e12, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0)
    settings = PlanSettings(batch_size=1024)
    measured_mb = {  # kind: (input ids + lengths, output, replica all-reduce), summed over ranks
        ShardingType.TABLE_WISE: (0.197, 0.524, 0.0), ShardingType.ROW_WISE: (0.263, 1.049, 0.0),
        ShardingType.COLUMN_WISE: (0.394, 0.524, 0.0), ShardingType.DATA_PARALLEL: (0.0, 0.0, 25.582)}
    for kind, expected in measured_mb.items():
        pieces = 1 if kind == ShardingType.TABLE_WISE else 2
        totals = [0.0, 0.0, 0.0]
        for t in tables:
            cost, _ = piece_cost(t, kind, pieces, "device", "fp32", topo, settings)
            totals[0] += cost.input_comm * pieces
            totals[1] += cost.output_comm * pieces
            totals[2] += cost.allreduce * pieces
        assert [round(v / 1e6, 3) for v in totals] == pytest.approx(list(expected), abs=0.0015), kind


def test_calibrated_per_id_cost_is_added_to_the_backward():
    import dataclasses

    topo = toy_topology(1, 2)
    slow = dataclasses.replace(topo, seconds_per_id=1e-6)
    s = PlanSettings(batch_size=100)
    base, _ = piece_cost(TABLE, ShardingType.ROW_WISE, 2, "device", "fp32", topo, s)
    more, _ = piece_cost(TABLE, ShardingType.ROW_WISE, 2, "device", "fp32", slow, s)
    ids = 200 * 4.0 / 2  # global batch x pooling / pieces
    assert more.lookup_backward - base.lookup_backward == pytest.approx(ids * 1e-6)
    assert more.lookup_forward == base.lookup_forward


@pytest.mark.parametrize("kwargs, message", [
    ({"pooling": float("inf")}, r"pooling must be a number in \(0, 1,000,000\] ids per sample, got inf"),
    ({"pooling": float("nan")}, "pooling must be a number in"),
    ({"pooling": True}, "pooling must be a number in"),
    # beyond a million ids per sample the costs overflowed: an OverflowError, or NaN in the report
    ({"pooling": 1e180}, "pooling must be a number in"),
    ({"num_rows": True}, r"num_rows must be an integer in \[1, 9,223,372,036,854,775,807\], got True"),
    ({"num_rows": 10 ** 400}, "num_rows must be an integer in"),
    ({"dim": True}, r"dim must be an integer in \[1, 65,536\], got True"),
    ({"tiers": "device"}, "tiers must be a list of names, got the string 'device'"),
])
def test_non_finite_bool_and_string_table_fields_are_rejected(kwargs, message):
    fields = {"name": "x", "num_rows": 10, "dim": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        TableSpec(**fields)


@pytest.mark.parametrize("key, value", [("inter_node_bandwidth", float("nan")), ("device_memory_bytes", float("nan")),
                                        ("inter_node_bandwidth", float("inf")), ("ssd_bytes", float("inf"))])
def test_non_finite_topology_values_are_rejected(tmp_path, key, value):
    import dataclasses
    import json

    with pytest.raises(ValueError, match=f"{key} must be a finite number"):
        dataclasses.replace(dgx_h100(), **{key: value})
    path = tmp_path / "topo.json"   # JSON files may spell NaN / Infinity
    path.write_text(json.dumps({**dgx_h100().to_dict(), key: value}))
    with pytest.raises(ValueError, match=f"{key} must be a finite number"):
        get_topology(str(path))


def test_batch_size_and_dense_model_are_checked():
    from neorec.planner.presets import DenseModel

    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        PlanSettings(batch_size=True)
    for kwargs in ({"mflops_per_sample": -1.0}, {"num_parameters": -5}, {"mflops_per_sample": float("inf")},
                   {"num_parameters": None}):
        with pytest.raises(ValueError, match="dense model: .* must be a finite number >= 0"):
            DenseModel(**kwargs)


def test_data_parallel_memory_is_what_training_holds():
    """Training keeps an fp32 gradient (+ one count per row) of every replica table between steps;
    the planner counted the table and its state only, half of what a rank holds."""
    import torch

    from neorec.embedding.config import SparseOptimizerConfig, TableConfig
    from neorec.embedding.tbe import TableBatchedEmbeddingBags
    from neorec.sparse.jagged import KeyedJaggedTensor

    rows, dim = 5000, 16
    _, memory = piece_cost(TableSpec("t", rows, dim), ShardingType.DATA_PARALLEL, 2, "device", "fp32",
                           toy_topology(1, 2), PlanSettings(batch_size=8))
    tbe = TableBatchedEmbeddingBags([TableConfig("t", rows, dim)], SparseOptimizerConfig(kind="rowwise_adagrad"),
                                    dense_gradient_tables=["t"], gradient_reducer=lambda grad: None)
    kjt = KeyedJaggedTensor(tbe.feature_names, torch.randint(0, rows, (8,)), torch.ones(8, dtype=torch.long))
    tbe(kjt).values.sum().backward()
    held = sum(b.numel() * b.element_size() for b in tbe.buffers()) + tbe._replicas.grad.numel() * 4
    assert memory.device == pytest.approx(held, rel=1e-3)


def test_collective_latency_is_paid_once_per_step_not_once_per_table():
    """Every table shares one input, one output and one gradient all-to-all (and one replica
    all-reduce): 26 tables were charged 26 latencies each way, 10x the cost of one table with
    the same bytes, which pushed plans toward fewer pieces."""
    import dataclasses

    from neorec.planner.planner import evaluate_plan
    from neorec.sharding.plan import ShardingPlan, TablePlan, Shard

    tables = [TableSpec(f"t{i}", 100, 8, 1.0) for i in range(26)]
    fast = toy_topology(1, 2)
    slow = dataclasses.replace(fast, collective_latency=1e-3)
    settings = PlanSettings(batch_size=64)
    table_wise = ShardingPlan({t.name: TablePlan(ShardingType.TABLE_WISE, [Shard(i % 2, 0, 100, 0, 8)])
                               for i, t in enumerate(tables)}, 2)
    replicated = ShardingPlan({t.name: TablePlan(ShardingType.DATA_PARALLEL, []) for t in tables}, 2)
    for plan, expected in ((table_wise, (1e-3, 1e-3, 1e-3, 0.0)), (replicated, (0.0, 0.0, 0.0, 1e-3))):
        base, more = (evaluate_plan(plan, tables, topo, settings) for topo in (fast, slow))
        for a, b in zip(base.ranks(), more.ranks()):
            extra = [getattr(b.cost, k) - getattr(a.cost, k)
                     for k in ("input_comm", "output_comm", "gradient_comm", "allreduce")]
            assert extra == pytest.approx(list(expected))
        assert more.makespan - base.makespan == pytest.approx(sum(expected))


def test_int8_communication_carries_each_rows_min_and_step():
    topo = Topology("unit", 1, 2, 1e12, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0)  # 1 B/s: seconds are bytes
    int8, _ = piece_cost(TABLE, ShardingType.TABLE_WISE, 1, "device", "fp32", topo, PlanSettings(batch_size=10,
                                                                                                    comm_bytes=1))
    assert int8.output_comm == pytest.approx(20 * (64 + 8) / 2)  # 20 global rows of 64 bytes + 8, half leave


def test_calibration_timings_leave_out_what_runs_before_each_call(monkeypatch):
    """The calibrated collective latency timed a barrier with each all-to-all (about twice the
    all-to-all alone); ``before`` runs untimed ahead of each timed call. A clock of the test's own:
    ``fn`` takes 1 ms of it, ``before`` 50 ms (a real clock made the check depend on the host's load)."""
    import types

    from neorec.planner import calibrate

    now, calls = [0.0], []

    def spend(name, seconds):
        calls.append(name)
        now[0] += seconds

    monkeypatch.setattr(calibrate, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    seconds = calibrate.median_seconds(lambda: spend("fn", 0.001), repeats=3, before=lambda: spend("before", 0.05))
    assert calls == ["fn", "before", "fn", "before", "fn", "before", "fn"]
    assert seconds == pytest.approx(0.001, abs=1e-12)


def test_a_cpu_topology_counts_the_host_tiers_in_the_same_memory():
    """On a CPU the device tier and host DRAM are one memory: a calibration gave tables half of it
    as "device" and the other half as "host DRAM", and plans of both tiers took ~90% of the RAM.
    With unified_memory a host tier's bytes count against the device's."""
    import dataclasses

    from neorec.planner.enumerate import Capacity, InfeasiblePlanError
    from neorec.planner.planner import plan_tables

    split = Topology("cpu", 1, 2, 1e6, 3e9, 2e6, 3e9, 0.0, 0.0, 5e8, 5e8, 5e10, 5e-4)
    cpu = dataclasses.replace(split, unified_memory=1)
    settings = PlanSettings(batch_size=1, tiers=("device", "dram"), optimizer="sgd")
    _, memory = piece_cost(TABLE, ShardingType.TABLE_WISE, 1, "dram", "fp32", cpu, settings)
    _, apart = piece_cost(TABLE, ShardingType.TABLE_WISE, 1, "dram", "fp32", split, settings)
    assert memory.host == 0 and memory.device == apart.device + apart.host
    assert Capacity.of(cpu, settings).host == 0 and Capacity.of(split, settings).host == 1e6
    tables = [TableSpec(f"t{i}", 2000, 64) for i in range(6)]  # 512 KB each at fp32: 3 MB, 2 MB of "device"
    assert plan_tables(tables, split, settings, time_limit=0).plan is not None  # counted twice: fits
    with pytest.raises(InfeasiblePlanError, match=r"no plan fits: the tables need at least 2.94 MiB of device memory in all .* \(181%\)"):
        plan_tables(tables, cpu, settings, time_limit=0)
    with pytest.raises(ValueError, match="unified_memory must be 0 or 1"):
        dataclasses.replace(split, unified_memory=2)


def test_a_cache_a_step_fits_in_is_planned_at_its_own_size():
    """Growth counted for a cache that never grows: a step's 877 distinct rows fit its 1,008 slots,
    but the planner charged 1.25 x 877 rounded up (1,088 slots)."""
    from neorec.planner.cost_model import training_cache_slots

    assert training_cache_slots(10_000, 900, 1008, 16) == 1008  # ~861 distinct rows: no growth
    assert training_cache_slots(10_000, 5000, 1008, 16) == 4928  # ~3,935: grown to 1.25 x, whole sets
    assert training_cache_slots(100, 10**6, 16, 8) == 104  # at most the piece (in whole sets)
