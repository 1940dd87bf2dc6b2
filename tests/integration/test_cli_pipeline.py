"""`neorec train --no-pipeline` / `--profile` through the CLI entry point."""

import json
from pathlib import Path

from neorec.cli import main

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"


def test_no_pipeline_and_profile_flags(tmp_path, capsys):
    rc = main(["train", "--config", str(TINY), "--output-dir", str(tmp_path), "--no-progress", "--max-steps", "4",
               "--no-pipeline", "--profile"])
    out = capsys.readouterr().out
    assert rc == 0, out
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["train"]["pipeline"] is False and config["train"]["profile"] is True
    assert "step timeline (4 steps" in out and "exposed communication" in out
    timeline = json.loads((tmp_path / "timeline.json").read_text())
    assert timeline["steps"] == 4 and timeline["pipeline"] is False


def test_help_lists_the_flags_and_keys(capsys):
    try:
        main(["train", "--help"])
    except SystemExit as exit_:
        assert exit_.code == 0
    out = capsys.readouterr().out
    for text in ("--no-pipeline", "--profile", "train.pipeline", "embedding.comm.forward", "embedding.comm.backward"):
        assert text in out, text
