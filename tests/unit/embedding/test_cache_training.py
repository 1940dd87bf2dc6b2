"""Training through the embedding cache equals training without it, bit for bit (fp32 stores):
``CachedEmbeddingBagCollection`` against the plain ``EmbeddingBagCollection``, for cache sizes
from "smaller than one batch" (the cache grows) through thrashing to "holds the table", LRU and
LFU, with and without prefetch, several optimizers; and write-back loses nothing.

    python -m pytest tests/unit/embedding/test_cache_training.py -q
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List

import pytest
import torch

from neorec.embedding import EmbeddingBagCollection, SparseOptimizerConfig, StorageConfig, TableConfig
from neorec.embedding.cache_prefetch import with_prefetch
from neorec.embedding.cached import CachedEmbeddingBagCollection
from neorec.embedding.locations import TableLocation
from neorec.embedding.ssd_store import SsdRowStore
from neorec.sparse import KeyedJaggedTensor

pytestmark = pytest.mark.filterwarnings("ignore:cache of table .* growing it:RuntimeWarning")

TABLES = [
    TableConfig("shared", 300, 8, ["f_a1", "f_a2"]),
    TableConfig("small", 40, 4, ["f_b"], pooling="mean"),
    TableConfig("big", 1000, 8, ["f_c"]),
    TableConfig("wide", 200, 16, ["f_d"]),
]
ROWS = {f: t.num_embeddings for t in TABLES for f in t.feature_names}


@pytest.fixture(autouse=True)
def one_thread():
    """Many small ops: on a shared 2-core machine OpenMP barriers dominate (10x); the results
    do not depend on the thread count of the comparison, as both sides use the same."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_batches(count: int, batch_size: int = 24, weighted: bool = False, seed: int = 0) -> List[KeyedJaggedTensor]:
    """Skewed ids (hot rows repeat within and across batches), some empty bags."""
    generator = torch.Generator().manual_seed(seed)
    keys = list(ROWS)
    out = []
    for _ in range(count):
        lengths = torch.randint(0, 4, (len(keys), batch_size), generator=generator)
        values = torch.cat([(torch.rand(int(lengths[k].sum()), generator=generator) ** 3 * ROWS[key]).long()
                            for k, key in enumerate(keys)])
        weights = torch.rand(values.numel(), generator=generator) if weighted else None
        out.append(KeyedJaggedTensor(keys, values, lengths.flatten(), weights))
    return out


def locations(tmp_path: Path, cache_rows: int, policy: str, ways: int = 8) -> Dict[str, TableLocation]:
    """shared: cached over DRAM, big and wide: cached over SSD, small: on the device."""
    common = dict(cache_rows=cache_rows, policy=policy, ways=ways)
    return {
        "shared": TableLocation("cached_dram", **common),
        "big": TableLocation("cached_ssd", path=str(tmp_path / "big"), **common),
        "wide": TableLocation("cached_ssd", path=str(tmp_path / "wide"), **{**common, "ways": 4}),
    }


def train_both(reference, cached, batches, prefetch: bool, check_each_step: bool = True) -> None:
    """Same batches, same output gradients; pooled outputs must be equal at every step."""
    generator = torch.Generator().manual_seed(1)
    stream = with_prefetch(batches, cached, sparse_of=lambda kjt: kjt) if prefetch else batches
    for step, kjt in enumerate(stream):
        expected, got = reference(kjt).values, cached(kjt).values
        if check_each_step:
            assert torch.equal(expected, got), f"pooled outputs differ at step {step}"
        grad = torch.randn(expected.shape, generator=generator)
        (expected * grad).sum().backward()
        (got * grad).sum().backward()


def assert_same_tables(reference: EmbeddingBagCollection, cached: CachedEmbeddingBagCollection) -> None:
    cached.flush()
    for table in TABLES:
        assert torch.equal(reference.tbe.get_table_weight(table.name), cached.table_weight(table.name)), table.name
        expected, got = reference.tbe.get_optimizer_state(table.name), cached.optimizer_state(table.name)
        assert expected.keys() == got.keys()
        for name in expected:
            assert torch.equal(expected[name], got[name]), (table.name, name)


