"""Input files and folders of the data sources that are missing, of the wrong kind, or hold no
rows: said by the setting, and no processed copy left behind."""

import pytest

from neorec.data import DataConfig
from neorec.data.config import CriteoConfig, MovieLensConfig, check_processed_dir
from neorec.data.criteo import CriteoSource, preprocess_criteo, write_criteo_tsv
from tests.read_only import refuse_writes_in

ROWS = 1000


def test_a_criteo_path_that_is_a_directory_is_said_to_be_one(tmp_path):
    folder = tmp_path / "somedir"
    folder.mkdir()
    for key in ("train_path", "eval_path"):
        train = str(folder) if key == "train_path" else str(tmp_path / "t.tsv")
        (tmp_path / "t.tsv").write_text("")
        cfg = DataConfig(source="criteo", criteo=CriteoConfig(train_path=train, **(
            {"eval_path": str(folder)} if key == "eval_path" else {})))
        with pytest.raises(IsADirectoryError) as info:
            cfg.check_inputs_exist()
        assert str(info.value) == f"{folder} is a directory, not a Criteo TSV file (data.criteo.{key}); " \
                                  "give the path of a TSV file"
    with pytest.raises(IsADirectoryError, match=r"somedir is a directory, not a Criteo TSV file "
                                                r"\(data.criteo.train_path\)"):
        CriteoSource(CriteoConfig(train_path=str(folder)))
    assert not (tmp_path / "somedir.neorec").exists()
    with pytest.raises(IsADirectoryError, match="somedir is a directory, not a Criteo TSV file"):
        preprocess_criteo(folder, tmp_path / "p", ROWS)


def test_a_missing_criteo_eval_file_suggests_a_held_out_one(tmp_path):
    (tmp_path / "t.tsv").write_text("")
    missing = tmp_path / "e.tsv"
    cfg = DataConfig(source="criteo", criteo=CriteoConfig(train_path=str(tmp_path / "t.tsv"), eval_path=str(missing)))
    with pytest.raises(FileNotFoundError) as info:
        cfg.check_inputs_exist()
    assert str(info.value) == f"Criteo TSV file not found: {missing} (data.criteo.eval_path; `neorec data " \
                              f"write-criteo {missing} --held-out` writes learnable synthetic data in its layout)"


def test_a_movielens_path_that_is_a_file_is_said_to_be_one(tmp_path):
    afile = tmp_path / "u.data"
    afile.write_text("")
    with pytest.raises(NotADirectoryError) as info:
        DataConfig(source="movielens", movielens=MovieLensConfig(path=str(afile))).check_inputs_exist()
    assert str(info.value) == f"MovieLens path {afile} is a file, not a directory (data.movielens.path): give " \
                              "the directory that holds the dataset's files"
    with pytest.raises(FileNotFoundError, match="MovieLens directory not found: "):
        DataConfig(source="movielens", movielens=MovieLensConfig(path=str(tmp_path / "no"))).check_inputs_exist()


def test_a_read_only_copy_is_used_while_fresh_and_named_when_it_must_be_rebuilt(tmp_path, monkeypatch):
    """Rebuilding a stale copy in a folder that cannot be written said "[Errno 13] Permission
    denied: '.../train/.dense.f32.tmp-4807'", one of its temporaries."""
    path = tmp_path / "t.tsv"
    write_criteo_tsv(path, 200, seed=1)
    cfg = CriteoConfig(train_path=str(path), processed_dir=str(tmp_path / "p"), num_embeddings=ROWS)
    assert CriteoSource(cfg).num_train_samples() == 180
    with monkeypatch.context() as patch:
        refuse_writes_in(patch, tmp_path / "p" / "train")
        assert CriteoSource(cfg).num_train_samples() == 180  # fresh: read, nothing written
        with pytest.raises(ValueError) as info:
            CriteoSource(CriteoConfig(train_path=str(path), processed_dir=str(tmp_path / "p"), num_embeddings=2 * ROWS))
    assert str(info.value) == f"cannot write in {tmp_path / 'p' / 'train'}, the folder of the processed copy " \
                              "(data.criteo.processed_dir): Permission denied"
    assert CriteoSource(cfg).num_train_samples() == 180  # the copy is as it was


def test_check_processed_dir_makes_nothing(tmp_path):
    check_processed_dir(tmp_path / "a" / "b" / "train")
    check_processed_dir(tmp_path)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match=r"cannot make .*f/b/train, the folder of the processed copy \(X\): "
                                         r".*f is a file, not a directory"):
        check_processed_dir(tmp_path / "f" / "b" / "train", "X")
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=r"link is not a directory"):
        check_processed_dir(tmp_path / "link" / "train", "X")


@pytest.mark.parametrize("content,why", [("", "empty"), ("a,b,c\n1,2,3\n", "its 2 lines are all malformed")])
def test_a_training_file_without_rows_is_refused_and_its_copy_removed(tmp_path, content, why):
    """The source said "has no training rows" and kept the 0-row copy (meta.json, dense.f32, ...)."""
    path = tmp_path / "empty.tsv"
    path.write_text(content)
    cfg = CriteoConfig(train_path=str(path), processed_dir=str(tmp_path / "p"), num_embeddings=ROWS,
                       skip_malformed=True)
    for _ in range(2):
        with pytest.raises(ValueError) as info:
            CriteoSource(cfg)
        assert str(info.value) == f"Criteo data {path} holds no rows ({why}): nothing to train on " \
                                  "(data.criteo.train_path)"
        assert [p.name for p in (tmp_path / "p").iterdir()] == ["train.lock"]


def test_an_eval_file_without_rows_is_refused_and_its_copy_removed(tmp_path):
    train, empty = tmp_path / "t.tsv", tmp_path / "e.tsv"
    write_criteo_tsv(train, 200, seed=1)
    empty.write_text("")
    with pytest.raises(ValueError) as info:
        CriteoSource(CriteoConfig(train_path=str(train), eval_path=str(empty), processed_dir=str(tmp_path / "p"),
                                  num_embeddings=ROWS))
    assert str(info.value).startswith(f"Criteo eval data {empty} holds no rows (empty): give data.criteo.eval_path "
                                      "a non-empty TSV file"), info.value
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == ["eval.lock", "train", "train.lock"]


def test_a_training_share_of_no_rows_names_eval_fraction(tmp_path):
    one = tmp_path / "one.tsv"
    write_criteo_tsv(one, 1, seed=1)
    with pytest.raises(ValueError, match=r"eval_fraction 0.6 of its 1 rows leaves no training rows: lower "
                                         r"data.criteo.eval_fraction"):
        CriteoSource(CriteoConfig(train_path=str(one), num_embeddings=ROWS, eval_fraction=0.6))
