"""Synthetic source: shapes, determinism, cheap skip-ahead, Zipf skew, learnable labels."""

import numpy as np
import pytest
import torch

from neorec.data import DataConfig, DataSource, SyntheticConfig, make_data_source
from neorec.data.synthetic import SyntheticSource, ZipfSampler


def auc(scores, labels):
    """Area under the ROC curve by the rank-sum formula (no ties expected)."""
    scores, labels = np.asarray(scores, dtype=np.float64), np.asarray(labels) > 0.5
    ranks = np.empty(scores.size)
    ranks[np.argsort(scores, kind="stable")] = np.arange(1, scores.size + 1)
    pos, neg = labels.sum(), (~labels).sum()
    return (ranks[labels].sum() - pos * (pos + 1) / 2) / (pos * neg)


def small(**kw):
    args = dict(num_tables=3, num_embeddings=[50, 200, 1000], pooling=3.0, max_pooling=6, num_dense=5,
                num_train_samples=1000, num_eval_samples=300, seed=7)
    args.update(kw)
    return SyntheticSource(SyntheticConfig(**args))


def flatten(batches):
    """All batches joined: dense, per-feature id lists, weights, labels."""
    batches = list(batches)
    out = {"dense": torch.cat([b.dense for b in batches]), "labels": torch.cat([b.labels for b in batches])}
    for key in batches[0].sparse.keys():
        out[key] = sum((b.sparse[key].to_list() for b in batches), [])
        if batches[0].sparse.weights is not None:
            out[key + "/w"] = torch.cat([b.sparse[key].weights for b in batches])
    return out


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def test_batches_shapes_dtypes_and_ranges():
    source = small(weighted=True)
    assert isinstance(source, DataSource)
    batches = list(source.train_batches(256))
    assert [b.batch_size for b in batches] == [256, 256, 256, 232]  # last partial batch included
    for b in batches:
        kjt = b.sparse
        assert b.dense.dtype == torch.float32 and b.dense.shape == (b.batch_size, 5)
        assert b.labels.dtype == torch.float32 and b.labels.shape == (b.batch_size,)
        assert set(b.labels.unique().tolist()) <= {0.0, 1.0}
        assert kjt.keys() == source.feature_names == ["feature_0", "feature_1", "feature_2"]
        assert kjt.values.dtype == torch.int64 and kjt.lengths.dtype == torch.int64
        assert kjt.weights.dtype == torch.float32
        assert float(kjt.weights.min()) > 0 and float(kjt.weights.max()) <= 1
        kjt.validate()
        assert kjt.lengths.min() >= 1 and kjt.lengths.max() <= 6
        for key, rows in zip(source.feature_names, [50, 200, 1000]):
            ids = kjt[key].values
            assert int(ids.min()) >= 0 and int(ids.max()) < rows
    assert sum(b.batch_size for b in source.eval_batches(128)) == 300
    assert source.num_train_samples() == 1000 and source.num_eval_samples() == 300


def test_tables_and_config_validation():
    tables = small().tables(embedding_dim=4, pooling="mean")
    assert [(t.name, t.num_embeddings, t.feature_names, t.embedding_dim, t.pooling) for t in tables] == [
        ("t_feature_0", 50, ["feature_0"], 4, "mean"),
        ("t_feature_1", 200, ["feature_1"], 4, "mean"),
        ("t_feature_2", 1000, ["feature_2"], 4, "mean"),
    ]
    assert [t.num_embeddings for t in small(num_embeddings=[77]).tables(8)] == [77, 77, 77]
    with pytest.raises(ValueError, match="num_embeddings must hold one value .* or num_tables = 3"):
        SyntheticSource(SyntheticConfig(num_tables=3, num_embeddings=[1, 2]))
    for bad in (dict(pooling=0.5), dict(zipf_alpha=-1.0), dict(label_noise=0.0), dict(click_rate=1.0)):
        with pytest.raises(ValueError, match="data.synthetic"):
            SyntheticConfig(**bad)


def test_make_data_source_dispatches():
    source = make_data_source(DataConfig(source="synthetic", synthetic=SyntheticConfig(num_tables=2, num_embeddings=[1000])))
    assert isinstance(source, SyntheticSource) and source.name == "synthetic"


def test_pure_function_of_seed_and_independent_of_batch_size():
    a, b = small(weighted=True), small(weighted=True)
    full = flatten(a.train_batches(100))
    assert_same(full, flatten(b.train_batches(100)))
    assert_same(full, flatten(b.train_batches(333)))  # same samples whatever the batch size
    assert not torch.equal(full["dense"], flatten(small(seed=8, weighted=True).train_batches(100))["dense"])
    # epochs draw fresh samples unless asked not to; eval is its own stream
    assert not torch.equal(full["dense"], flatten(a.train_batches(100, epoch=1))["dense"])
    assert_same(flatten(a.train_batches(100, epoch=1)), flatten(b.train_batches(100, epoch=1)))
    same = small(resample_each_epoch=False)
    assert_same(flatten(same.train_batches(100, epoch=0)), flatten(same.train_batches(100, epoch=3)))
    assert not torch.equal(full["dense"][:300], flatten(a.eval_batches(100))["dense"])