CASES = [  # (optimizer, policy, cache rows, prefetch)
    *[("rowwise_adagrad", policy, rows, prefetch) for policy in ("lru", "lfu") for rows in (8, 40, 2000)
      for prefetch in (False, True)],
    ("sgd", "lru", 40, True), ("sgd", "lfu", 8, False),
    ("adam", "lru", 8, True), ("adam", "lfu", 40, False),
    ("adagrad", "lru", 40, False), ("adagrad", "lfu", 2000, True),
]


@pytest.mark.parametrize("kind,policy,cache_rows,prefetch", CASES)
def test_cached_training_equals_uncached_bit_for_bit(tmp_path, kind, policy, cache_rows, prefetch):
    optimizer = SparseOptimizerConfig(kind, learning_rate=0.1, weight_decay=0.01 if kind == "sgd" else 0.0)
    reference = EmbeddingBagCollection(TABLES, optimizer, init_seed=5)
    cached = CachedEmbeddingBagCollection(TABLES, optimizer, locations=locations(tmp_path, cache_rows, policy),
                                          init_seed=5)
    for table in TABLES:  # same initial rows, wherever they live
        assert torch.equal(reference.tbe.get_table_weight(table.name), cached.table_weight(table.name))
    train_both(reference, cached, make_batches(20, weighted=(kind == "adam")), prefetch)
    assert_same_tables(reference, cached)
    stats = cached.cache_stats()
    assert stats["big"]["misses"] > 0 and stats["big"]["hits"] > 0
    if cache_rows == 40:  # smaller than the tables' working sets: rows are evicted and written back
        assert stats["big"]["evictions"] > 0 and stats["big"]["write_backs"] > 0
    if prefetch:
        assert stats["big"]["prefetch_loads"] > 0
    cached.close()


def test_eval_forwards_do_not_dirty_and_interleave_with_training(tmp_path):
    optimizer = SparseOptimizerConfig("rowwise_adagrad", 0.1)
    reference = EmbeddingBagCollection(TABLES, optimizer)
    cached = CachedEmbeddingBagCollection(TABLES, optimizer, locations=locations(tmp_path, 40, "lru"))
    batches = make_batches(10)
    for i, kjt in enumerate(with_prefetch(batches, cached, sparse_of=lambda k: k)):
        out_ref, out = reference(kjt).values, cached(kjt).values
        out_ref.sum().backward()
        out.sum().backward()
        with torch.no_grad():  # evaluation between steps, through the same cache
            assert torch.equal(reference(batches[-1 - i]).values, cached(batches[-1 - i]).values)
    assert_same_tables(reference, cached)
    cache = cached.caches["big"]
    before = cache.stats.write_backs
    with torch.no_grad():
        cached(make_batches(1, seed=9)[0])
    cached.flush()
    assert cache.stats.write_backs == before  # lookups without an update write nothing back


@pytest.mark.parametrize("precision, policy", [("fp16", "lru"), ("int8", "lfu")])
def test_evaluation_leaves_the_caches_and_the_training_after_it_unchanged(tmp_path, precision, policy):
    """An evaluation used to look its rows up like a training batch: it placed and evicted rows
    (each eviction rounds a dirty row into a low-precision store: other noise, other training),
    grew a cache to fit an eval batch for good and counted its uses. Now it reads rows where they
    are; training with evaluations between its steps equals training without them, bit for bit."""
    optimizer = SparseOptimizerConfig("rowwise_adagrad", 0.1)

    def run(directory, evaluate):
        where = {name: TableLocation(location.kind, path=location.path and str(directory / name), cache_rows=40,
                                     policy=policy, ways=location.ways, precision=precision)
                 for name, location in locations(directory, 40, policy).items()}
        cached = CachedEmbeddingBagCollection(TABLES, optimizer, locations=where)
        eval_batch = make_batches(1, batch_size=400, seed=9)[0]  # more distinct rows than a cache has slots
        outputs = []
        for kjt in with_prefetch(make_batches(8), cached, sparse_of=lambda k: k):
            cached(kjt).values.sum().backward()
            if evaluate:
                for cache in cached.caches.values():
                    cache.wait()  # a background prefetch in flight finishes (its write-backs are its own)
                before = {n: (c.num_slots, c.stats.as_dict(), c.slot_rows.clone(), c.dirty.clone(),
                              c.last_use.clone(), c.counts.clone()) for n, c in cached.caches.items()}
                with torch.no_grad():
                    outputs.append(cached(eval_batch).values)
                for name, cache in cached.caches.items():
                    slots, stats, rows, dirty, use, counts = before[name]
                    assert (cache.num_slots, cache.stats.as_dict()) == (slots, stats), name
                    for old, new in ((rows, cache.slot_rows), (dirty, cache.dirty), (use, cache.last_use),
                                     (counts, cache.counts)):
                        assert torch.equal(old, new), name
        cached.flush()
        return cached, outputs

    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    plain, _ = run(tmp_path / "a", evaluate=False)
    evaluated, outputs = run(tmp_path / "b", evaluate=True)
    for table in TABLES:
        assert torch.equal(plain.table_weight(table.name), evaluated.table_weight(table.name)), table.name
    assert len(outputs) == 8 and all(torch.isfinite(o).all() for o in outputs)


