import json
from pathlib import Path

import pytest

from neorec.config import Config, config_from_dict, iter_config_keys, load_config, parse_override

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def test_defaults_and_overrides():
    cfg = load_config(None, ["train.max_steps=7", "data.synthetic.num_embeddings=[5, 6]",
                             "model.interaction=dcn", "embedding.optimizer.learning_rate=0.5"])
    assert cfg.train.max_steps == 7
    assert cfg.data.synthetic.num_embeddings == [5, 6]
    assert cfg.model.interaction == "dcn"
    assert cfg.embedding.optimizer.learning_rate == 0.5
    assert isinstance(cfg.embedding.optimizer.learning_rate, float)


def test_parse_override_types():
    assert parse_override("a.b=1") == (["a", "b"], 1)
    assert parse_override("a.b=true") == (["a", "b"], True)
    assert parse_override('a.b="x y"') == (["a", "b"], "x y")
    assert parse_override("a.b=plain") == (["a", "b"], "plain")
    with pytest.raises(ValueError, match="section.key=value"):
        parse_override("novalue")


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.nope=1", "unknown config key 'model.nope'"),
        ("train.max_step=1", "unknown config key 'train.max_step'.*did you mean 'train.max_steps'"),
        ("train.checkpoint.dir=x", "unknown config key 'train.checkpoint'.*did you mean 'checkpoint'"),
        ("data.criteo.path=x", "did you mean 'data.criteo.eval_path' or 'data.criteo.train_path' or "
                               "'data.movielens.path'"),  # only the MovieLens key was named
        ("train.steps=3", "did you mean 'train.max_steps' or"),  # the closest first
        ("embedding.optimizer.lr=0.1", "did you mean 'embedding.optimizer.learning_rate'"),  # other tools' names
        ("model.dim=8", "did you mean 'model.embedding_dim'"),
        ("train.max_steps.x=5", "'train.max_steps' is a value, not a section"),  # was "must be an integer, got {'x': 5}"
        ("nosection.x=1", "unknown config key 'nosection'"),
        ("train.max_steps=1.5", "'train.max_steps' must be an integer"),
        ("train.progress=3", "must be true or false"),
        ("model.interaction=cross", "model.interaction must be one of"),
        ("embedding.optimizer.kind=lamb", "embedding.optimizer: sparse optimizer must be one of"),
        ("embedding.storage.precision=fp8", "embedding.storage: precision must be one of"),
        ("embedding.location.ways=0", "embedding.location.ways must be > 0"),  # was "embedding.location.default: ways"
        ("embedding.location.resident_budget_mb=0", "embedding.location.resident_budget_mb must be > 0"),
        ("data.source=kaggle", "data.source must be one of"),
        ("model.dense_layers=[64, 8]", "must end in model.embedding_dim"),
        ('model.pooling="max"', r"model.pooling must be one of \('sum', 'mean'\), got 'max'"),
        ("model.dcn_low_rank=-2", "model.dcn_low_rank must be >= 0, got -2"),
        ("model.dcn_num_layers=-1", "model.dcn_num_layers must be >= 0, got -1"),
        ("dense_optimizer.learning_rate=inf", "dense_optimizer.learning_rate must be finite and > 0, got inf"),
        ("dense_optimizer.eps=-1e-8", "dense_optimizer.eps must be finite and >= 0, got -1e-08"),
        ("dense_optimizer.weight_decay=-0.1", "dense_optimizer.weight_decay must be finite and >= 0, got -0.1"),
        ("dense_optimizer.weight_decay=nan", "dense_optimizer.weight_decay must be finite and >= 0, got nan"),
        # values that passed the load and failed deep in training, naming no key
        ("data.synthetic.num_embeddings=99999999999999999999", "'data.synthetic.num_embeddings\\[0\\]' must fit in 64 bits"),
        ("data.synthetic.num_embeddings=9223372036854775807", r"num_embeddings must hold values in \[1, 2\*\*48\]"),
        ("data.criteo.num_embeddings=1000000000000000", r"data.criteo.num_embeddings must be in \[2, 2\*\*48\]"),
        ("data.synthetic.pooling=inf", "pooling must be finite and >= 1"),
        ("data.synthetic.label_noise=inf", "label_noise must be finite and > 0"),
        ("data.movielens.min_rating_positive=nan", "min_rating_positive must be a finite rating"),
        ("train.seed=18446744073709551616", "'train.seed' must fit in 64 bits"),
        ("embedding.storage.seed=18446744073709551616", "'embedding.storage.seed' must fit in 64 bits"),
        ("embedding.optimizer.learning_rate=1" + "0" * 400, "'embedding.optimizer.learning_rate' must be a number "
                                                            "within the float range, got an integer of 401 digits"),
        ("embedding.optimizer.eps=0", r"sparse optimizer eps must be > 0 for rowwise_adagrad \(or "
                                      r"initial_accumulator_value > 0\).*0 / 0 = NaN"),
        ("dense_optimizer.eps=0", "dense_optimizer.eps must be > 0 for adagrad"),
    ],
)
def test_bad_values_are_clear_errors(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [override])


