"""What the `neorec` command line says and returns when something is missing or wrong, in-process."""

import json
import shlex
import subprocess
from pathlib import Path

import pytest

from neorec.cli import main

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.toml"


def test_data_without_a_command_prints_its_usage_and_exits_2(capsys):
    """`neorec data` alone is a usage error, as `neorec` alone is (it used to exit 0)."""
    assert main(["data"]) == 2
    out = capsys.readouterr().out
    assert out.startswith("usage: neorec data") and "write-criteo" in out and "preprocess-criteo" in out
    assert main([]) == 2


def test_an_unknown_argument_is_said_with_its_commands_usage(capsys):
    """`neorec train --foo` printed the top-level usage (`neorec [-h] [--traceback] COMMAND ...`)."""
    for argv, usage in [(["train", "--foo"], "usage: neorec train "), (["--foo"], "usage: neorec [-h]"),
                        (["plan", "--foo", "x"], "usage: neorec plan "), (["--foo", "train"], "usage: neorec [-h]")]:
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.startswith(usage), (argv, err)
        assert f"error: unrecognized arguments: {' '.join(argv[1:] if argv[0] == 'plan' else ['--foo'])}" in err


def test_an_unknown_argument_of_a_data_command_is_said_with_that_commands_usage(capsys, tmp_path):
    """`neorec data write-criteo PATH --foo` printed `neorec data`'s usage, not write-criteo's."""
    out = str(tmp_path / "x.tsv")
    for argv, usage in [(["data", "write-criteo", out, "--foo"], "usage: neorec data write-criteo "),
                        (["data", "--foo", "write-criteo", out], "usage: neorec data [-h]"),
                        (["data", "preprocess-criteo", out, out, "--foo"], "usage: neorec data preprocess-criteo ")]:
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.startswith(usage), (argv, err)
        assert "error: unrecognized arguments: --foo" in err
    assert not (tmp_path / "x.tsv").exists()


@pytest.mark.parametrize("value", ["0", "false", "No", "off", ""])
def test_neorec_traceback_off_values_show_no_traceback(monkeypatch, capsys, value):
    monkeypatch.setenv("NEOREC_TRACEBACK", value)
    assert main(["config", "--set", "train.max_steps=x"]) == 2
    err = capsys.readouterr().err
    assert "neorec config: error: config key 'train.max_steps' must be an integer" in err


