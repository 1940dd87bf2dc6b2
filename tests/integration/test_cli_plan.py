"""`neorec plan` end to end, and `neorec train --plan auto`'s planning step.

    python -m pytest tests/integration/test_cli_plan.py -q
"""

import dataclasses
import json
import re
from pathlib import Path

import pytest

from neorec.cli import main
from neorec.config import load_config
from neorec.data import make_data_source
from neorec.embedding.config import TableConfig
from neorec.planner.cli import plan_for_training
from neorec.planner.presets import CRITEO_KAGGLE_ROWS
from neorec.sharding import ShardingPlan

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.toml"


def test_plan_preset_writes_plan_report_and_chart(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out, report, chart = tmp_path / "plan.json", tmp_path / "report.json", tmp_path / "load.png"
    rc = main(["plan", "--model", "dlrm-criteo-kaggle", "--topology", "zionex", "--nodes", "1", "--time-limit", "1",
               "--out", str(out), "--report", str(report), "--chart", str(chart)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "predicted iteration" in text and "QPS" in text and "gap" in text and "device GiB" in text
    assert " million parameters) on zionex" in text  # was "M parameters"; "B" read as bytes
    plan = ShardingPlan.load(out)
    plan.validate([TableConfig(f"t_cat_{i}", r, 16) for i, r in enumerate(CRITEO_KAGGLE_ROWS)], 8)
    data = json.loads(report.read_text())
    assert len(data["ranks"]) == 8 and data["simulation"]["qps"] > 0 and data["gap"] >= 0
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert chart.stat().st_mode & 0o777 == out.stat().st_mode & 0o777  # was 0600 (mkstemp), the others 0644


def test_plan_table_file_errors_name_the_table(tmp_path, capsys):
    spec = tmp_path / "tables.json"
    spec.write_text(json.dumps({"tables": [{"name": "small", "num_rows": 100, "dim": 8},
                                           {"name": "enormous", "num_rows": 10 ** 13, "dim": 128}]}))
    rc = main(["plan", "--tables", str(spec), "--topology", "zionex", "--nodes", "1"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "table 'enormous'" in err and "tightest limit" in err and "Traceback" not in err
    spec.write_text(json.dumps({"tables": [{"name": "x", "num_rows": 10, "dims": 8}]}))
    assert main(["plan", "--tables", str(spec)]) == 2
    assert "unknown keys ['dims']" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--time-limit", "-1"], "--time-limit must be >= 0"),
    (["--scale-model"], "--scale-model only changes the --scaling study"),
    (["--out", "{tmp}"], "--out .* is a directory; give a file name"),
])
def test_plan_argument_mistakes_are_caught_before_the_search(tmp_path, capsys, monkeypatch, args, message):
    import neorec.planner.planner as planner

    def no_search(*a, **k):
        raise AssertionError("searched before checking the arguments")

    monkeypatch.setattr(planner, "plan_tables", no_search)
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    assert main(["plan", "--model", "dlrm-criteo-kaggle", "--nodes", "1", *args]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_plan_counts_small_models_in_plain_numbers(tmp_path, capsys):
    spec = tmp_path / "tables.json"
    spec.write_text(json.dumps({"tables": [{"name": "a", "num_rows": 950, "dim": 32}]}))
    assert main(["plan", "--tables", str(spec), "--topology", "zionex", "--nodes", "1", "--time-limit", "0"]) == 0
    assert "1 tables (30,400 parameters)" in capsys.readouterr().out


def test_plan_for_training_plans_the_config_tables(monkeypatch, tmp_path):
    monkeypatch.setenv("NEOREC_CALIBRATION", str(tmp_path / "none.json"))  # nominal CPU numbers
    cfg = load_config(str(TINY), [])
    source = make_data_source(cfg.data)
    plan = plan_for_training(cfg, source, world_size=2, ranks_per_node=2)
    tables = source.tables(cfg.model.embedding_dim, cfg.model.pooling)
    plan.validate(tables, 2)
    assert {e.precision for e in plan.tables.values()} == {cfg.embedding.storage.precision}
    assert plan.to_json() == plan_for_training(cfg, source, 2, 2).to_json()  # the same on every rank


def test_plan_auto_plans_each_table_where_the_config_puts_it(monkeypatch, tmp_path):
    """--plan auto planned every table on the device tier, so a table that [embedding.location]
    puts behind a cache over SSD, because the device cannot hold it, made planning fail. Now each
    table is planned in its configured tier (a cached one at its store's precision, over the SSD
    folder's free space); and the nominal CPU topology takes this machine's memory, not 4 GB."""
    from neorec.planner import calibrate
    from neorec.planner.cli import training_topology
    from neorec.planner.enumerate import InfeasiblePlanError

    monkeypatch.setenv("NEOREC_CALIBRATION", str(tmp_path / "none.json"))  # nominal CPU numbers
    monkeypatch.setattr(calibrate, "host_memory_bytes", lambda: 16e9)
    topo = training_topology(2, 2)
    assert topo.name == "local-cpu-nominal" and (topo.device_memory_bytes, topo.host_dram_bytes) == (4e9, 0.0)
    assert topo.unified_memory == 1  # the host tiers draw on the device's memory: the same RAM

    # 3 MB of memory: 750 KB per rank for tables, too little for the four tables with their
    # optimizer state and the planner's per-rank allowances, enough with the two large ones cached
    # (a cache holds what a batch of 1,024 ids a table touches, ~1,000 of 20,000 or 40,000 rows: its
    # caches grow to that in training; at tiny.toml's 1,000 and 2,000 rows a batch touches most rows,
    # and caching them saves no device memory at all); on the CPU a cached_dram table's store takes
    # the same memory (fp16 rows: half), a cached_ssd table's takes disk
    monkeypatch.setattr(calibrate, "host_memory_bytes", lambda: 3e6)
    base = [f"embedding.location.ssd_dir='{tmp_path / 'ssd'}'", "embedding.location.precision='fp16'",
            "data.synthetic.num_embeddings=[500, 20000, 40000, 300]"]
    cfg = load_config(str(TINY), base)
    source = make_data_source(cfg.data)
    with pytest.raises(InfeasiblePlanError, match=r"(does not fit|fits no rank|no plan fits).*--plan auto plans each table where "
                                                  r"\[embedding.location\] puts it.*neorec plan --tiers"):
        plan_for_training(cfg, source, 2, 2)
    # a need that is mostly the step's buffers (tables too large to replicate): lower the batch;
    # it said to put tables off the device, which leaves the buffers as they are
    monkeypatch.setattr(calibrate, "host_memory_bytes", lambda: 1.2e8)
    big_batch = load_config(str(TINY), ["data.batch_size=65536", "data.synthetic.num_embeddings=[200000, 200000, "
                                        "200000, 200000]"])
    with pytest.raises(InfeasiblePlanError, match=r"a step's ids and pooled outputs.*--plan auto plans with "
                                                  r"data.batch_size = 65536 per rank: lower it \(--set "
                                                  r"data.batch_size=N\)$"):
        plan_for_training(big_batch, make_data_source(big_batch.data), 2, 2)
    monkeypatch.setattr(calibrate, "host_memory_bytes", lambda: 3e6)
    cfg = load_config(str(TINY), [*base, "embedding.location.default='cached_ssd'", "embedding.location.min_rows=1500",
                                  "embedding.location.tables={ t_feature_1 = 'cached_dram' }"])
    plan = plan_for_training(cfg, source, 2, 2)
    assert {name: entry.tier for name, entry in plan.tables.items()} == {
        "t_feature_0": "device", "t_feature_1": "cached_dram", "t_feature_2": "cached_ssd", "t_feature_3": "device"}
    assert {name: entry.precision for name, entry in plan.tables.items()} == {
        "t_feature_0": "fp32", "t_feature_1": "fp16", "t_feature_2": "fp16", "t_feature_3": "fp32"}
    plan.validate(source.tables(cfg.model.embedding_dim, cfg.model.pooling), 2)
    # caches of cache_rows rows each, not cache_fraction's, are what training builds
    cfg = load_config(str(TINY), [*base, "embedding.location.default='cached_dram'", "embedding.location.cache_rows=20000"])
    with pytest.raises(InfeasiblePlanError, match="--plan auto plans each table where"):
        plan_for_training(cfg, source, 2, 2)


def _topology_file(tmp_path, **changes) -> str:
    from neorec.planner.topology import Topology

    topo = Topology("small", 1, 2, 8e9, 3e9, 16e9, 3e9, 0.0, 0.0, 0.5e9, 0.5e9, 50e9, 5e-4)
    path = tmp_path / "topo.json"
    path.write_text(json.dumps({**topo.to_dict(), **changes}))
    return str(path)


def _spec_file(tmp_path, **changes) -> str:
    path = tmp_path / "tables.json"
    path.write_text(json.dumps({"batch_size": 64, "tables": [{"name": "a", "num_rows": 1000, "dim": 16},
                                                             {"name": "b", "num_rows": 500, "dim": 8}], **changes}))
    return str(path)


def test_plan_file_keeps_the_tier_that_training_places(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main(["plan", "--tables", _spec_file(tmp_path), "--topology", _topology_file(tmp_path), "--tiers", "dram",
               "--time-limit", "0", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    plan = ShardingPlan.load(out)
    assert {e.tier for e in plan.tables.values()} == {"dram"}
    # a GPU topology: every rank's GPU would hold no table (each rank failed after launch)
    assert 'note: neorec train on GPUs refuses this plan: rank(s) 0, 1 hold only "dram"' in capsys.readouterr().out
    tables = [TableConfig("a", 1000, 16), TableConfig("b", 500, 8)]
    assert plan.validate(tables, 2) is plan and plan.tiers_off_device() == {"a": "dram", "b": "dram"}
    with pytest.raises(ValueError, match="cannot place.*--tiers device"):  # a caller of the device only
        plan.validate(tables, 2, tiers=("device",))


def test_a_plan_of_one_rank_says_that_training_takes_none(tmp_path, capsys):
    """It was written without a word, and neorec train --plan refused it ("--plan needs several
    processes")."""
    out = tmp_path / "plan.json"
    assert main(["plan", "--tables", _spec_file(tmp_path), "--topology", _topology_file(tmp_path, ranks_per_node=1),
                 "--time-limit", "0", "--out", str(out)]) == 0
    assert "note: neorec train takes no plan on one process (--plan needs --nproc 2 or more, or torchrun)" \
        in capsys.readouterr().out
    assert ShardingPlan.load(out).world_size == 1


def tiny_planning_inputs(tmp_path, rows, batch_size, device_memory, host_dram, ssd):
    """tables.json (t_feature_i of ``rows``, dim 8, pooling 2) and topology.json (1 node of 2 CPU
    ranks) for `neorec plan`."""
    tables = tmp_path / "tables.json"
    tables.write_text(json.dumps({"batch_size": batch_size, "tables": [
        {"name": f"t_feature_{i}", "num_rows": n, "dim": 8, "pooling": 2} for i, n in enumerate(rows)]}))
    topology = tmp_path / "topology.json"
    topology.write_text(json.dumps({
        "name": "cpu2", "num_nodes": 1, "ranks_per_node": 2, "device_memory_bytes": device_memory,
        "device_bandwidth": 3e9, "host_dram_bytes": host_dram, "host_dram_bandwidth": 3e9, "ssd_bytes": ssd,
        "ssd_bandwidth": 1e9 if ssd else 0, "intra_node_bandwidth": 5e8, "inter_node_bandwidth": 5e8,
        "compute_flops": 5e10, "collective_latency": 5e-4}))
    return tables, topology


def test_a_plan_of_two_device_precisions_says_that_training_needs_one(tmp_path, capsys):
    """With --precisions fp32,fp16 and a device too small for all fp32, the plan stores some
    tables at fp16: neorec train refused it whatever embedding.storage.precision said, and its
    message said to set that precision."""
    tables, topology = tiny_planning_inputs(tmp_path, [500, 1000, 2000, 300], 256, device_memory=170000.0,
                                            host_dram=12e9, ssd=0)
    out = tmp_path / "plan.json"
    assert main(["plan", "--tables", str(tables), "--topology", str(topology), "--precisions", "fp32,fp16",
                 "--time-limit", "0", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    plan = ShardingPlan.load(out)
    assert set(plan.device_precisions()) == {"fp16", "fp32"}, plan.device_precisions()
    assert "note: neorec train refuses this plan: its tables off the caches ask for 2 precisions (fp16: " \
           in printed, printed
    for precision in ("fp32", "fp16"):
        with pytest.raises(ValueError, match=r"its tables off the caches ask for 2 precisions \(fp16: 't_feature_\d'"
                                             r"( and \d more)?, fp32: 't_feature_\d'( and \d more)?\).*--precisions "
                                             r"fp16`, and embedding.storage.precision = 'fp16'\)"):
            plan.check_precision(precision)
    assert main(["plan", "--tables", str(tables), "--topology", str(topology), "--precisions", "fp16",
                 "--time-limit", "0", "--out", str(out)]) == 0
    assert "note:" not in capsys.readouterr().out
    assert ShardingPlan.load(out).check_precision("fp16")


@pytest.mark.parametrize("changes, message", [
    ({"dense_mflops_per_sample": -1e6}, "dense_mflops_per_sample must be a finite number >= 0, got -1000000.0"),
    ({"dense_parameters": -5}, "dense_parameters must be a finite number >= 0, got -5"),
    ({"dense_parameters": None}, "dense_parameters must be a finite number >= 0, got None"),
    ({"dense_mflops_per_sample": "abc"}, "dense_mflops_per_sample must be a finite number >= 0, got 'abc'"),
    ({"batch_size": True}, "batch_size must be a positive integer, got True"),
    ({"tables": [{"name": "a", "num_rows": True, "dim": 16}]}, r"table #0: table 'a': num_rows must be an integer in"),
    ({"tables": [{"name": "a", "num_rows": 10, "dim": 16, "tiers": "device"}]},
     r"table #0: tiers must be a list of names, got 'device'"),
    ({"tables": [{"name": "a", "num_rows": 10, "dim": 16, "pooling": float("inf")}]},
     r"table #0: table 'a': pooling must be a number in \(0, 1,000,000\] ids per sample, got inf"),
    # a null or list name became a table called "None" or "['x']" in the plan file
    ({"tables": [{"name": None, "num_rows": 10, "dim": 16}]}, r"table #0: name must be a non-empty string, got None"),
    ({"tables": [{"name": ["x"], "num_rows": 10, "dim": 16}]}, r"table #0: name must be a non-empty string, got \['x'\]"),
    ({"tables": [{"name": " ", "num_rows": 10, "dim": 16}]}, r"table #0: name must be a non-empty string, got ' '"),
])
def test_plan_table_file_values_are_checked_naming_file_and_key(tmp_path, capsys, changes, message):
    spec = _spec_file(tmp_path, **changes)
    assert main(["plan", "--tables", spec, "--topology", _topology_file(tmp_path), "--time-limit", "0"]) == 2
    err = capsys.readouterr().err
    assert re.search(f"table-spec file {re.escape(spec)}.*{message}", err), err
    assert "Traceback" not in err


def test_plan_topology_nan_is_refused(tmp_path, capsys):
    topo = _topology_file(tmp_path, inter_node_bandwidth=float("nan"))
    assert main(["plan", "--tables", _spec_file(tmp_path), "--topology", topo]) == 2
    err = capsys.readouterr().err
    assert f"topology file {topo}: " in err and "inter_node_bandwidth must be a finite number, got nan" in err, err


def test_plan_missing_tier_names_a_reason(tmp_path, capsys):
    assert main(["plan", "--tables", _spec_file(tmp_path), "--topology", _topology_file(tmp_path),
                 "--tiers", "cached_ssd"]) == 2
    assert re.search(r"tightest limit: .*SSD share: needs [\d.]+ KiB per rank, the topology has none",
                     capsys.readouterr().err)


def test_plan_scaling_writes_the_files_first_and_shows_sizes_that_do_not_fit(tmp_path, capsys):
    # 2 nodes of 1 rank; the table needs both ranks: 1 node does not fit, 2 do
    topo = _topology_file(tmp_path, ranks_per_node=1, device_memory_bytes=0.25e9, collective_latency=0.0)
    spec = tmp_path / "big.json"
    spec.write_text(json.dumps({"batch_size": 16, "tables": [{"name": "big", "num_rows": 10_000_000, "dim": 8}]}))
    out, report = tmp_path / "plan.json", tmp_path / "report.json"
    rc = main(["plan", "--tables", str(spec), "--topology", topo, "--nodes", "2", "--scaling", "--time-limit", "0",
               "--out", str(out), "--report", str(report)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert ShardingPlan.load(out).world_size == 2
    assert re.search(r"\n\s+1\s+1  does not fit: table 'big'", text)
    rows = json.loads(report.read_text())["scaling"]
    assert [r["nodes"] for r in rows] == [1, 2] and "error" in rows[0] and rows[1]["efficiency"] == 1.0


def test_plan_scaling_includes_the_planned_node_count(tmp_path, capsys, monkeypatch):
    """The --nodes row is the plan printed above it: it was planned again under its own time limit,
    and on a loaded machine once showed 844,834 QPS under a plan of 1,641,435."""
    from neorec.planner import simulate

    planned = []
    real = simulate.plan_tables
    monkeypatch.setattr(simulate, "plan_tables", lambda specs, topo, *a, **k: planned.append(topo.num_nodes)
                        or real(specs, topo, *a, **k))
    topo = _topology_file(tmp_path, ranks_per_node=1)
    assert main(["plan", "--tables", _spec_file(tmp_path), "--topology", topo, "--nodes", "3", "--scaling",
                 "--time-limit", "0"]) == 0
    out = capsys.readouterr().out
    study = out.split("nodes  ranks")[1]
    assert [int(n) for n in re.findall(r"^\s+(\d+)\s+\d+\s", study, re.M)] == [1, 2, 3]
    assert planned == [1, 2]  # not 3: the plan above is reused
    pipelined = re.search(r"ms \(([\d,]+) QPS\) pipelined", out).group(1)
    assert re.search(rf"^\s+3\s+3\s+[\d.]+\s+{pipelined}\s", study, re.M), (pipelined, study)


@pytest.mark.parametrize("args, message", [
    (["--precisions", ""], "--precisions '' names nothing"),
    (["--tiers", " , "], "--tiers ' , ' names nothing"),
])
def test_plan_empty_lists_are_refused_alike(capsys, args, message):
    assert main(["plan", "--model", "dlrm-criteo-kaggle", "--nodes", "1", *args]) == 2
    assert message in capsys.readouterr().err


def test_calibration_out_directory_is_refused_before_measuring(tmp_path, capsys, monkeypatch):
    import neorec.planner.calibrate as calibrate

    def no_measuring(*a, **k):
        raise AssertionError("measured before checking the arguments")

    monkeypatch.setattr(calibrate, "calibrate", no_measuring)
    assert main(["plan", "--calibrate", "--calibration-out", str(tmp_path)]) == 2
    assert re.search(r"--calibration-out .* is a directory; give a file name", capsys.readouterr().err)
    # the default place, or NEOREC_CALIBRATION, were found unwritable only after the measurements
    monkeypatch.setenv("NEOREC_CALIBRATION", str(tmp_path))
    assert main(["plan", "--calibrate"]) == 2
    assert "NEOREC_CALIBRATION " + str(tmp_path) + " is a directory" in capsys.readouterr().err
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("NEOREC_CALIBRATION", str(blocker / "cal.json"))
    assert main(["plan", "--calibrate"]) == 2
    err = capsys.readouterr().err
    assert f"the folder of the calibration {blocker / 'cal.json'} (NEOREC_CALIBRATION), '{blocker}' is a file" in err, err
    assert "give --calibration-out FILE or set NEOREC_CALIBRATION" in err
    monkeypatch.delenv("NEOREC_CALIBRATION")
    monkeypatch.setenv("XDG_CACHE_HOME", "")  # empty: ~/.cache, not the relative neorec/...
    from neorec.planner.topology import default_calibration_path

    assert default_calibration_path().is_absolute()


def test_plan_auto_with_a_calibration_for_other_ranks_keeps_the_machines_memory(tmp_path, monkeypatch):
    """A calibration for 2 ranks gives each half the tables' memory; planning 8 ranks with it gave
    each rank that half again (4x the machine) instead of an eighth."""
    import io

    from neorec.planner.cli import training_topology
    from neorec.planner.topology import Topology

    calibrated = Topology("local-cpu", 1, 2, 4e9, 5e9, 8e9, 5e9, 0.0, 0.0, 1e9, 1e9, 50e9, 1e-3)
    calibrated.save(tmp_path / "calibration.json")
    monkeypatch.setenv("NEOREC_CALIBRATION", str(tmp_path / "calibration.json"))
    out = io.StringIO()
    topo = training_topology(8, 8, out=out)
    assert (topo.world_size, topo.device_memory_bytes * 8) == (8, 2 * 4e9)
    assert "made for 2 ranks per node, this run has 8" in out.getvalue()
    assert "--calibrate-ranks 8" in out.getvalue()
    out = io.StringIO()
    # (a calibration made before unified_memory was written counts the host tiers on the device too)
    assert training_topology(2, 2, out=out) == dataclasses.replace(calibrated, unified_memory=1)
    assert out.getvalue() == ""


def test_chart_without_matplotlib_is_refused_before_the_search(tmp_path, monkeypatch, capsys):
    """The missing library was reported after a 10-25 s search, with nothing written."""
    import importlib.util

    import neorec.planner.planner as planner

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))

    def no_search(*args, **kwargs):
        raise AssertionError("the search ran")

    monkeypatch.setattr(planner, "plan_tables", no_search)
    rc = main(["plan", "--model", "dlrm-criteo-kaggle", "--chart", str(tmp_path / "load.png")])
    assert rc == 2 and "the per-rank chart needs matplotlib" in capsys.readouterr().err


def test_zero_nodes_and_more_than_eight_column_pieces():
    from neorec.planner.cost_model import PlanSettings, TableSpec
    from neorec.planner.enumerate import Capacity, enumerate_options
    from neorec.planner.topology import get_topology

    with pytest.raises(ValueError, match="number of nodes must be >= 1, got 0"):
        get_topology("zionex", 0)  # was the preset's 16 nodes
    topo = get_topology("zionex", 2)
    settings = PlanSettings(sharding_types=("column_wise",), max_column_pieces=16)
    pieces = {o.num_pieces for o in enumerate_options(TableSpec("t", 1000, 128), topo, settings,
                                                       Capacity.of(topo, settings))}
    assert 16 in pieces  # max_column_pieces above 8 was capped at 8 without a word


def test_plan_outputs_in_a_missing_folder_are_refused_before_the_search(tmp_path, capsys):
    """The folders were made (`--chart /nonexistent/x.png` made /nonexistent), unlike write-criteo."""
    for flag in ("--out", "--report", "--chart"):
        target = tmp_path / "missing" / "x.json"
        assert main(["plan", "--model", "dlrm-criteo-kaggle", flag, str(target)]) == 2
        err = capsys.readouterr().err
        assert f"plan: {flag} {target}: its directory {target.parent} does not exist" in err, err
        assert not target.parent.exists()


@pytest.mark.parametrize("flag", ["--out", "--report", "--chart"])
def test_plan_outputs_in_an_unwritable_folder_are_refused_before_the_search(tmp_path, capsys, monkeypatch, flag):
    """A folder that could not be written in was found only after the whole search, as a raw
    "[Errno 13] Permission denied: 'ro/p.json'"; a folder that is a file was said not to exist."""
    import os

    import neorec.planner.planner as planner

    def no_search(*a, **k):
        raise AssertionError("searched before checking the outputs")

    monkeypatch.setattr(planner, "plan_tables", no_search)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    target = blocker / "p.json"  # unwritable for root as well
    assert main(["plan", "--model", "dlrm-criteo-kaggle", "--nodes", "1", flag, str(target)]) == 2
    err = capsys.readouterr().err
    assert err == f"neorec plan: error: plan: {flag} {target}: its folder '{blocker}' is a file, not a directory\n", err
    if os.geteuid() == 0:
        return  # (permission bits do not stop root)
    folder = tmp_path / "ro"
    folder.mkdir(mode=0o555)
    target = folder / "p.json"
    assert main(["plan", "--model", "dlrm-criteo-kaggle", "--nodes", "1", flag, str(target)]) == 2
    err = capsys.readouterr().err
    assert f"plan: {flag} {target}: its folder '{folder}' is not a writable directory: Permission denied" in err, err
    assert list(folder.iterdir()) == []


@pytest.mark.parametrize("gpu, preset, note", [("NVIDIA H100 80GB HBM3", "dgx-h100", False),
                                                ("NVIDIA A100-SXM4-40GB", "zionex", False),
                                                ("NVIDIA L40S", "dgx-h100", True)])
def test_plan_auto_on_gpus_plans_for_the_gpu_not_for_a_cpu(monkeypatch, gpu, preset, note):
    """--plan auto planned GPU runs for nominal CPU numbers (4 GB per rank): a 12.8 GB table that two
    80 GB GPUs hold was refused as infeasible."""
    import io
    import types

    import torch

    from neorec.planner import calibrate
    from neorec.planner.cli import training_topology
    from neorec.planner.topology import get_topology

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(name=gpu, total_memory=48 * 2**30))
    out = io.StringIO()
    topo = training_topology(2, 2, out=out, device="cuda")
    expected = get_topology(preset)
    assert topo.name == f"local-gpu ({gpu})" and (topo.num_nodes, topo.ranks_per_node) == (1, 2)
    assert topo.device_memory_bytes == 48 * 2**30 and topo.device_bandwidth == expected.device_bandwidth
    # this machine's host memory and no SSD, not the preset's (2 TB of DRAM, 30 TB of NVMe)
    assert (topo.host_dram_bytes, topo.ssd_bytes) == (calibrate.host_memory_bytes(), 0.0)
    assert topo.intra_node_bandwidth == expected.intra_node_bandwidth
    assert ("no preset for" in out.getvalue()) == note
    assert training_topology(2, 2, out=out, device="auto").name == topo.name
    assert training_topology(2, 2, out=io.StringIO(), device="cpu").name.startswith("local-cpu")
    for device in ("cpu", "cuda"):  # torchrun agents of 2 and 1 ranks: planned as 1 node of 2 (world 2)
        with pytest.raises(ValueError, match="--plan auto plans for nodes of equal size, but this rank's node runs 2 "
                                             "of the 3 ranks"):
            training_topology(3, 2, out=io.StringIO(), device=device)


def test_plan_auto_on_a_gpu_keeps_memory_for_everything_but_the_tables(monkeypatch, tmp_path):
    """--plan auto planned tables into all of a GPU's memory (39.8 of 40 GiB: the CUDA context,
    dense parameters and activations then ran out of memory); `neorec plan` keeps 15%. On the CPU
    the topology already gives tables half a rank's share, and nothing more is kept."""
    import types

    import torch

    from neorec.planner import planner
    from neorec.planner.enumerate import InfeasiblePlanError

    monkeypatch.setenv("NEOREC_CALIBRATION", str(tmp_path / "none.json"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    memory = {"bytes": 40 * 2**30}
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=memory["bytes"]))
    seen = []
    real = planner.plan_tables
    monkeypatch.setattr(planner, "plan_tables", lambda *a, **k: seen.append(a[2]) or real(*a, **k))
    source = make_data_source(load_config(str(TINY), []).data)
    for device, reserve in (("cuda", 0.15), ("auto", 0.15), ("cpu", 0.0)):
        plan_for_training(load_config(str(TINY), [f"train.device='{device}'"]), source, 2, 2)
        assert seen[-1].device_reserve_fraction == reserve, device
    # what that leaves: a GPU on which the tables fit with nothing kept refuses them with 15% kept
    from neorec.planner import cli as plan_cli

    cfg = load_config(str(TINY), ["train.device='cuda'"])
    low, high = 1, 2**30  # the least memory the tables fit in with nothing kept (bisection)
    monkeypatch.setattr(plan_cli, "GPU_RESERVE_FRACTION", 0.0)
    while high - low > high // 200:
        memory["bytes"] = (low + high) // 2
        try:
            plan_for_training(cfg, source, 2, 2)
            high = memory["bytes"]
        except InfeasiblePlanError:
            low = memory["bytes"]
    monkeypatch.setattr(plan_cli, "GPU_RESERVE_FRACTION", 0.15)
    memory["bytes"] = high
    with pytest.raises(InfeasiblePlanError):
        plan_for_training(cfg, source, 2, 2)
    memory["bytes"] = int(high / 0.85) + 1
    plan_for_training(cfg, source, 2, 2)


def test_a_large_plan_prints_its_eight_slowest_and_eight_fastest_ranks(capsys):
    """"-MAX_RANK_ROWS // 4" is (-16) // 4: 8 slowest and only 4 fastest ranks were printed."""
    from types import SimpleNamespace

    from neorec.planner.cli import MAX_RANK_ROWS, _print_ranks

    ranks = [SimpleNamespace(rank=r, num_pieces=1, memory=SimpleNamespace(device=0, host=0, ssd=0),
                             cost=SimpleNamespace(total=(r * 7 % 40) * 1e-3, compute=0.0, comm=0.0)) for r in range(40)]
    _print_ranks(SimpleNamespace(ranks=lambda: ranks), all_ranks=False)
    lines = capsys.readouterr().out.splitlines()
    shown = sorted(float(line.split()[-1]) for line in lines[1:-1])
    assert MAX_RANK_ROWS == 16 and shown == [float(ms) for ms in [*range(8), *range(32, 40)]]
    assert lines[-1] == "(16 of 40 ranks: the slowest and the fastest; --all-ranks prints all)"


def test_a_plan_of_cached_tiers_and_fp16_device_tables_says_that_training_needs_fp32(tmp_path, capsys):
    """Cache slots are fp32 rows of the fused module, which holds one precision: with fp32 storage
    training refused the fp16 tables (and said to set embedding.storage.precision), with fp16 each
    rank refused the caches after launch; `neorec plan` had said nothing."""
    tables, topology = tiny_planning_inputs(tmp_path, [500, 1000, 200000, 300], 128, device_memory=2e6,
                                            host_dram=1e9, ssd=1e10)
    out = tmp_path / "plan.json"
    assert main(["plan", "--tables", str(tables), "--topology", str(topology), "--precisions", "fp16",
                 "--tiers", "device,cached_ssd", "--time-limit", "0", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    plan = ShardingPlan.load(out)
    assert plan.tiers_off_device() and "fp16" in plan.device_precisions(), (plan.tiers_off_device(), printed)
    message = (r"tables? 't_feature_\d'( and \d more)? (is|are) on a cached tier, whose fp32 cache slots sit in the fused "
               r"module, and {}; one rank's fused module holds one precision, so a plan with cached tiers trains with "
               r"its other tables at fp32 \(`neorec plan --precisions fp32`")
    assert re.search("note: neorec train refuses this plan: " + message.format(
        r"its tables off the caches ask for fp16 \('t_feature_\d'( and \d more)?\)"), printed), printed
    for precision in ("fp32", "fp16"):
        with pytest.raises(ValueError, match=message.format(r"its tables off the caches ask for fp16 \('t_feature_\d'"
                                                            r"( and \d more)?\)")):
            plan.check_precision(precision)
    assert main(["plan", "--tables", str(tables), "--topology", str(topology), "--precisions", "fp32",
                 "--tiers", "device,cached_ssd", "--time-limit", "0", "--out", str(out)]) == 0
    assert "note:" not in capsys.readouterr().out
    fp32 = ShardingPlan.load(out)
    assert fp32.tiers_off_device() and fp32.check_precision("fp32")
    with pytest.raises(ValueError, match=message.format("embedding.storage.precision is 'bf16'")):
        fp32.check_precision("bf16")
