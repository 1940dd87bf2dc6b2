"""MovieLens-100k as click data, read from ../shared/data/ml-100k."""

from pathlib import Path

import numpy as np
import pytest
import torch

from neorec.data import DataConfig, MovieLensConfig, make_data_source
from neorec.data.movielens import FEATURES, MovieLensSource

ML100K = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "ml-100k"
pytestmark = pytest.mark.skipif(not ML100K.is_dir(), reason=f"MovieLens-100k not found at {ML100K}")


@pytest.fixture(scope="module")
def source():
    return make_data_source(DataConfig(source="movielens", movielens=MovieLensConfig(path=str(ML100K))))


def test_counts_and_tables(source):
    assert isinstance(source, MovieLensSource) and source.name == "movielens"
    assert source.num_train_samples() + source.num_eval_samples() == 100_000
    # 20% is 20,000; the cut moves back to the first of its timestamp's 4 interactions (1 had been in training)
    assert source.num_eval_samples() == 20_001
    assert source.feature_names == FEATURES
    tables = {t.feature_names[0]: t for t in source.tables(embedding_dim=8)}
    assert tables["user"].num_embeddings == 943 + 1 and tables["item"].num_embeddings == 1682 + 1
    assert tables["gender"].num_embeddings == 3 and tables["occupation"].num_embeddings == 22
    assert tables["genres"].num_embeddings == 19 + 1 and tables["age"].num_embeddings == 7 + 1
    assert tables["genres"].name == "t_genres"


def test_temporal_split(source):
    assert source.train_timestamps().max() < source.eval_timestamps().min()  # no timestamp on both sides
    assert np.all(np.diff(source.train_timestamps()) >= 0)


def test_batches_shapes_ranges_and_labels(source):
    sizes = {t.feature_names[0]: t.num_embeddings for t in source.tables(4)}
    labels = []
    for batch in source.eval_batches(4096):
        kjt = batch.sparse
        kjt.validate()
        assert kjt.keys() == FEATURES and kjt.values.dtype == torch.int64 and kjt.weights is None
        assert batch.dense.shape == (batch.batch_size, source.num_dense) and batch.dense.dtype == torch.float32
        assert torch.isfinite(batch.dense).all()
        for key in FEATURES:
            jt = kjt[key]
            assert int(jt.values.min()) >= 0 and int(jt.values.max()) < sizes[key], key
            if key != "genres":
                assert torch.all(jt.lengths == 1), key
        labels.append(batch.labels)
    labels = torch.cat(labels)
    assert labels.numel() == 20_001 and set(labels.unique().tolist()) == {0.0, 1.0}
    train_rate = torch.cat([b.labels for b in source.train_batches(8192)]).mean()
    assert 0.5 < float(train_rate) < 0.6  # ratings 4 and 5 are 55% of the 100k ratings


def test_genres_multi_hot(source):
    genres = source.vocabularies["genres"]
    batch = next(source.train_batches(2000))
    bags = batch.sparse["genres"].to_list()
    assert max(len(b) for b in bags) >= 3 and min(len(b) for b in bags) >= 1
    assert all(len(set(b)) == len(b) for b in bags)
    # Toy Story (item "1"): Animation, Children's, Comedy
    toy_story = source.vocabularies["item"]["1"]
    for batch in source.train_batches(10_000):
        items = batch.sparse["item"].values
        if (items == toy_story).any():
            row = int(torch.nonzero(items == toy_story)[0])
            break
    expected = sorted(genres[g] for g in ("Animation", "Children's", "Comedy"))
    assert sorted(batch.sparse["genres"].to_list()[row]) == expected


def test_shuffled_per_epoch_deterministically(source):
    def users(epoch, start_batch=0):
        return torch.cat([b.sparse["user"].values for b in source.train_batches(10_000, epoch, start_batch)])

    first = users(0)
    assert torch.equal(first, users(0)) and not torch.equal(first, users(1))
    assert torch.equal(torch.sort(first).values, torch.sort(users(1)).values)
    assert torch.equal(users(1, start_batch=3), users(1)[30_000:])