@pytest.mark.parametrize("weighted", [False, True])
def test_evaluation_pools_cached_mean_and_weighted_bags_with_the_fused_kernels_bits(tmp_path, weighted):
    """The read-only evaluation pools cached tables itself: sum and mean bags, with and without
    per-value weights, must come out as the fused kernels pool them (bit for bit)."""
    tables = [TableConfig(t.name, t.num_embeddings, t.embedding_dim, list(t.feature_names),
                          pooling="mean" if t.name in ("shared", "wide") else "sum") for t in TABLES]
    optimizer = SparseOptimizerConfig("rowwise_adagrad", 0.1)
    reference = EmbeddingBagCollection(tables, optimizer)
    cached = CachedEmbeddingBagCollection(tables, optimizer, locations=locations(tmp_path, 40, "lru"))
    batches = make_batches(6, weighted=weighted)
    for i, kjt in enumerate(batches):
        reference(kjt).values.sum().backward()
        cached(kjt).values.sum().backward()
        with torch.no_grad():
            assert torch.equal(reference(batches[-1 - i]).values, cached(batches[-1 - i]).values), i


def test_flush_between_forward_and_backward_keeps_the_update(tmp_path):
    optimizer = SparseOptimizerConfig("rowwise_adagrad", 0.1)
    reference = EmbeddingBagCollection(TABLES, optimizer)
    cached = CachedEmbeddingBagCollection(TABLES, optimizer, locations=locations(tmp_path, 40, "lru"))
    for kjt in make_batches(6):
        out_ref, out = reference(kjt).values, cached(kjt).values
        cached.flush()  # in flight: rows written now, and again after the update
        out_ref.sum().backward()
        out.sum().backward()
    assert_same_tables(reference, cached)


@pytest.mark.filterwarnings("ignore::neorec.embedding.path_common.SecondLookupWarning")  # (two lookups, on purpose)
def test_backward_after_a_later_forward_raises_before_updating(tmp_path):
    optimizer = SparseOptimizerConfig("sgd", 0.1)
    cached = CachedEmbeddingBagCollection(TABLES, optimizer, locations=locations(tmp_path, 40, "lru"))
    first, second = make_batches(2)
    stale = cached(first).values
    cached(second)
    before = cached.tbe.weights.clone()
    with pytest.raises(RuntimeError, match="backward of a batch after a later forward"):
        stale.sum().backward()
    assert torch.equal(before, cached.tbe.weights)