def test_start_batch_skips_ahead():
    source = small()
    everything = list(source.train_batches(96, epoch=2))
    resumed = list(source.train_batches(96, epoch=2, start_batch=7))
    assert len(resumed) == len(everything) - 7
    assert_same(flatten(everything[7:]), flatten(resumed))
    assert list(source.train_batches(96, start_batch=100)) == []


def test_pooling_lengths():
    one_hot = next(small(pooling=1.0).train_batches(1000)).sparse
    assert torch.all(one_hot.lengths == 1)
    bags = next(small(pooling=4.0, max_pooling=64).train_batches(1000)).sparse
    assert 3.7 < bags.lengths.float().mean() < 4.3
    capped = next(small(pooling=4.0, max_pooling=2).train_batches(1000)).sparse
    assert int(capped.lengths.max()) == 2


def test_zipf_skew_visible_and_hot_ids_spread():
    rows = 10_000
    source = small(num_tables=1, num_embeddings=[rows], pooling=1.0, zipf_alpha=1.05, num_train_samples=20_000)
    ids = torch.cat([b.sparse.values for b in source.train_batches(4096)]).numpy()
    counts = np.sort(np.bincount(ids, minlength=rows))[::-1]
    top_share = counts[: rows // 100].sum() / counts.sum()
    assert top_share > 0.4, top_share  # the top 1% of ids get a large share of the lookups
    hottest = np.argsort(np.bincount(ids, minlength=rows))[::-1][:10]
    assert hottest.max() > 100  # ranks are permuted to ids: hot ids are not just 0, 1, 2, ...
    rows = 1000
    uniform = small(num_tables=1, num_embeddings=[rows], pooling=1.0, zipf_alpha=0.0, num_train_samples=20_000)
    ids = torch.cat([b.sparse.values for b in uniform.train_batches(4096)]).numpy()
    counts = np.sort(np.bincount(ids, minlength=rows))[::-1]
    assert counts[: rows // 100].sum() / counts.sum() < 0.02


def test_zipf_sampler_follows_the_power_law():
    uniform = np.random.default_rng(0).random(400_000)
    for rows, alpha, head in [(1000, 1.0, 4096), (100_000, 1.2, 64), (10**9, 1.05, 4096)]:
        ranks = ZipfSampler(rows, alpha, head).sample(uniform)
        assert ranks.min() == 0 and ranks.max() < rows
        counts = np.bincount(ranks[ranks < 100])
        for r in (1, 4, 99):  # P(rank r) / P(rank 0) = (r + 1)^-alpha, exact in the head and close in the tail
            assert counts[0] / counts[r] == pytest.approx((r + 1) ** alpha, rel=0.1), (rows, alpha, r)
    assert np.bincount(ZipfSampler(7, 0.0).sample(uniform)).min() > 50_000  # alpha 0: uniform


def test_labels_learnable_from_the_teacher():
    source = small(num_eval_samples=8000, pooling=2.0, weighted=True)
    logits, labels = [], []
    for batch in source.eval_batches(2048):
        logits.append(source.teacher_logits(batch))
        labels.append(batch.labels)
    logits, labels = torch.cat(logits).numpy(), torch.cat(labels).numpy()
    assert 0.2 < labels.mean() < 0.4
    assert auc(logits, labels) > 0.7
    # the teacher's logit is the labels' log-odds: calibrated on average
    assert abs((1 / (1 + np.exp(-logits))).mean() - labels.mean()) < 0.03


def test_labels_learnable_by_a_linear_model():
    """Logistic regression on one-hot ids and dense features beats chance clearly on eval."""
    source = small(num_embeddings=[100, 100, 100], pooling=1.0, num_train_samples=16_000, num_eval_samples=4000)
    train, evaluation = next(source.train_batches(16_000)), next(source.eval_batches(4000))
    ids = {id(b): [b.sparse[k].values.numpy() for k in source.feature_names] for b in (train, evaluation)}
    dense_weights, id_weights, bias = np.zeros(5), [np.zeros(100) for _ in range(3)], 0.0

    def logits(batch):
        out = batch.dense.numpy().astype(np.float64) @ dense_weights + bias
        return out + sum(w[i] for w, i in zip(id_weights, ids[id(batch)]))

    labels = train.labels.numpy()
    for _ in range(100):  # gradient steps; per-id steps scaled by the id's count
        residual = 1 / (1 + np.exp(-logits(train))) - labels
        dense_weights -= train.dense.numpy().T @ residual / labels.size
        bias -= residual.mean()
        for w, i in zip(id_weights, ids[id(train)]):
            w -= 0.5 * np.bincount(i, residual, 100) / (np.bincount(i, minlength=100) + 5)
    assert auc(logits(evaluation), evaluation.labels.numpy()) > 0.7


@pytest.mark.parametrize("kw", [dict(num_embeddings=[1]), dict(num_dense=0), dict(num_tables=1, num_embeddings=[9])])
def test_degenerate_configs_keep_the_click_rate(kw):
    source = small(num_train_samples=8000, **kw)
    labels = torch.cat([b.labels for b in source.train_batches(4096)])
    assert 0.25 < float(labels.mean()) < 0.35