def test_model_choices_and_ranges_are_checked_with_the_config(tmp_path):
    """Values the model build would reject stop the run at config time, naming the key and the
    --set or file that gave them (not a table or DCNInteraction error at model build)."""
    with pytest.raises(ValueError, match=r"model.pooling must be one of .*got 'max' \(from --set model.pooling=\"max\"\)$"):
        load_config(None, ["train.max_steps=3", 'model.pooling="max"'])
    with pytest.raises(ValueError, match=r"model.dcn_low_rank must be >= 0, got -2 \(from --set model.dcn_low_rank=-2\)$"):
        load_config(None, ["model.interaction=dcn", "model.dcn_low_rank=-2"])
    p = tmp_path / "dcn.toml"
    p.write_text("[model]\ninteraction = \"dcn\"\ndcn_num_layers = -1\n")
    with pytest.raises(ValueError, match=r"model.dcn_num_layers must be >= 0, got -1 \(in .*dcn.toml\)$"):
        load_config(p)
    p.write_text("[model]\nself_interaction = true\n")
    assert load_config(p).model.self_interaction  # fine with "dot"
    with pytest.raises(ValueError, match=r"model.self_interaction applies only to model.interaction = 'dot'.*"
                                         r"\(from --set model.interaction=dcn\)$"):
        load_config(p, ["model.interaction=dcn"])
    cfg = load_config(None, ['model.pooling="mean"', "model.interaction=dcn", "model.dcn_num_layers=0",
                             "model.dcn_low_rank=4", "dense_optimizer.kind='sgd'", "dense_optimizer.eps=0",
                             "dense_optimizer.weight_decay=0.01"])  # eps = 0: fine where it divides nothing
    assert (cfg.model.pooling, cfg.model.dcn_num_layers, cfg.model.dcn_low_rank) == ("mean", 0, 4)