@pytest.mark.parametrize("kind", ["rowwise_adagrad", "adam"])  # Adam: the step carries on too
def test_ssd_write_back_loses_nothing_and_reopened_stores_continue_training(tmp_path, kind):
    optimizer = SparseOptimizerConfig(kind, 0.1)
    everywhere = {t.name: TableLocation("cached_ssd", cache_rows=16, ways=4, path=str(tmp_path / t.name))
                  for t in TABLES}
    reference = EmbeddingBagCollection(TABLES, optimizer, init_seed=2)
    cached = CachedEmbeddingBagCollection(TABLES, optimizer, locations=everywhere, init_seed=2)
    batches = make_batches(16)
    train_both(reference, cached, batches[:10], prefetch=True)
    cached.close()
    for table in TABLES:  # every row and its state is in the file
        store = SsdRowStore.open(tmp_path / table.name)
        ids = torch.arange(table.num_embeddings)
        rows, state = store.read(ids)
        assert torch.equal(rows, reference.tbe.get_table_weight(table.name)), table.name
        for name, value in reference.tbe.get_optimizer_state(table.name).items():
            assert torch.equal(state[name], value), (table.name, name)
        assert store.training_state == {"optimizer_step": 10}
        store.close()
    reopened = {name: TableLocation("cached_ssd", cache_rows=64, ways=8, path=loc.path, open_existing=True)
                for name, loc in everywhere.items()}
    lfu = {name: TableLocation("cached_ssd", cache_rows=64, ways=8, path=loc.path, open_existing=True, policy="lfu")
           for name, loc in everywhere.items()}
    with pytest.raises(ValueError, match=r"holds \(rows, dim, precision, state, LFU counts\) = .*False\), the "
                                         r"table needs .*True\)"):
        CachedEmbeddingBagCollection(TABLES, optimizer, locations=lfu)  # an LRU store has no access counts
    resumed = CachedEmbeddingBagCollection(TABLES, optimizer, locations=reopened, init_seed=99)
    assert resumed.tbe.step_count == 10
    train_both(reference, resumed, batches[10:], prefetch=False)
    assert_same_tables(reference, resumed)
    resumed.close()


def test_reopened_stores_of_different_steps_are_refused_and_rounding_noise_goes_on(tmp_path):
    """Stores flushed at different optimizer steps are not one model's; a reopened fp16 store
    draws the stochastic-rounding noise that follows its last flush, not the first session's."""
    optimizer = SparseOptimizerConfig("adam", 0.1)
    tables = TABLES[2:]
    paths = {t.name: str(tmp_path / t.name) for t in tables}
    made = {n: TableLocation("cached_ssd", cache_rows=16, ways=4, path=p, precision="fp16") for n, p in paths.items()}
    first = CachedEmbeddingBagCollection(tables, optimizer, locations=made)
    train_both(EmbeddingBagCollection(tables, optimizer), first, make_batches(4), prefetch=False,
               check_each_step=False)
    first.close()
    store = SsdRowStore.open(paths["big"])
    after_flush = store._generator.get_state()
    assert not torch.equal(after_flush, torch.Generator().manual_seed(0).get_state())  # it drew noise
    store.training_state["optimizer_step"] = 3  # as if flushed alone, a step earlier
    store._before_write()
    store.close()
    reopened = {n: TableLocation("cached_ssd", cache_rows=16, ways=4, path=p, precision="fp16", open_existing=True)
                for n, p in paths.items()}
    with pytest.raises(ValueError, match=r"flushed at different optimizer steps \{'big': 3, 'wide': 4\}"):
        CachedEmbeddingBagCollection(tables, optimizer, locations=reopened)
    store = SsdRowStore.open(paths["big"])
    assert torch.equal(store._generator.get_state(), after_flush)
    store.close()


def test_a_store_flushed_by_a_cache_growth_carries_the_step_of_its_rows(tmp_path):
    """Growing a cache flushes its store; the store was marked clean with the step of its previous
    flush (0), so after a crash right there a reopening took trained rows as step 0's, beside
    stores that were never flushed: rows of different steps, accepted as one model."""
    optimizer = SparseOptimizerConfig("adam", 0.1)
    tables = [TableConfig("big", 1000, 8, ["f_big"]), TableConfig("wide", 1000, 8, ["f_wide"])]
    paths = {t.name: str(tmp_path / t.name) for t in tables}
    made = {n: TableLocation("cached_ssd", cache_rows=16, ways=4, path=p) for n, p in paths.items()}
    cached = CachedEmbeddingBagCollection(tables, optimizer, locations=made)

    def batch(big, wide):
        return KeyedJaggedTensor(["f_big", "f_wide"], torch.tensor(big + wide), torch.ones(2 * len(big), dtype=torch.long))

    for _ in range(3):
        cached(batch(list(range(12)), list(range(12)))).values.sum().backward()
    with pytest.warns(RuntimeWarning, match="cache of table 'big'.*growing it"):
        cached(batch(list(range(100, 140)), [i % 12 for i in range(40)]))  # forward of step 4: 'big' grows
    for cache in cached.caches.values():  # a crash here: the stores' files as they are, their locks dropped
        cache.shutdown()
        cache.store._close_map()
    store = SsdRowStore.open(paths["big"])
    assert store.training_state["optimizer_step"] == 3
    store._close_map()
    reopened = {n: TableLocation("cached_ssd", cache_rows=16, ways=4, path=p, open_existing=True)
                for n, p in paths.items()}
    with pytest.raises(ValueError, match=r"flushed at different optimizer steps \{'big': 3, 'wide': 0\}"):
        CachedEmbeddingBagCollection(tables, optimizer, locations=reopened)