@pytest.mark.parametrize("value", ["1", "yes", "true"])
def test_neorec_traceback_on_values_show_the_traceback_and_keep_the_exit_code(monkeypatch, capsys, value):
    """The traceback was shown by re-raising, which turned the usage exit code 2 into Python's 1."""
    monkeypatch.setenv("NEOREC_TRACEBACK", value)
    assert main(["config", "--set", "train.max_steps=x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and "ValueError" in err
    assert err.splitlines()[-1].startswith("neorec config: error: config key 'train.max_steps' must be an integer")
    monkeypatch.delenv("NEOREC_TRACEBACK")
    assert main(["--traceback", "config", "--set", "train.max_steps=x"]) == 2


def test_write_criteo_into_a_missing_directory_names_the_path_given(tmp_path, capsys):
    target = tmp_path / "nonexistdir" / "x.tsv"
    assert main(["data", "write-criteo", str(target), "--lines", "10"]) == 2
    err = capsys.readouterr().err
    assert err == f"neorec data: error: cannot write {target}: its directory {target.parent} does not exist\n"
    assert ".tmp-" not in err
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["data", "write-criteo", str(blocker / "x.tsv"), "--lines", "10"]) == 2
    assert f"cannot write {blocker / 'x.tsv'}: its directory {blocker} is not a directory" in capsys.readouterr().err


def test_preprocessing_a_tsv_without_rows_fails_and_a_negative_seed_is_named_as_the_option(tmp_path, capsys):
    """An empty TSV, or one whose every line was skipped as malformed, was 'preprocessed' with exit
    code 0 and a `train on it with: ...` line for a run that stops at 'has no training rows'; a
    negative --seed was said as 'data.synthetic.seed', a key the user never set."""
    empty = tmp_path / "empty.tsv"
    empty.write_text("")
    assert main(["data", "preprocess-criteo", str(empty), str(tmp_path / "a")]) == 2
    out, err = capsys.readouterr()
    assert err == f"neorec data: error: {empty} holds no rows (empty): nothing to train on\n" and out == ""
    assert not (tmp_path / "a" / "train").exists()  # no empty copy ("preprocessed ... 0 rows" was said first)
    junk = tmp_path / "junk.tsv"
    junk.write_text("a,b,c\n1,2,3\n")
    assert main(["data", "preprocess-criteo", str(junk), str(tmp_path / "b"), "--skip-malformed"]) == 2
    out, err = capsys.readouterr()
    assert "preprocessed" not in out and "train on it" not in out and "  skipped " in out  # the examples
    assert err == f"neorec data: error: {junk} holds no rows (its 2 lines are all malformed): nothing to train on\n"
    assert list((tmp_path / "b").iterdir()) == [tmp_path / "b" / "train.lock"]  # the lock file stays
    assert main(["data", "write-criteo", str(tmp_path / "x.tsv"), "--lines", "10", "--seed", "-1"]) == 2
    assert capsys.readouterr().err == "neorec data: error: --seed must be >= 0, got -1\n"
    assert not (tmp_path / "x.tsv").exists()


def test_train_names_the_set_that_makes_data_keys_disagree(tmp_path, capsys):
    rc = main(["train", "--config", str(TINY), "--output-dir", str(tmp_path / "run"), "--no-progress",
               "--set", "data.synthetic.num_tables=2"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("neorec train: error: data.synthetic.num_embeddings must hold one value")
    assert err.rstrip().endswith("(from --set data.synthetic.num_tables=2)"), err
    assert not (tmp_path / "run").exists()  # stopped at load time, before anything was built


def test_ctrl_c_while_the_command_starts_is_a_plain_interruption(monkeypatch, capsys):
    """Building the parser imports torch (1-2 s): Ctrl-C then gave a traceback and exit code 1."""
    import neorec.cli as cli

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert main(["train"]) == 130
    assert capsys.readouterr().err == "neorec: interrupted\n"


def test_nproc_checks_the_config_and_plan_once_before_starting_ranks(tmp_path, capsys, monkeypatch):
    """Each of N ranks loaded the config and plan and said the same error: N lines, ~20 s for 4."""
    import neorec.train.launch as launch
    from neorec.config import load_config
    from neorec.data.source import make_data_source
    from neorec.sharding.planning import default_plan

    def no_ranks(*args, **kwargs):
        raise AssertionError("ranks were started for a command that cannot run")

    monkeypatch.setattr(launch, "launch_local", no_ranks)
    assert main(["train", "--config", str(TINY), "--nproc", "4", "--set", "train.bogus=1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown config key 'train.bogus'" in err, err
    cfg = load_config(TINY)
    plan = tmp_path / "plan.json"
    plan.write_text(default_plan(make_data_source(cfg.data).tables(cfg.model.embedding_dim), 2).to_json())
    assert main(["train", "--config", str(TINY), "--nproc", "3", "--plan", str(plan)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "written for world_size 2, but the world has 3 ranks" in err, err
    for change, message in (("precision", "asks for precision 'fp16' but the embeddings are stored in 'fp32'"),
                            ("tier", "data-parallel tables 't_feature_0' (dram) are planned off the device")):
        entries = json.loads(plan.read_text())
        first = entries["tables"][sorted(entries["tables"])[0]]
        first.update({"precision": "fp16"} if change == "precision" else  # each rank said these
                     {"sharding_type": "data_parallel", "shards": [], "tier": "dram"})
        (tmp_path / f"{change}.json").write_text(json.dumps(entries))
        assert main(["train", "--config", str(TINY), "--nproc", "2", "--plan", str(tmp_path / f"{change}.json")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    entries = json.loads(plan.read_text())
    entries["tables"][sorted(entries["tables"])[0]].update({"sharding_type": "data_parallel", "shards": []})
    (tmp_path / "replica.json").write_text(json.dumps(entries))
    assert main(["train", "--config", str(TINY), "--nproc", "2", "--plan", str(tmp_path / "replica.json"),
                 "--set", "embedding.location.default='cached_dram'"]) == 2
    err = capsys.readouterr().err  # each rank said it
    assert err.count("\n") == 1 and "data-parallel tables ['t_feature_0'] are placed off the device by" in err, err
    entries = json.loads(plan.read_text())
    for entry in entries["tables"].values():
        if entry["sharding_type"] != "data_parallel":
            entry["tier"] = "cached_dram"
    (tmp_path / "tiers.json").write_text(json.dumps(entries))
    assert main(["train", "--config", str(TINY), "--nproc", "2", "--plan", str(tmp_path / "tiers.json"),
                 "--set", "embedding.location.prefetch=true", "--no-pipeline"]) == 2
    err = capsys.readouterr().err  # the plan's tiers put pieces behind caches: prefetched only by the pipeline
    assert err.count("\n") == 1 and "prefetch = true in a sharded run needs train.pipeline = true" in err, err
    missing = tmp_path / "day_0.tsv"  # each rank said it, after ~10 s of starting
    assert main(["train", "--config", str(ROOT / "configs" / "criteo.toml"), "--nproc", "2",
                 "--set", f"data.criteo.train_path={missing}"]) == 2
    err = capsys.readouterr().err
    assert err == f"neorec train: error: Criteo TSV file not found: {missing} (data.criteo.train_path; `neorec data " \
                  f"write-criteo {missing}` writes learnable synthetic data in its layout)\n", err
    assert main(["train", "--config", str(ROOT / "configs" / "criteo.toml"),  # one process: the key was not named
                 "--set", f"data.criteo.train_path={missing}"]) == 2
    assert capsys.readouterr().err == err
    assert main(["train", "--config", str(ROOT / "configs" / "movielens.toml"), "--nproc", "2",
                 "--set", f"data.movielens.path={tmp_path / 'ml'}"]) == 2
    assert "MovieLens directory not found: " in capsys.readouterr().err
    assert main(["train", "--config", str(TINY), "--nproc", "2", "--resume", str(tmp_path / "nockpt")]) == 2
    assert capsys.readouterr().err == f"neorec train: error: --resume: {tmp_path / 'nockpt'} does not exist\n"
    empty = tmp_path / "empty"  # each rank found no checkpoint in it
    empty.mkdir()
    assert main(["train", "--config", str(TINY), "--nproc", "2", "--resume", str(empty)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"no complete checkpoint in {empty}: it holds no step-N folders" in err, err
    assert main(["train", "--config", str(TINY), "--resume", str(empty), "--no-progress"]) == 2  # one process
    err = capsys.readouterr().err
    assert f"no complete checkpoint in {empty}: it holds no step-N folders (checkpoints are saved only with " \
           "checkpoint.dir set" in err, err
    assert main(["train", "--config", str(ROOT / "configs" / "tiny_cached_ssd.toml"), "--nproc", "2",
                 "--no-pipeline"]) == 2
    err = capsys.readouterr().err  # its cached tables are sharded: their rows are prefetched only by the pipeline
    assert err.count("\n") == 1 and "embedding.location.prefetch = true in a sharded run needs train.pipeline = true" \
        in err, err
    # tables in host DRAM, none cached: nothing to prefetch, nothing to refuse (it was refused as above); the
    # ranks are started (test_sharded_cached trains it)
    assert main(["train", "--config", str(TINY), "--nproc", "2", "--no-pipeline", "--output-dir", str(tmp_path / "dram"),
                 "--set", "embedding.location.default='dram'", "--set", "embedding.location.prefetch=true"]) == 1
    assert "ranks were started for a command that cannot run" in capsys.readouterr().err


def test_nproc_checks_table_sizes_against_the_plan_and_the_checkpoint_once(tmp_path, capsys, monkeypatch):
    """Rows no shard covers and a --resume checkpoint the model cannot continue were said by each
    rank (`neorec train (rank 1): error: ...` N times, after the ranks had started)."""
    import neorec.train.launch as launch

    started = []
    monkeypatch.setattr(launch, "launch_local", lambda nproc, argv: started.append(argv) or 0)
    plan = json.loads((ROOT / "configs" / "tiny_plan_2ranks.json").read_text())
    plan["tables"]["t_feature_2"]["shards"][1]["row_end"] = 1900
    (tmp_path / "short.json").write_text(json.dumps(plan))
    assert main(["train", "--config", str(TINY), "--nproc", "2", "--plan", str(tmp_path / "short.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'t_feature_2' (row_wise): rows [1900, 2000) are in no shard" in err, err
    assert "short.json" in err

    ckpt = tmp_path / "ckpt"
    assert main(["train", "--config", str(TINY), "--set", "train.max_steps=4", "--set", f"checkpoint.dir='{ckpt}'",
                 "--set", "checkpoint.every_steps=2", "--set", f"train.output_dir='{tmp_path / 'run'}'"]) == 0
    capsys.readouterr()
    wider = ["--set", "model.embedding_dim=16", "--set", "model.dense_layers=[32,16]"]
    for extra, message in ((wider, "the model's tables differ from the checkpoint's"),
                           (["--set", "data.batch_size=100"], "not a whole number of the new global batches of 200")):
        for where in (ckpt, ckpt / "step-000000004"):
            assert main(["train", "--config", str(TINY), "--nproc", "2", "--resume", str(where), *extra]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and message in err and "step-000000004" in err, err
    (ckpt / "step-000000004" / "manifest.json").write_text("{torn")  # the ranks skip it: so does the check
    assert main(["train", "--config", str(TINY), "--nproc", "2", "--resume", str(ckpt), *wider]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "resume from " + str(ckpt / "step-000000002") in err, err
    assert not started
    assert main(["train", "--config", str(TINY), "--nproc", "2", "--resume", str(ckpt),
                 "--plan", str(ROOT / "configs" / "tiny_plan_2ranks.json")]) == 0
    assert len(started) == 1


def test_nproc_with_a_leftover_rank_and_world_size_says_so(monkeypatch, capsys):
    """RANK / WORLD_SIZE exported in the shell made `--nproc 2` join a world nobody started (a wait
    for a rendezvous until the timeout) instead of starting its ranks."""
    import neorec.train.launch as launch

    def no_ranks(*args, **kwargs):
        raise AssertionError("ranks were started")

    monkeypatch.setattr(launch, "launch_local", no_ranks)
    for key in ("TORCHELASTIC_RUN_ID", launch.LAUNCHER_ENV):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["train", "--config", str(TINY), "--nproc", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "RANK=0 and WORLD_SIZE=2 are set in the environment" in err, err
    assert "unset RANK and WORLD_SIZE" in err
    # without --nproc the same leftovers reached torch's "environment variable MASTER_ADDR expected"
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    assert main(["train", "--config", str(TINY)]) == 2
    err = capsys.readouterr().err
    assert "RANK=0 and WORLD_SIZE=2 are set in the environment but MASTER_ADDR and MASTER_PORT are not" in err, err
    assert "unset RANK and WORLD_SIZE to train in one process" in err
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun started it: --nproc must match the world
    assert main(["train", "--config", str(TINY), "--nproc", "3"]) == 2
    assert "--nproc 3 but the launcher started WORLD_SIZE=2 processes" in capsys.readouterr().err


def test_nproc_stopped_by_ctrl_c_names_the_checkpoint_to_resume_from(tmp_path, monkeypatch, capsys):
    """A single process says where it stopped and what to resume from; `--nproc N` said only
    'interrupted'. The launcher names the newest checkpoint whose manifest was written."""
    import neorec.train.launch as launch

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(launch, "launch_local", interrupted)
    root = tmp_path / "ck"
    args = ["train", "--config", str(TINY), "--nproc", "2", "--set", f"checkpoint.dir='{root}'"]
    assert main(args) == 130
    assert capsys.readouterr().err == (f"neorec train: no checkpoint saved yet in {root}\n"
                                       "neorec train: interrupted; stopped every rank\n")
    for step, complete in ((20, True), (40, True), (60, False)):  # step 60 was being written
        (root / f"step-{step:09d}").mkdir(parents=True)
        if complete:
            (root / f"step-{step:09d}" / "manifest.json").write_text("{}")
    assert main(args) == 130
    assert capsys.readouterr().err.splitlines()[0] == (
        f"neorec train: its newest checkpoint is of step 40: --resume {root} goes on from there")
    assert main(args[:-2]) == 130
    assert "no checkpoints (set checkpoint.dir to be able to resume)" in capsys.readouterr().err


def test_plans_for_other_tables_or_larger_nodes_are_refused_before_ranks_start(tmp_path, monkeypatch, capsys):
    """A plan for another model's tables was refused by each rank after start-up (~24 s, one line per
    rank); one made for 4 ranks per node ran on 2-rank nodes with its node-local pieces on two."""
    import neorec.train.launch as launch

    def no_ranks(*args, **kwargs):
        raise AssertionError("ranks were started")

    monkeypatch.setattr(launch, "launch_local", no_ranks)
    plan = json.loads((ROOT / "configs" / "tiny_plan_2ranks.json").read_text())
    plan["tables"]["t_other"] = plan["tables"].pop("t_feature_0")
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps(plan))
    assert main(["train", "--config", str(TINY), "--nproc", "2", "--plan", str(wrong)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "sharding plan: unknown tables ['t_other']" in err and str(wrong) in err, err
    # a shard outside the world, overlapping row ranges: each rank said it, once per rank
    for change, message in [(lambda p: p["tables"]["t_feature_0"]["shards"][0].update(rank=5),
                             "'t_feature_0' (table_wise): shard {'rank': 5, "),
                            (lambda p: p["tables"]["t_feature_2"]["shards"][1].update(row_start=900),
                             "'t_feature_2' (row_wise): row ranges overlap at row 900")]:
        plan = json.loads((ROOT / "configs" / "tiny_plan_2ranks.json").read_text())
        change(plan)
        wrong.write_text(json.dumps(plan))
        assert main(["train", "--config", str(TINY), "--nproc", "2", "--plan", str(wrong)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err

    rows = 2000  # t_feature_2, row-wise inside one node of 4 ranks
    plan = json.loads((ROOT / "configs" / "tiny_plan_2ranks.json").read_text())
    plan.update(world_size=4, ranks_per_node=4)
    plan["tables"]["t_feature_2"] = {"sharding_type": "table_row_wise", "shards": [
        {"rank": r, "row_start": r * rows // 4, "row_end": (r + 1) * rows // 4, "col_start": 0, "col_end": 8}
        for r in range(4)]}
    one_node = tmp_path / "one_node.json"
    one_node.write_text(json.dumps(plan))
    for key, value in dict(RANK="0", WORLD_SIZE="4", LOCAL_WORLD_SIZE="2", TORCHELASTIC_RUN_ID="x").items():
        monkeypatch.setenv(key, value)  # torchrun, 2 nodes of 2: refused before joining the world
    assert main(["train", "--config", str(TINY), "--plan", str(one_node)]) == 2
    err = capsys.readouterr().err
    assert "written for 4 ranks per node, but this world has 2: the pieces of its node-local tables " \
           "['t_feature_2'] would be on several nodes" in err, err


def test_half_precision_storage_with_cached_tables_is_refused_at_load_time(capsys):
    """It passed `neorec config` and was refused by `train` only after the data was built, without
    naming the --set."""
    args = ["--set", "embedding.storage.precision='fp16'", "--set", "embedding.location.default='cached_dram'"]
    assert main(["config", *args]) == 2
    err = capsys.readouterr().err
    assert "embedding.storage.precision = 'fp16' with cached tables (tables ['t_feature_0', 't_feature_1', " \
           in err and "(from the --set overrides together)" in err, err
    assert main(["config", "--config", str(ROOT / "configs" / "tiny_cached_ssd.toml"),
                 "--set", "embedding.storage.precision='bf16'"]) == 2
    # every cached table (it named t_feature_0 alone: the two cached by default and min_rows were left out)
    assert "with cached tables (tables ['t_feature_0', 't_feature_1', 't_feature_2'])" in capsys.readouterr().err
    every_table_on_the_device = "embedding.location.tables={" + ", ".join(
        f"t_feature_{i}='device'" for i in range(8)) + "}"  # the default data: 8 tables
    assert main(["config", *args, "--set", every_table_on_the_device]) == 0  # nothing is cached
    capsys.readouterr()


def test_warnings_are_one_line_of_the_commands_output(tmp_path, capsys):
    """Python's format showed the source file, line number and code line of the warning."""
    assert main(["train", "--config", str(TINY), "--max-steps", "2", "--no-progress", "--output-dir",
                 str(tmp_path / "run"), "--set", "embedding.location.default='cached_dram'",
                 "--set", "embedding.location.cache_fraction=0.05"]) == 0
    err = capsys.readouterr().err
    assert "neorec: warning: cache of table 't_feature_" in err and "growing it to" in err, err
    assert "cached.py" not in err and "_grow_cache" not in err
    import io
    import warnings

    from neorec.cli import _show_warning

    class Closed(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    _show_warning(warnings.WarningMessage("x", UserWarning, "f", 1).message, UserWarning, "f", 1, file=Closed())


def test_a_negative_max_steps_is_named_as_the_option_given(capsys):
    assert main(["train", "--config", str(TINY), "--max-steps", "-1"]) == 2
    assert capsys.readouterr().err == "neorec train: error: --max-steps must be >= 0 (0 = no limit), got -1\n"


def test_option_mistakes_are_named_as_the_options(tmp_path, capsys):
    """Errors named the functions' parameters (num_lines, skip_malformed), or missed the point."""
    assert main(["data", "write-criteo", str(tmp_path / "x.tsv"), "--lines", "-5"]) == 2
    assert "--lines must be >= 1, got -5" in capsys.readouterr().err
    assert main(["data", "preprocess-criteo", str(tmp_path / "x.tsv"), "--num-embeddings", "1"]) == 2
    assert "--num-embeddings must be >= 2" in capsys.readouterr().err
    bad = tmp_path / "bad.tsv"
    bad.write_text("1\tnot a line\n")
    assert main(["data", "preprocess-criteo", str(bad)]) == 2
    assert "--skip-malformed" in capsys.readouterr().err
    assert main(["train", "--config", str(TINY), "--resume", str(TINY)]) == 2  # was "no complete checkpoint in"
    assert "--resume: " + str(TINY) + " is a file; give a checkpoint folder" in capsys.readouterr().err
    assert main(["train", "--config", str(TINY), "--nproc", "1", "--plan", "x.json"]) == 2
    assert "--plan needs several processes: --nproc 2 or more" in capsys.readouterr().err


def test_a_full_disk_during_training_names_the_file_and_exits_1(tmp_path, monkeypatch, capsys):
    """It said "[Errno 28] No space left on device" with no file, and the usage exit code 2."""
    import errno

    import neorec.train.trainer as trainer_module

    real_write = trainer_module.MetricsLog.write
    calls = {"n": 0}

    def fill_up(self, record):
        calls["n"] += 1
        if calls["n"] == 3 and self._file is not None:
            real_file = self._file

            class Full:
                name = real_file.name

                def write(self, text):
                    raise OSError(errno.ENOSPC, "No space left on device")

                def close(self):
                    real_file.close()

            self._file = Full()
        return real_write(self, record)

    monkeypatch.setattr(trainer_module.MetricsLog, "write", fill_up)
    rc = main(["train", "--config", str(TINY), "--no-progress", "--output-dir", str(tmp_path / "run"),
               "--set", "train.log_every_steps=1", "--max-steps", "5"])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert "No space left on device (writing the metrics log): " in err and str(tmp_path / "run" / "metrics.jsonl") in err


def test_training_whose_output_reader_goes_away_says_where_it_stopped(tmp_path):
    """`neorec train | head` (or a dying tee): the run stopped with exit 1 and not a word."""
    import sys

    command = (f"{shlex.quote(sys.executable)} -m neorec train --config {shlex.quote(str(TINY))} "
               f"--output-dir {shlex.quote(str(tmp_path / 'run'))} --set train.epochs=50 "
               f"--set checkpoint.dir={shlex.quote(repr(str(tmp_path / 'ckpt')))} --set checkpoint.every_steps=5 "
               f"2>{shlex.quote(str(tmp_path / 'err.txt'))} | head -c 200 >/dev/null")
    subprocess.run(["bash", "-c", command], cwd=ROOT, timeout=300)
    err = (tmp_path / "err.txt").read_text()
    assert "standard output was closed (its reader went away); stopped after step " in err, err


def test_an_unwritable_ssd_folder_names_its_setting(tmp_path, capsys):
    """It was a bare "[Errno 13] Permission denied: '.../ssd'" (or "Not a directory")."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert main(["train", "--config", str(ROOT / "configs" / "tiny_cached_ssd.toml"), "--max-steps", "1",
                 "--output-dir", str(tmp_path / "run"), "--set", f"embedding.location.ssd_dir='{blocker / 'ssd'}'"]) == 2
    err = capsys.readouterr().err
    assert f"embedding.location.ssd_dir '{blocker / 'ssd'}' is not a writable directory" in err, err


def test_set_of_a_section_keeps_the_files_other_keys(capsys):
    assert main(["config", "--config", str(TINY), "--set", "train={max_steps=5}"]) == 0
    train = json.loads(capsys.readouterr().out)["train"]
    assert (train["max_steps"], train["log_every_steps"], train["output_dir"]) == (5, 20, "runs/tiny")


def test_set_messages_for_values_that_are_not_toml_or_not_strings(capsys):
    assert main(["config", "--set", "model.dense_layers=[16,"]) == 2
    err = capsys.readouterr().err
    assert "config key 'model.dense_layers' must be a list of int, got '[16,', which is not valid TOML (" in err
    assert "dense_layers[0]" not in err
    assert main(["config", "--set", "train.output_dir=2024-01-01"]) == 2
    err = capsys.readouterr().err
    assert err.rstrip().endswith("quote it: --set train.output_dir='\"2024-01-01\"'"), err
    hint = shlex.split(err.rsplit("quote it: ", 1)[1])  # the suggestion works as given
    assert main(["config", *hint]) == 0
    assert json.loads(capsys.readouterr().out)["train"]["output_dir"] == "2024-01-01"


def test_preprocess_criteo_prints_a_command_that_works_in_a_shell(tmp_path, capsys, monkeypatch):
    """Paths that TOML would read as a number (`123`) or that hold spaces and quotes: the printed
    command quotes them as TOML strings, then for the shell."""
    monkeypatch.chdir(tmp_path)
    tsv = "it's a \"day\" 0.tsv"
    assert main(["data", "write-criteo", tsv, "--lines", "600"]) == 0
    assert main(["data", "preprocess-criteo", tsv, "123", "--num-embeddings", "1000"]) == 0
    command = capsys.readouterr().out.splitlines()[-1]
    prefix = "train on it with: neorec "
    assert command.startswith(prefix)
    args = shlex.split(command[len(prefix):])
    shell = subprocess.run(["bash", "-c", "printf '%s\\0' " + command[len(prefix):]], capture_output=True,
                           text=True, timeout=30, check=True)
    assert shell.stdout.split("\0")[:-1] == args  # the shell reads the words shlex does
    assert args[:3] == ["train", "--config", "configs/criteo.toml"]
    rc = main(["train", "--config", str(ROOT / "configs" / "criteo.toml"), *args[3:], "--no-progress",
               "--output-dir", str(tmp_path / "run"), "--set", "train.max_steps=2",
               "--set", "data.batch_size=64", "--set", "data.eval_batch_size=64"])
    assert rc == 0, capsys.readouterr().err
    cfg = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (cfg["data"]["criteo"]["train_path"], cfg["data"]["criteo"]["processed_dir"]) == (tsv, "123")
    assert (tmp_path / "123" / "train").is_dir() and not (tmp_path / f"{tsv}.neorec").exists()
    assert 'data.criteo.processed_dir="123"' in args and f"data.criteo.train_path={json.dumps(tsv)}" in args


def test_a_resume_that_names_no_checkpoint_is_refused_before_the_model_is_built(tmp_path, capsys, monkeypatch):
    """A file or a folder without checkpoints: said after the model's build (minutes for a large one)."""
    import neorec.train.trainer as trainer_module

    def no_build(*args, **kwargs):
        raise AssertionError("built a model for a --resume that names no checkpoint")

    monkeypatch.setattr(trainer_module, "Trainer", no_build)
    afile, empty = tmp_path / "afile", tmp_path / "empty"
    afile.write_text("")
    empty.mkdir()
    for nproc in ([], ["--nproc", "2"]):
        assert main(["train", "--config", str(TINY), *nproc, "--resume", str(afile)]) == 2
        assert capsys.readouterr().err == (f"neorec train: error: --resume: {afile} is a file; give a checkpoint "
                                           "folder (checkpoint.dir, or one step-N folder in it)\n")
    assert main(["train", "--config", str(TINY), "--resume", str(empty)]) == 2
    assert f"no complete checkpoint in {empty}: it holds no step-N folders" in capsys.readouterr().err


def test_a_refused_run_leaves_no_empty_folders_behind(tmp_path, capsys, monkeypatch):
    """Each refusal after the output folder was made left it (and its parents) holding a lock file."""
    import neorec.train.build as build

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    out = tmp_path / "new" / "runs" / "one"
    assert main(["train", "--config", str(TINY), "--output-dir", str(out), "--set", f"checkpoint.dir='{blocker}'",
                 "--set", "checkpoint.every_steps=1"]) == 2
    assert "checkpoint.dir" in capsys.readouterr().err and not (tmp_path / "new").exists()
    kept = tmp_path / "kept"  # a folder that was there before is never removed
    kept.mkdir()
    assert main(["train", "--config", str(TINY), "--output-dir", str(kept), "--set", f"checkpoint.dir='{blocker}'",
                 "--set", "checkpoint.every_steps=1"]) == 2
    assert kept.is_dir()
    through = f"{tmp_path}/made/../kept/out"  # resolved as the system does: kept/out and made, never kept
    assert main(["train", "--config", str(TINY), "--output-dir", through, "--set", f"checkpoint.dir='{blocker}'",
                 "--set", "checkpoint.every_steps=1"]) == 2
    assert kept.is_dir() and not (kept / "out").exists() and not (tmp_path / "made").exists()
    ssd = tmp_path / "ssd_parent" / "ssd"  # the SSD stores' folder too, made before the model is refused
    monkeypatch.setattr(build, "_machine_memory_bytes", lambda: 1000)
    assert main(["train", "--config", str(ROOT / "configs" / "tiny_cached_ssd.toml"), "--output-dir", str(out),
                 "--set", f"embedding.location.ssd_dir='{ssd}'"]) == 2
    assert "the model does not fit in memory" in capsys.readouterr().err
    assert not (tmp_path / "new").exists() and not (tmp_path / "ssd_parent").exists()


def test_version_names_neorec_python_and_torch(capsys):
    import platform

    import torch

    import neorec

    with pytest.raises(SystemExit) as exit:
        main(["--version"])
    assert exit.value.code == 0
    assert capsys.readouterr().out == (f"neorec {neorec.__version__} (Python {platform.python_version()}, "
                                       f"torch {torch.__version__})\n")