def test_unknown_key_in_file_names_the_file(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("[train]\nmax_step = 3\n")
    with pytest.raises(ValueError, match=r"unknown config key 'train.max_step'.*bad.toml"):
        load_config(p)
    with pytest.raises(ValueError, match="not found"):
        load_config(tmp_path / "missing.toml")
    p.write_text("[train]\nmax_steps = 3\n")  # a valid file: a bad --set is blamed, not the file
    with pytest.raises(ValueError, match=r"unknown config key 'train.checkpoint'.*\(from --set train.checkpoint.dir=x\)$"):
        load_config(p, ["train.max_steps=4", "train.checkpoint.dir=x"])
    with pytest.raises(ValueError, match=r"\(from --set novalue\)$"):
        load_config(p, ["novalue"])
    p.write_text("[train\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_config(p)


def test_every_config_file_validates():
    files = sorted(CONFIG_DIR.glob("*.toml"))
    assert len(files) >= 4
    for path in files:
        cfg = load_config(path)
        assert isinstance(cfg, Config), path


def test_default_toml_equals_builtin_defaults():
    assert load_config(CONFIG_DIR / "default.toml").to_dict() == Config().to_dict()


def test_default_toml_lists_every_key():
    """It is the reference of the keys: sections it left out (location, comm, criteo, movielens,
    checkpoint) could only be found in the code."""
    import tomllib

    from neorec.config import iter_config_keys

    values = tomllib.loads((CONFIG_DIR / "default.toml").read_text())
    for key, _, _ in iter_config_keys():
        node = values
        for part in key.split("."):
            assert part in node, f"configs/default.toml lacks {key}"
            node = node[part]


def test_config_round_trip_through_dict():
    cfg = load_config(None, ["train.seed=3"])
    assert config_from_dict(cfg.to_dict()).to_dict() == cfg.to_dict()


def test_iter_config_keys_lists_leaves():
    keys = {k for k, _, _ in iter_config_keys()}
    assert {"train.max_steps", "data.synthetic.zipf_alpha", "embedding.storage.precision"} <= keys


def test_train_help_describes_every_config_key(capsys):
    """`neorec train --help` listed every key with its type and default but explained none (38
    keys, among them embedding.location.background_prefetch and data.prefetch_batches, were
    explained nowhere outside the code)."""
    from neorec.cli import main
    from neorec.config_help import config_key_docs

    docs = config_key_docs()
    assert set(docs) == {key for key, _, _ in iter_config_keys()}
    assert [key for key, text in docs.items() if len(text) < 10] == []
    assert docs["embedding.optimizer.beta2"] == docs["embedding.optimizer.beta1"]  # "beta1, beta2: ..."
    assert docs["embedding.location.ways"].startswith("slots per set")  # TableLocation's, shared
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.split()[:1] == ["data.prefetch_batches"])
    assert lines[at + 1].strip().startswith("batches a background thread prepares ahead")


def test_set_of_a_whole_section_merges_into_it():
    """`--set train={max_steps=5}` sets that key and keeps the file's other [train] values (it used
    to replace the section, so they went back to the defaults without a word)."""
    cfg = load_config(CONFIG_DIR / "tiny.toml", ["train={max_steps=5}",
                                                 "data={synthetic={num_dense=2}, batch_size=64}"])
    assert cfg.train.max_steps == 5
    assert (cfg.train.log_every_steps, cfg.train.output_dir) == (20, "runs/tiny")  # from the file
    assert (cfg.data.synthetic.num_dense, cfg.data.batch_size) == (2, 64)
    assert cfg.data.synthetic.num_embeddings == [500, 1000, 2000, 300] and cfg.data.eval_batch_size == 2048
    assert load_config(None, ["train={max_steps=5}"]).train.log_every_steps == 50  # no file: defaults
    with pytest.raises(ValueError, match=r"'train.max_steps' must be an integer.*\(from --set train=\{max_steps=1.5\}\)"):
        load_config(CONFIG_DIR / "tiny.toml", ["train={max_steps=1.5}"])


def test_set_value_that_is_not_toml_says_so():
    with pytest.raises(ValueError, match=r"^config key 'model.dense_layers' must be a list of int, got '\[16,', "
                                         r"which is not valid TOML \(.+\) \(from --set model.dense_layers=\[16,\)$"):
        load_config(None, ["model.dense_layers=[16,"])
    with pytest.raises(ValueError, match=r"'train.max_steps' must be an integer, got 'x', which is not valid TOML"):
        load_config(None, ["train.max_steps=x"])
    with pytest.raises(ValueError, match=r"'train' must be a table \(\[train\]\), got '\{max_steps=5', which is not valid TOML"):
        load_config(None, ["train={max_steps=5"])
    cfg = load_config(None, ["data.source=movielens", "train.output_dir=runs/a b"])  # bare words: strings
    assert (cfg.data.source, cfg.train.output_dir) == ("movielens", "runs/a b")
    assert type(cfg.train.output_dir) is str
    tables = load_config(None, ["embedding.location.tables.t_a=cached_dram"]).embedding.location.tables
    assert tables == {"t_a": "cached_dram"} and type(tables["t_a"]) is str


def test_non_string_set_for_a_string_key_suggests_quoting(tmp_path):
    with pytest.raises(ValueError, match=r"^config key 'train.output_dir' must be a string, got datetime.date\(2024, 1, 1\) "
                                         r"\(from --set train.output_dir=2024-01-01\); to give it as a string, "
                                         r"quote it: --set train.output_dir='\"2024-01-01\"'$"):
        load_config(None, ["train.seed=1", "train.output_dir=2024-01-01"])
    with pytest.raises(ValueError, match=r"quote it: --set data.criteo.processed_dir='\"123\"'$"):
        load_config(None, ["data.criteo.processed_dir=123"])
    assert load_config(None, ['train.output_dir="2024-01-01"']).train.output_dir == "2024-01-01"
    p = tmp_path / "date.toml"
    p.write_text("[train]\noutput_dir = 2024-01-01\n")
    with pytest.raises(ValueError, match=r"must be a string, got datetime.date\(2024, 1, 1\) \(in .*date.toml\)$"):
        load_config(p)  # from a file: no --set to quote


def test_data_keys_that_disagree_are_config_errors_naming_the_set(tmp_path):
    """num_tables and the length of num_embeddings are checked once every --set is in (so they may
    change one at a time), at load time for the CLI (check_data=True), naming the --set like any
    config error (they used to be found when the data source was built, naming no --set)."""
    tiny = CONFIG_DIR / "tiny.toml"
    with pytest.raises(ValueError, match=r"data.synthetic.num_embeddings must hold one value .* or num_tables = 2 "
                                         r"values, got 4: .* \(from --set data.synthetic.num_tables=2\)$"):
        load_config(tiny, ["train.seed=2", "data.synthetic.num_tables=2"], check_data=True)
    cfg = load_config(tiny, ["data.synthetic.num_tables=2", "data.synthetic.num_embeddings=[5, 6]"], check_data=True)
    assert cfg.data.synthetic.table_sizes() == [5, 6]
    cfg = load_config(tiny, ["data.synthetic.num_tables=2", "data.synthetic.num_embeddings=7"], check_data=True)
    assert cfg.data.synthetic.table_sizes() == [7, 7]
    cfg = load_config(tiny, ["data.synthetic.num_tables=2", "data.source=movielens"], check_data=True)
    assert cfg.data.source == "movielens"  # the synthetic keys are not used
    with pytest.raises(ValueError, match=r"data.criteo.train_path is empty.*\(from --set data.source=criteo\)$"):
        load_config(None, ["data.source=criteo"], check_data=True)
    p = tmp_path / "bad.toml"
    p.write_text("[data.synthetic]\nnum_tables = 3\nnum_embeddings = [1, 2]\n")
    with pytest.raises(ValueError, match=r"or num_tables = 3 values, got 2: \[1, 2\] \(in .*bad.toml\)$"):
        load_config(p, check_data=True)
    assert load_config(p).data.synthetic.num_tables == 3  # without check_data: left to the data source


def test_location_table_names_are_checked_at_load_time_against_the_sources_tables():
    """embedding.location.tables naming a table the data source does not make was found only when
    the model was built, in a message naming no --set."""
    tiny = CONFIG_DIR / "tiny.toml"
    with pytest.raises(ValueError, match=r"names \['t_feature_4'\], which are not tables of this model; tables are "
                                         r"\['t_feature_0', .*'t_feature_3'\] \(from --set embedding.location.tables="):
        load_config(tiny, ['embedding.location.tables={t_feature_4="cached_dram"}'], check_data=True)
    ok = load_config(tiny, ["data.synthetic.num_tables=5", "data.synthetic.num_embeddings=9",
                            'embedding.location.tables={t_feature_4="cached_dram"}'], check_data=True)
    assert ok.embedding.location.tables == {"t_feature_4": "cached_dram"}
    with pytest.raises(ValueError, match=r"names \['t_feature_0'\].*tables are \['t_user', 't_item', .*"
                                         r"\(from the --set overrides together\)$"):
        load_config(None, ['embedding.location.tables={t_feature_0="cached_dram"}', "data.source=movielens"],
                    check_data=True)
    cfg = load_config(None, ["data.source=criteo", "data.criteo.train_path='x.tsv'",
                             'embedding.location.tables={t_cat_25="cached_dram"}'], check_data=True)
    assert cfg.data.table_names() == [f"t_cat_{i}" for i in range(26)]


def test_the_tables_a_config_names_are_those_its_source_makes(tmp_path):
    """DataConfig.table_names (known before any data is read) against the built sources' tables."""
    from neorec.data.criteo_tsv import write_criteo_tsv
    from neorec.data.source import make_data_source

    cfg = load_config(CONFIG_DIR / "tiny.toml", ["data.synthetic.num_tables=3", "data.synthetic.num_embeddings=7"])
    assert cfg.data.table_names() == [t.name for t in make_data_source(cfg.data).tables(8)]
    assert cfg.data.table_names() == ["t_feature_0", "t_feature_1", "t_feature_2"]
    write_criteo_tsv(tmp_path / "day.tsv", 50)
    criteo = load_config(None, ["data.source='criteo'", f"data.criteo.train_path='{tmp_path / 'day.tsv'}'"])
    assert criteo.data.table_names() == [t.name for t in make_data_source(criteo.data).tables(8)]


def test_config_docstring_names_every_section():
    sections = {key.rsplit(".", 1)[0] for key, _, _ in iter_config_keys() if "." in key}
    sections -= {"embedding.location.tables"}
    doc = " ".join(Config.__doc__.split())
    assert sorted(s for s in sections if f"[{s}]" not in doc) == []


def test_toml_string_reads_back_as_the_same_text():
    from neorec.config import toml_string

    for text in ["plain", "a b", "123", "2024-01-01", "it's \"quoted\" \\ back", "new\nline\ttab\x7f\x00", "ü 😀"]:
        assert parse_override(f"k={toml_string(text)}") == (["k"], text)


def test_set_of_a_key_that_holds_a_table_replaces_it():
    """`--set embedding.location.tables={}` was merged into the file's table: a per-table location
    could not be removed or replaced from the command line, silently."""
    path = "configs/tiny_cached_ssd.toml"
    assert load_config(path).embedding.location.tables  # the file names some tables
    assert load_config(path, ["embedding.location.tables={}"]).embedding.location.tables == {}
    replaced = load_config(path, ["embedding.location.tables={t_feature_1='dram'}"]).embedding.location.tables
    assert replaced == {"t_feature_1": "dram"}
    # a section is still merged key by key, and a table-valued key inside it replaced
    assert load_config(path, ["embedding.location={ways=4}"]).embedding.location.tables == \
        load_config(path).embedding.location.tables
    assert load_config(path, ["embedding.location={tables={t_feature_1='dram'}}"]).embedding.location.tables \
        == {"t_feature_1": "dram"}


def test_eps_zero_is_fine_where_nothing_divides_by_it():
    cfg = load_config(None, ["embedding.optimizer.kind='sgd'", "embedding.optimizer.eps=0"])
    assert cfg.embedding.optimizer.eps == 0
    cfg = load_config(None, ["embedding.optimizer.kind='adagrad'", "embedding.optimizer.eps=0",
                             "embedding.optimizer.initial_accumulator_value=0.1"])
    assert cfg.embedding.optimizer.eps == 0


def test_a_runs_config_json_is_a_config_file(tmp_path):
    """`neorec train --config runs/x/config.json` was refused as "not valid TOML": the one file that
    holds a run's whole config could not be given back to rerun it."""
    cfg = load_config("configs/tiny.toml", ["train.max_steps=7", "train.seed=3"])
    path = tmp_path / "config.json"
    path.write_text(cfg.to_json())
    assert load_config(path) == cfg
    assert load_config(path, ["train.max_steps=9"]).train.max_steps == 9
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object of sections, got list"):
        load_config(path)
    path.write_text("{nope")
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_config(path)


@pytest.mark.parametrize("setting, said", [("checkpoint.every_steps=10", "checkpoint.every_steps = 10"),
                                           ("checkpoint.incremental=true", "checkpoint.incremental = true"),
                                           ("checkpoint.row_bits=8", "checkpoint.row_bits = 8")])
def test_checkpoint_settings_without_a_checkpoint_dir_are_refused(setting, said):
    """They were ignored: a run asked to save every 10 steps, without checkpoint.dir, saved nothing
    and said nothing."""
    with pytest.raises(ValueError, match=rf"{said} but checkpoint.dir is empty, which turns checkpoints off.*"
                                         rf"\(from --set {setting}\)"):
        load_config(None, [setting])
    assert load_config(None, [setting, "checkpoint.dir='ck'"]).checkpoint.dir == "ck"


def test_a_checkpoint_dir_that_nothing_would_be_saved_in_is_refused():
    """checkpoint.dir with every_steps = 0 and save_final = false: the run exited 0 and the folder
    held only its lock."""
    with pytest.raises(ValueError, match=r"checkpoint.dir = 'ck' with checkpoint.every_steps = 0 and "
                                         r"checkpoint.save_final = false: nothing would be saved there"):
        load_config(None, ["checkpoint.dir='ck'", "checkpoint.save_final=false"])
    assert load_config(None, ["checkpoint.dir='ck'", "checkpoint.save_final=false", "checkpoint.every_steps=5"])


def test_a_leading_tilde_in_a_path_key_is_the_home_folder(monkeypatch, tmp_path):
    """No shell expands ~ inside `--set train.output_dir=~/runs` or a TOML string: a folder named
    "~" was made in the working folder while the output named ~/runs."""
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(None, ["train.output_dir=~/runs", "checkpoint.dir='~/ck'", "embedding.location.ssd_dir='~/ssd'",
                             "data.movielens.path='~/ml'", "data.criteo.train_path='~/day_0.tsv'"])
    assert cfg.train.output_dir == str(tmp_path / "runs") and cfg.checkpoint.dir == str(tmp_path / "ck")
    assert cfg.embedding.location.ssd_dir == str(tmp_path / "ssd") and cfg.data.movielens.path == str(tmp_path / "ml")
    assert cfg.data.criteo.train_path == str(tmp_path / "day_0.tsv")
    assert load_config(None, ["train.output_dir='runs/~x'"]).train.output_dir == "runs/~x"  # only a leading ~


def test_a_config_file_that_is_not_utf8_or_starts_with_a_bom(tmp_path):
    """Bytes that are not UTF-8 gave a bare "'utf-8' codec can't decode" naming neither the file
    nor the config; a byte-order mark (Windows editors) gave "Invalid statement at line 1"."""
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"# caf\xe9\n[train]\nepochs = 1\n")
    with pytest.raises(ValueError, match=r"config file '.*bad.toml' is not UTF-8 text: 'utf-8' codec can't decode"):
        load_config(bad)
    bom = tmp_path / "bom.toml"
    bom.write_bytes(b"\xef\xbb\xbf[train]\nepochs = 3\n")
    assert load_config(bom).train.epochs == 3
    bom_json = tmp_path / "bom.json"
    bom_json.write_bytes(b'\xef\xbb\xbf{"train": {"epochs": 4}}')
    assert load_config(bom_json).train.epochs == 4