@pytest.mark.parametrize("kind", ["adagrad", "adam"])
def test_dram_tables_on_a_separate_host_module_equal_uncached(tmp_path, kind):
    """The GPU layout of "dram" tables (a second fused module on the host), exercised on CPU. With
    Adam (torch ops) it differed: the host split changed the main module's values-per-bag ratio, and
    with it the layout (batch- or key-major) and the order a shared table's row gradients were added in."""
    optimizer = SparseOptimizerConfig(kind, 0.1)
    placed = locations(tmp_path, 40, "lfu")
    placed["small"] = TableLocation("dram")
    reference = EmbeddingBagCollection(TABLES, optimizer, init_seed=4)
    cached = CachedEmbeddingBagCollection(TABLES, optimizer, locations=placed, init_seed=4, separate_host_tables=True)
    assert cached.host_tbe is not None and [t.name for t in cached.host_tbe.tables] == ["small"]
    train_both(reference, cached, make_batches(8, weighted=True), prefetch=True)
    assert_same_tables(reference, cached)
    plain = CachedEmbeddingBagCollection(TABLES, optimizer, locations={"small": TableLocation("dram")})
    assert plain.host_tbe is None and not plain.caches  # on a CPU run "dram" is the device

    # a batch whose layout flips when table b leaves the main module: a (two features) has ~1 id per
    # bag, b 8; a's row 0 gets +1 (sample 0, fa1), -1 (sample 1, fa1) and 1e-7 (sample 0, fa2), whose
    # sum depends on the order
    tables = [TableConfig("a", 10, 4, ["fa1", "fa2"]), TableConfig("b", 10, 4, ["fb"])]
    kjt = KeyedJaggedTensor(["fa1", "fa2", "fb"], torch.tensor([0, 0, 0] + list(range(1, 9)) * 2),
                            torch.tensor([1, 1, 1, 0, 8, 8]))
    grad = torch.zeros(2, 12)
    grad[0, 0:4], grad[1, 0:4], grad[0, 4:8] = 1.0, -1.0, 1e-7
    optimizer = SparseOptimizerConfig(kind, 1.0)
    reference = EmbeddingBagCollection(tables, optimizer, init_seed=0)
    split = CachedEmbeddingBagCollection(tables, optimizer, locations={"b": TableLocation("dram")}, init_seed=0,
                                         separate_host_tables=True)
    (reference(kjt).values * grad).sum().backward()
    (split(kjt).values * grad).sum().backward()
    assert torch.equal(reference.tbe.get_table_weight("a"), split.table_weight("a"))


def test_a_cache_smaller_than_a_batch_grows_and_says_so(tmp_path):
    optimizer = SparseOptimizerConfig("rowwise_adagrad", 0.1)
    cached = CachedEmbeddingBagCollection(TABLES, optimizer, locations=locations(tmp_path, 8, "lru"))
    assert cached.caches["big"].num_slots == 8
    with pytest.warns(RuntimeWarning, match="cache of table 'shared'.*growing it"):
        cached(make_batches(1)[0]).values.sum().backward()
    assert cached.caches["big"].num_slots > 8
    cached.close()


