"""Input files and folders of the data sources that are missing, of the wrong kind, or hold no
rows: said by the setting, and no processed copy left behind."""

import pytest

from neorec.data import DataConfig
from neorec.data.config import CriteoConfig, MovieLensConfig
from neorec.data.criteo import CriteoSource, preprocess_criteo, write_criteo_tsv

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
