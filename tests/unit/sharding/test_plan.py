"""ShardingPlan: JSON round trip, validation errors (naming the table and the problem), builders,
default_plan; the static routing. No process group.

    python -m pytest tests/unit/sharding -q
"""

from __future__ import annotations

import json

import pytest
import torch

from neorec.embedding import TableConfig
from neorec.sharding import (
    Shard,
    ShardingPlan,
    ShardingType,
    TablePlan,
    column_wise,
    data_parallel,
    default_plan,
    row_wise,
    table_wise,
)
from neorec.sharding.input_dist import _permute_blocks
from neorec.sharding.routing import Routing

TABLES = [
    TableConfig("a", 10, 4, ["fa1", "fa2"]),
    TableConfig("b", 6, 8, ["fb"], pooling="mean"),
    TableConfig("c", 3, 2, ["fc"]),
]


def good_plan(world: int = 4) -> ShardingPlan:
    return ShardingPlan({
        "a": row_wise(TABLES[0], [0, 1], node_local=True),
        "b": column_wise(TABLES[1], [3, 2, 1]),
        "c": data_parallel(),
    }, world, ranks_per_node=2)


def test_json_round_trip_and_file(tmp_path):
    plan = good_plan()
    again = ShardingPlan.from_json(plan.to_json())
    assert again == plan
    assert json.loads(plan.to_json())["tables"]["a"]["sharding_type"] == "table_row_wise"
    path = tmp_path / "plan.json"
    plan.save(path)
    assert ShardingPlan.load(path) == plan
    assert plan.validate(TABLES, 4) is plan


def test_builders():
    assert table_wise(TABLES[0], 2).shards == [Shard(2, 0, 10, 0, 4)]
    assert [(s.row_start, s.row_end) for s in row_wise(TABLES[0], [0, 1, 2]).shards] == [(0, 3), (3, 6), (6, 10)]
    assert [(s.col_start, s.col_end) for s in column_wise(TABLES[1], [0, 1], widths=[2, 6]).shards] == [(0, 2), (2, 8)]
    with pytest.raises(ValueError, match="widths"):
        column_wise(TABLES[1], [0, 1], widths=[4, 5])
    with pytest.raises(ValueError, match="cannot split 3 into 4"):
        row_wise(TABLES[2], [0, 1, 2, 3])


def replace(plan: ShardingPlan, name: str, entry: TablePlan) -> ShardingPlan:
    tables = dict(plan.tables)
    tables[name] = entry
    return ShardingPlan(tables, plan.world_size, plan.ranks_per_node)


RW = ShardingType.ROW_WISE
CW = ShardingType.COLUMN_WISE
BAD = [
    ("missing table", lambda p: ShardingPlan({k: v for k, v in p.tables.items() if k != "b"}, 4, 2),
     r"tables \['b'\] are not covered"),
    ("unknown table", lambda p: replace(p, "zz", data_parallel()), r"unknown tables \['zz'\]"),
    ("world mismatch", lambda p: ShardingPlan(p.tables, 2, 2), "written for world_size 2"),
    ("rank outside", lambda p: replace(p, "c", table_wise(TABLES[2], 4)), r"table 'c' \(table_wise\).*rank 4, outside"),
    ("overlap", lambda p: replace(p, "a", TablePlan(RW, [Shard(0, 0, 6, 0, 4), Shard(1, 5, 10, 0, 4)])),
     r"table 'a' \(row_wise\): row ranges overlap at row 5"),
    ("gap", lambda p: replace(p, "a", TablePlan(RW, [Shard(0, 0, 4, 0, 4), Shard(1, 5, 10, 0, 4)])),
     r"table 'a' \(row_wise\): rows \[4, 5\) are in no shard"),
    ("short", lambda p: replace(p, "a", TablePlan(RW, [Shard(0, 0, 4, 0, 4)])), r"rows \[4, 10\) are in no shard"),
    ("rw partial columns", lambda p: replace(p, "a", TablePlan(RW, [Shard(0, 0, 10, 0, 2)])),
     "must span all 4 columns"),
    ("cw gap", lambda p: replace(p, "b", TablePlan(CW, [Shard(0, 0, 6, 0, 3), Shard(1, 0, 6, 4, 8)])),
     r"table 'b' \(column_wise\): columns \[3, 4\) are in no shard"),
    ("cw partial rows", lambda p: replace(p, "b", TablePlan(CW, [Shard(0, 0, 5, 0, 8)])), "must span all 6 rows"),
    ("tw two shards", lambda p: replace(p, "c", TablePlan("table_wise", [Shard(0, 0, 3, 0, 2), Shard(1, 0, 3, 0, 2)])),
     "exactly one shard"),
    ("tw partial", lambda p: replace(p, "c", TablePlan("table_wise", [Shard(0, 0, 2, 0, 2)])), "exactly one shard"),
    ("twrw across nodes", lambda p: replace(p, "a", row_wise(TABLES[0], [1, 2], node_local=True)),
     r"table 'a' \(table_row_wise\): shards span nodes \[0, 1\]"),
    ("twcw across nodes", lambda p: replace(p, "b", column_wise(TABLES[1], [0, 3], node_local=True)),
     "shards span nodes"),
    ("dp partial", lambda p: replace(p, "c", TablePlan("data_parallel", [Shard(0, 0, 3, 0, 2)])),
     "one full-table shard on every rank"),
    ("empty shard", lambda p: replace(p, "c", TablePlan("table_wise", [Shard(0, 0, 0, 0, 2)])), "empty or outside"),
    ("outside rows", lambda p: replace(p, "c", TablePlan("table_wise", [Shard(0, 0, 4, 0, 2)])), "empty or outside"),
    ("no shards", lambda p: replace(p, "c", TablePlan("row_wise", [])), "has no shards"),
    ("precision", lambda p: replace(p, "c", TablePlan("data_parallel", [], precision="int3")), "precision must be"),
    ("ranks per node", lambda p: ShardingPlan(p.tables, 4, 3), "ranks_per_node must be >= 1 and divide"),
]