def test_errors(tmp_path):
    optimizer = SparseOptimizerConfig("sgd", 0.1)
    with pytest.raises(ValueError, match="not tables"):
        CachedEmbeddingBagCollection(TABLES, optimizer, locations={"nope": TableLocation("cached_dram")})
    with pytest.raises(ValueError, match="storage.precision must then be 'fp32'"):
        CachedEmbeddingBagCollection(TABLES, optimizer, StorageConfig("fp16"),
                                     locations={"big": TableLocation("cached_dram")})
    with pytest.raises(ValueError, match="needs a path"):
        TableLocation("cached_ssd")
    with pytest.raises(ValueError, match="location must be one of"):
        TableLocation("gpu")
    with pytest.raises(ValueError, match="policy must be one of"):
        TableLocation("cached_dram", policy="fifo")
    cached = CachedEmbeddingBagCollection(TABLES, optimizer, locations=locations(tmp_path, 40, "lru"))
    kjt = make_batches(1)[0]
    bad = KeyedJaggedTensor(kjt.keys(), kjt.values.clone(), kjt.lengths)
    offsets = kjt.offset_per_key()
    bad.values[offsets[3]] = 1000  # feature f_c of table "big" has rows [0, 1000)
    with pytest.raises(ValueError, match=r"feature 'f_c' \(table 'big'\): id 1000 is outside"):
        cached(bad)
    with pytest.raises(ValueError, match="lacks feature"):
        cached(kjt.select_keys(["f_a1", "f_a2"]))
    # said with the TableLocation settings that reopen or replace it (it named SsdRowStore.open and
    # overwrite=, which a user of the collection never called)
    with pytest.raises(ValueError, match=r"a row store already exists at .*; TableLocation\(..., open_existing=True\) "
                                         r"reopens it \(its rows and optimizer state\), overwrite=True replaces it"):
        CachedEmbeddingBagCollection(TABLES, optimizer, locations=locations(tmp_path, 40, "lru"))
    cached.close()


def test_trainer_with_cached_tables_equals_the_plain_trainer(tmp_path):
    """``[embedding.location]`` end to end: same loss at every step, same eval, same rows."""
    import io

    from neorec.config import config_from_dict
    from neorec.train.trainer import Trainer

    base = {
        "model": {"embedding_dim": 8, "dense_layers": [16, 8], "over_layers": [16]},
        "data": {"batch_size": 128, "eval_batch_size": 1024,
                 "synthetic": {"num_tables": 3, "num_embeddings": [400, 2000, 50], "num_dense": 4,
                               "num_train_samples": 2560, "num_eval_samples": 1024}},
        "train": {"epochs": 1, "progress": False, "output_dir": ""},
    }
    location = {"default": "cached_ssd", "min_rows": 100, "cache_fraction": 0.05, "policy": "lfu",
                "ssd_dir": str(tmp_path / "ssd")}
    plain = Trainer(config_from_dict(base), out=io.StringIO())
    cached = Trainer(config_from_dict({**base, "embedding": {"location": location}}), out=io.StringIO())
    collection = cached.model.sparse_arch
    assert isinstance(collection, CachedEmbeddingBagCollection)
    assert sorted(collection.caches) == ["t_feature_0", "t_feature_1"]  # the 50-row table stays on the device
    batches = list(plain.source.train_batches(128))
    for batch in with_prefetch(batches, cached.model):
        assert plain.train_step(batch) == cached.train_step(batch)
    assert plain.evaluate() == cached.evaluate()
    collection.flush()
    for table in collection.tables:
        assert torch.equal(plain.model.sparse_arch.tbe.get_table_weight(table.name), collection.table_weight(table.name))
    assert (tmp_path / "ssd" / "t_feature_1" / "meta.json").is_file()
    collection.close()


