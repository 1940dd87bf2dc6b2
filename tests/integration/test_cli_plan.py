"""`neorec plan` end to end, and `neorec train --plan auto`'s planning step.

    python -m pytest tests/integration/test_cli_plan.py -q
"""

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
    plan = ShardingPlan.load(out)
    plan.validate([TableConfig(f"t_cat_{i}", r, 16) for i, r in enumerate(CRITEO_KAGGLE_ROWS)], 8)
    data = json.loads(report.read_text())
    assert len(data["ranks"]) == 8 and data["simulation"]["qps"] > 0 and data["gap"] >= 0
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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