@pytest.mark.parametrize("name,mutate,message", BAD, ids=[b[0] for b in BAD])
def test_validation_errors(name, mutate, message):
    with pytest.raises(ValueError, match=message):
        mutate(good_plan()).validate(TABLES, 4)


def test_json_errors(tmp_path):
    with pytest.raises(ValueError, match="not valid JSON"):
        ShardingPlan.from_json("{")
    with pytest.raises(ValueError, match="unknown sharding type 'diagonal'"):
        ShardingPlan.from_dict({"world_size": 1, "tables": {"a": {"sharding_type": "diagonal"}}})
    with pytest.raises(ValueError, match="exactly the keys"):
        ShardingPlan.from_dict({"world_size": 1, "tables": {"a": {"sharding_type": "table_wise", "shards": [{"rank": 0}]}}})
    with pytest.raises(ValueError, match="unknown keys"):
        ShardingPlan.from_dict({"world_size": 1, "tables": {}, "extra": 1})
    with pytest.raises(ValueError, match="not found"):
        ShardingPlan.load(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text('{"world_size": "two", "tables": {}}')
    with pytest.raises(ValueError, match=r"world_size must be an integer.*bad.json"):
        ShardingPlan.load(tmp_path / "bad.json")


def test_default_plan_balances_and_validates():
    tables = [TableConfig(f"t{i}", rows, 8) for i, rows in enumerate([500, 1000, 2000, 300])]
    plan = default_plan(tables, 2)
    plan.validate(tables, 2)
    assert plan.tables["t2"].sharding_type == ShardingType.ROW_WISE  # bigger than an even share
    assert {plan.tables[f"t{i}"].sharding_type for i in (0, 1, 3)} == {ShardingType.TABLE_WISE}
    loads = [0, 0]
    for entry in plan.tables.values():
        for s in entry.shards:
            loads[s.rank] += s.num_rows * s.num_cols
    assert abs(loads[0] - loads[1]) <= 500 * 8
    single = default_plan(tables, 1)
    assert all(e.shards[0].rank == 0 and e.sharding_type == ShardingType.TABLE_WISE for e in single.tables.values())
    tiny = [TableConfig("x", 2, 4)]
    assert [s.rank for s in default_plan(tiny, 4, row_wise_factor=0.1).tables["x"].shards] == [0, 1]


def test_routing_columns_and_keys():
    routing = Routing(TABLES, good_plan(), 4)
    assert routing.feature_names == ["fa1", "fa2", "fb", "fc"]
    assert routing.keys_on[0] == ["fa1@0", "fa2@0"] and routing.keys_on[3] == ["fb@0"]
    assert routing.dims_on == [8, 8 + 3, 3, 2]
    assert routing.replica_features == ["fc"] and routing.replica_dim == 2
    assert routing.additive and routing.has_mean
    assert len(routing.columns) == sum(routing.dims_on) + 2
    assert [t.name for t in routing.local_tables(1)] == ["a@1", "b@2", "c"]


def test_permute_blocks():
    # blocks ordered (source, key): s0k0=[1], s0k1=[2,3], s1k0=[4,5], s1k1=[]
    values = torch.tensor([1, 2, 3, 4, 5])
    out = _permute_blocks(values, torch.tensor([[1, 2], [2, 0]]))
    assert out.tolist() == [1, 4, 5, 2, 3]


@pytest.mark.parametrize("sliced", [True, False])
def test_permute_blocks_matches_a_python_reference(monkeypatch, sliced):
    # both ways of permuting (slices + cat for few blocks, a computed gather for many)
    import neorec.sharding.input_dist as input_dist

    monkeypatch.setattr(input_dist, "_MAX_SLICED_BLOCKS", 1024 if sliced else 0)
    generator = torch.Generator().manual_seed(3)
    block_lengths = torch.randint(0, 5, (3, 4), generator=generator)
    values = torch.randint(0, 100, (int(block_lengths.sum()),), generator=generator)
    flat = values.tolist()
    blocks, start = {}, 0
    for s in range(3):
        for k in range(4):
            n = int(block_lengths[s, k])
            blocks[s, k], start = flat[start : start + n], start + n
    expected = [v for k in range(4) for s in range(3) for v in blocks[s, k]]
    assert _permute_blocks(values, block_lengths).tolist() == expected


def test_example_plan_fits_the_tiny_config():
    from pathlib import Path

    from neorec.config import load_config
    from neorec.data import make_data_source

    root = Path(__file__).resolve().parents[3]
    cfg = load_config(root / "configs" / "tiny.toml")
    tables = make_data_source(cfg.data).tables(cfg.model.embedding_dim, cfg.model.pooling)
    plan = ShardingPlan.load(root / "configs" / "tiny_plan_2ranks.json").validate(tables, 2)
    assert {e.sharding_type for e in plan.tables.values()} == {
        ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE, ShardingType.ROW_WISE, ShardingType.DATA_PARALLEL}


def test_tier_is_kept_in_the_file_and_validated(tmp_path):
    from neorec.planner.names import TIERS

    plan = replace(good_plan(), "c", TablePlan("data_parallel", [], precision="fp16", tier="dram"))
    assert json.loads(plan.to_json())["tables"]["c"]["tier"] == "dram"
    assert "tier" not in json.loads(plan.to_json())["tables"]["a"]   # device: written as before
    path = tmp_path / "plan.json"
    plan.save(path)
    assert ShardingPlan.load(path) == plan and ShardingPlan.load(path).tables["c"].tier == "dram"
    assert ShardingPlan.from_json(good_plan().to_json()).tables["a"].tier == "device"  # old files: device
    assert plan.validate(TABLES, 4) is plan and plan.validate(TABLES, 4, tiers=TIERS) is plan  # training places all
    with pytest.raises(ValueError, match=r"'c' \(dram\).*cannot place.*neorec plan --tiers device"):
        plan.validate(TABLES, 4, tiers=("device",))
    assert plan.tiers_off_device() == {"c": "dram"}
    with pytest.raises(ValueError, match=r"data-parallel tables 'c' \(dram\) are planned off the device"):
        plan.check_replicas_on_device()  # what the launcher checks
    with pytest.raises(ValueError, match=r"\(table 'c'\): tier must be one of"):
        ShardingPlan.from_dict({"world_size": 1, "tables": {"c": {"sharding_type": "data_parallel", "tier": "hbm"}}})


def test_load_refuses_deep_json_and_directories_clearly(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match=r"nested too deeply.*deep.json"):
        ShardingPlan.load(deep)
    with pytest.raises(ValueError, match="is a directory; give the plan's JSON file"):
        ShardingPlan.load(tmp_path)


@pytest.mark.parametrize("feature, table", [("fa2", "a"), ("fc", "c")])
def test_ids_of_every_feature_are_checked_before_the_exchange_is_launched(feature, table, monkeypatch):
    """Data-parallel (replica) features were checked only at their local lookup, a step later than
    the pipeline's docstring says: now every feature's ids are checked before anything is sent."""
    import neorec.sharding.input_dist as input_dist_module
    from neorec.sparse import KeyedJaggedTensor

    def no_exchange(*args, **kwargs):
        raise AssertionError("an exchange was launched")

    monkeypatch.setattr(input_dist_module, "all_to_all", no_exchange)
    routing = Routing(TABLES, good_plan(), 4)
    keys = ["fa1", "fa2", "fb", "fc"]
    values = {"fa1": 1, "fa2": 2, "fb": 3, "fc": 1}
    values[feature] = 99
    kjt = KeyedJaggedTensor(keys, torch.tensor([values[k] for k in keys]), torch.ones(4, dtype=torch.int64))
    with pytest.raises(ValueError, match=rf"feature '{feature}' \(table '{table}'\): id 99 is outside"):
        input_dist_module.input_dist(routing, 0, kjt, None)


def test_weights_that_require_grad_are_refused_before_the_exchange(monkeypatch):
    """The sharded lookup sent them through the all-to-all, which detached them: the tables
    trained and their gradient silently stayed None (the unsharded lookup refuses them)."""
    import neorec.sharding.input_dist as input_dist_module
    from neorec.sparse import KeyedJaggedTensor

    def no_exchange(*args, **kwargs):
        raise AssertionError("an exchange was launched")

    monkeypatch.setattr(input_dist_module, "all_to_all", no_exchange)
    keys = ["fa1", "fa2", "fb", "fc"]
    kjt = KeyedJaggedTensor(keys, torch.tensor([1, 2, 3, 1]), torch.ones(4, dtype=torch.int64),
                            weights=torch.ones(4, requires_grad=True))
    with pytest.raises(ValueError, match="weights require grad, but the fused embedding lookup does not"):
        input_dist_module.input_dist(Routing(TABLES, good_plan(), 4), 0, kjt, None)
    with torch.no_grad(), pytest.raises(AssertionError, match="an exchange was launched"):  # (evaluation: allowed)
        input_dist_module.input_dist(Routing(TABLES, good_plan(), 4), 0, kjt, None)


def test_a_cached_tier_takes_the_plans_precision_into_its_store():
    """`neorec plan --tiers cached_dram --precisions fp16` wrote tables (cached_dram, fp16) that no
    setting could train: the plan's fp16 was compared with the fused module's precision (fp32, which
    cached tables need), and fp16 storage refused the cached tables."""
    from neorec.config import load_config
    from neorec.train.build import plan_locations

    plan = replace(replace(good_plan(), "a", TablePlan("row_wise", good_plan().tables["a"].shards, precision="fp16",
                                                         tier="cached_dram")),
                   "b", TablePlan("column_wise", good_plan().tables["b"].shards, precision="fp16", tier="dram"))
    with pytest.raises(ValueError, match=r"table 'a' is on a cached tier, whose fp32 cache slots sit in the fused "
                                         r"module, and its tables off the caches ask for fp16 \('b'\)"):
        plan.check_precision("fp32")  # dram: the host module's, at the one precision of a rank's modules
    plan = replace(plan, "b", TablePlan("column_wise", good_plan().tables["b"].shards, tier="dram"))
    assert plan.check_precision("fp32") is plan  # a's fp16 is its store's
    cfg = load_config(None, ["embedding.location.precision='int8'"])
    locations = plan_locations(cfg, TABLES, plan)
    assert (locations["a"].kind, locations["a"].precision) == ("cached_dram", "fp16")
    assert (locations["b"].kind, locations["b"].precision) == ("dram", "int8")  # the config's (unused by dram)
    assert locations["c"].kind == "device"


def test_a_plan_with_ranks_of_dram_pieces_only_is_said_unfit_for_gpus(monkeypatch):
    """On a GPU such a rank's fused module holds no table: every rank was refused after launch
    (CachedEmbeddingBagCollection's "every table ... is placed in "dram""); the launcher says it."""
    import argparse

    from neorec.config import load_config
    from neorec.train import cli as train_cli

    rows = [500, 1000, 2000, 300]  # configs/tiny.toml's tables, dim 8
    dram = ShardingPlan({f"t_feature_{i}": TablePlan(ShardingType.TABLE_WISE, [Shard(i % 2, 0, n, 0, 8)], tier="dram")
                         for i, n in enumerate(rows)}, 2)
    assert dram.gpu_training_problem().startswith('rank(s) 0, 1 hold only "dram" (host memory) pieces')
    mixed = ShardingPlan({**dram.tables, "t_feature_3": TablePlan(ShardingType.TABLE_WISE, [Shard(1, 0, 300, 0, 8)])}, 2)
    assert mixed.gpu_training_problem().startswith('rank(s) 0 hold only "dram"')  # rank 1 has a device table
    replica = ShardingPlan({**dram.tables, "t_feature_3": TablePlan(ShardingType.DATA_PARALLEL, [])}, 2)
    assert replica.gpu_training_problem() is None  # every rank holds the replica on its device
    cfg = load_config("configs/tiny.toml")
    args = argparse.Namespace(resume=None, nproc=2, plan="dram.json")
    cfg.train.device = "cuda"
    monkeypatch.setattr(train_cli, "check_gpus_for_ranks", lambda device, nproc: None)  # (no GPU here)
    with pytest.raises(ValueError, match=r'sharding plan dram.json on GPUs: rank\(s\) 0, 1 hold only "dram"'):
        train_cli._check_before_launch(cfg, dram, args)
    # a plan of device tiers whose rank 1 holds only tables the config puts in "dram" (the config's
    # location applies where the plan says "device")
    on_device = ShardingPlan({name: TablePlan(entry.sharding_type, entry.shards) for name, entry in dram.tables.items()}, 2)
    assert on_device.gpu_training_problem() is None
    cfg.embedding.location.tables = {"t_feature_1": "dram", "t_feature_3": "dram"}
    with pytest.raises(ValueError, match=r'sharding plan dram.json on GPUs: rank\(s\) 1 hold only "dram"'):
        train_cli._check_before_launch(cfg, on_device, args)
    cfg.train.device = "cpu"
    train_cli._check_before_launch(cfg, dram, args)  # host memory is the device: nothing to refuse