def test_a_run_reports_its_caches_and_a_run_without_them_does_not(tmp_path):
    """The cache's counters reach the user: the final record of metrics.jsonl, the TrainResult and
    `neorec train`'s last lines (hit rate, lookups, evictions, write-backs per cached table)."""
    import contextlib
    import io
    import json

    from neorec.train.cli import _print_result
    from neorec.config import config_from_dict
    from neorec.train.trainer import Trainer

    base = {"model": {"embedding_dim": 8, "dense_layers": [16, 8], "over_layers": [16]},
            "data": {"batch_size": 128, "eval_batch_size": 1024,
                     "synthetic": {"num_tables": 3, "num_embeddings": [400, 2000, 50], "num_dense": 4,
                                   "num_train_samples": 1280, "num_eval_samples": 256}},
            "train": {"epochs": 1, "progress": False}}
    location = {"default": "cached_dram", "min_rows": 100, "cache_fraction": 0.05}
    runs = {}
    for name, extra in (("plain", {}), ("cached", {"embedding": {"location": location}})):
        trainer = Trainer(config_from_dict({**base, **extra, "train": {**base["train"],
                                                                       "output_dir": str(tmp_path / name)}}),
                          out=io.StringIO())
        result = trainer.fit()
        final = json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[-1])
        runs[name] = (trainer, result, final)
    _, plain, plain_final = runs["plain"]
    assert plain.cache == {} and "cache" not in plain_final
    trainer, result, final = runs["cached"]
    caches = trainer.model.sparse_arch.caches
    assert sorted(result.cache) == sorted(caches) == ["t_feature_0", "t_feature_1"]
    for name, counters in result.cache.items():
        stats = caches[name].stats
        assert counters["lookups"] == stats.lookups > 0 and counters["hits"] == stats.hits
        assert counters["evictions"] == stats.evictions > 0 and counters["write_backs"] == stats.write_backs
        assert counters["hit_rate"] == stats.hits / stats.lookups
        assert counters["store_bytes_read"] == caches[name].store.bytes_read > 0
    assert final["cache"] == json.loads(json.dumps(result.cache))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        _print_result(result)
    line = [text for text in out.getvalue().splitlines() if text.startswith("embedding cache: ")]
    assert len(line) == 1 and f"t_feature_0 hit rate {result.cache['t_feature_0']['hit_rate']:.1%}" in line[0]


def test_location_config_resolves_per_table_and_rejects_mistakes():
    from neorec.config import load_config

    root = Path(__file__).resolve().parents[3]
    cfg = load_config(root / "configs" / "tiny_cached_ssd.toml", ["train.output_dir=runs/x"])
    tables = [TableConfig(f"t_feature_{i}", rows, 8) for i, rows in enumerate([500, 1000, 2000, 300])]
    placed = cfg.embedding.location.resolve(tables, "runs/x/embedding_ssd")
    assert [placed[t.name].kind for t in tables] == ["cached_dram", "cached_ssd", "cached_ssd", "device"]
    assert placed["t_feature_2"].path == str(Path("runs/x/embedding_ssd") / "t_feature_2")
    assert placed["t_feature_1"].precision == "fp16" and placed["t_feature_1"].policy == "lfu"
    assert placed["t_feature_1"].cache_shape(1000) == (608, 32)  # 60% = 600 rows -> whole 32-way sets
    for override, message in [
        ("embedding.location.default=disk", "embedding.location.default must be one of"),
        ("embedding.location.precision=int4", "precision must be one of"),
        ("embedding.location.policy=random", "embedding.location.policy must be one of"),
        ("embedding.location.cache_fraction=0", r"embedding.location.cache_fraction must be in \(0, 1\]"),
        ("embedding.location.tables.t_feature_1=floppy", "tables.t_feature_1: location must be one of"),
        ("embedding.location.nope=1", "unknown config key 'embedding.location.nope'"),
    ]:
        with pytest.raises(ValueError, match=message):
            load_config(root / "configs" / "tiny_cached_ssd.toml", [override])
    cfg = load_config(None, ["embedding.location.tables.t_missing=cached_dram"])
    with pytest.raises(ValueError, match=r"names \['t_missing'\], which are not tables"):
        cfg.embedding.location.resolve(tables)


def test_tables_of_one_location_seed_draw_unrelated_rounding_noise(tmp_path):
    placed = {name: TableLocation("cached_dram", cache_rows=16, ways=4, precision="int8", seed=7)
              for name in ("big", "wide")}
    cached = CachedEmbeddingBagCollection(TABLES, SparseOptimizerConfig("sgd", 0.1), locations=placed)
    seeds = {name: cache.store._generator.initial_seed() for name, cache in cached.caches.items()}
    assert seeds["big"] != seeds["wide"]
    again = CachedEmbeddingBagCollection(TABLES, SparseOptimizerConfig("sgd", 0.1), locations=placed)
    assert seeds == {name: cache.store._generator.initial_seed() for name, cache in again.caches.items()}
