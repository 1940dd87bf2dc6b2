"""A diverged update whose NaN row a cache writes back to its store: the store refuses the row and
names it, and the trainer reports it as divergence (table, row, last checkpoint) with an error
record, as it does for the rows and weights it checks itself.

    python -m pytest tests/unit/train/test_divergence.py -q
"""

from __future__ import annotations

import io
import json

import pytest
import torch

from neorec.config import load_config
from neorec.embedding import SparseOptimizerConfig, TableConfig
from neorec.embedding.cache_prefetch import cached_collections
from neorec.embedding.cached import CachedEmbeddingBagCollection
from neorec.embedding.locations import TableLocation
from neorec.embedding.storage import NonFiniteRowError
from neorec.sparse import KeyedJaggedTensor
from neorec.train.divergence import non_finite_weight
from neorec.train.trainer import NonFiniteLossError, Trainer


def train_on(collection, ids):
    kjt = KeyedJaggedTensor(["f"], torch.tensor(ids), torch.ones(len(ids), dtype=torch.long))
    collection(kjt).values.sum().backward()


def test_a_cache_evicting_a_non_finite_row_names_it():
    """The store refused the row as "rows hold NaN or inf", naming neither row nor cause; the
    check of the slots named the slot as the row."""
    collection = CachedEmbeddingBagCollection(
        [TableConfig("t", 100, 4, ["f"])], SparseOptimizerConfig("rowwise_adagrad", 0.1), init_seed=1,
        locations={"t": TableLocation("cached_dram", cache_rows=8, ways=8)})
    train_on(collection, [3])
    cache = collection.caches["t"]
    slot = int((cache.slot_rows == 3).nonzero()[0])
    cache.weights[slot, 1] = float("nan")  # a diverged update of row 3
    assert non_finite_weight(collection) == f"table 't' row 3 (cache slot {slot})"  # (it said "row {slot}")
    with pytest.raises(NonFiniteRowError, match=r"^row store 't': row 3 holds NaN or inf; refusing to store it$") as error:
        train_on(collection, list(range(10, 18)))  # eight other rows fill the eight slots: row 3 is evicted
    assert (error.value.store, error.value.row) == ("t", 3)


def test_the_trainer_reports_a_refused_write_back_as_divergence(tmp_path):
    cfg = load_config("configs/tiny.toml", [
        "data.synthetic.num_train_samples=1000", "data.synthetic.num_eval_samples=200", "data.batch_size=128",
        "train.progress=false", "train.max_steps=3", "model.embedding_dim=4", "model.dense_layers=[8, 4]",
        f"train.output_dir='{tmp_path / 'run'}'", f"checkpoint.dir='{tmp_path / 'ckpt'}'", "checkpoint.every_steps=1",
        "embedding.location.tables={t_feature_0='cached_dram'}", "embedding.location.cache_rows=128"])
    trainer = Trainer(cfg, out=io.StringIO())
    train_step = trainer.train_step

    def writing_back_a_nan_row(*args, **kwargs):  # step 3: a row that diverged in step 2 is written back
        if trainer.step == 2:
            cache = cached_collections(trainer.model)[0].caches["t_feature_0"]
            slot = int((cache.slot_rows >= 0).nonzero()[0])
            cache.weights[slot, 0] = float("inf")
            cache.dirty[slot] = True
            cache.flush()
        return train_step(*args, **kwargs)

    trainer.train_step = writing_back_a_nan_row
    with pytest.raises(NonFiniteLossError, match=r"^table 't_feature_0' row \d+ is not finite as its cache writes it "
                                                 r"back to its store after step 2: an update diverged; stopping without "
                                                 r"saving it \(lower the learning rates\); its last complete checkpoint is "
                                                 r"of step 2: --resume \S+ckpt$"):
        trainer.fit()
    last = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["kind"] == "error" and last["step"] == 3 and "is not finite as its cache writes it back" in last["message"]


def test_closing_after_a_diverged_row_closes_every_store_and_raises_once(tmp_path):
    """close() raised at the first store refusing a NaN row and closed nothing: every store stayed
    open and locked (a cached_ssd one of another table too), its prefetch threads ran on, and a
    second close() did nothing."""
    collection = CachedEmbeddingBagCollection(
        [TableConfig("t", 100, 4, ["f"]), TableConfig("u", 100, 4, ["g"])], SparseOptimizerConfig("sgd", 0.1),
        init_seed=1, locations={"t": TableLocation("cached_dram", cache_rows=8, ways=8),
                                "u": TableLocation("cached_ssd", cache_rows=8, ways=8, path=str(tmp_path / "u"),
                                                   background_prefetch=True)})
    kjt = KeyedJaggedTensor(["f", "g"], torch.tensor([3, 5]), torch.ones(2, dtype=torch.long))
    collection(kjt).values.sum().backward()
    t = collection.caches["t"]
    t.weights[int((t.slot_rows == 3).nonzero()[0]), 0] = float("nan")
    with pytest.raises(NonFiniteRowError, match="row store 't': row 3 holds NaN or inf"):
        collection.close()
    assert all(cache.store.closed and cache._executor is None for cache in collection.caches.values())
    collection.close()  # nothing left to close, nothing raised