def test_an_error_of_a_set_is_not_blamed_on_a_file_with_another_error(tmp_path):
    """With a file that has an error of its own, every error was said to be "(in FILE)", also one
    that a --set caused: the user was sent to a file holding the right value."""
    path = tmp_path / "c.toml"
    path.write_text("[model]\nembedding_dim = 16\n[train]\nepochs = -1\n")
    with pytest.raises(ValueError, match=r"epochs.* \(in .*c.toml\)$"):
        load_config(path)
    with pytest.raises(ValueError, match=r"model.embedding_dim must be > 0, got 0 \(from --set model.embedding_dim=0\)$"):
        load_config(path, ["model.embedding_dim=0", "train.max_steps=5"])
    # a --set that fixes the file's error and one that makes another: the second is named
    path.write_text("[model]\nembedding_dim = 0\n")
    with pytest.raises(ValueError, match=r"epochs.* \(from --set train.epochs=-1\)$"):
        load_config(path, ["model.embedding_dim=16", "train.epochs=-1"])


def test_a_sharding_plan_given_as_the_config_is_named_as_one(tmp_path):
    """It said "unknown config key 'world_size'"."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"world_size": 2, "tables": {}}))
    with pytest.raises(ValueError, match=f"config file '{plan}' is a sharding plan \\(from `neorec plan --out`\\), "
                                         f"not a config: give it as --plan {plan}$"):
        load_config(plan)
