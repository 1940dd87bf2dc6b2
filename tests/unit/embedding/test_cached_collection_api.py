"""What a ``CachedEmbeddingBagCollection`` offers and refuses besides training through its
caches: ``prefetch`` (of the batch after the next forward, or ``now=True`` of the next one), and
the refusals of a bad prefetch, of state dicts holding cache slots, of copies and of moves to
another device. Helpers and the shared tables are ``test_cache_training``'s.

    python -m pytest tests/unit/embedding/test_cached_collection_api.py -q
"""

from __future__ import annotations

import pytest
import torch

from neorec.embedding import EmbeddingBagCollection, SparseOptimizerConfig, TableConfig
from neorec.embedding.cached import CachedEmbeddingBagCollection
from neorec.embedding.locations import TableLocation
from neorec.sparse import KeyedJaggedTensor
from tests.unit.embedding.test_cache_training import (TABLES, assert_same_tables, locations, make_batches,  # noqa: F401
                                                      one_thread, train_both)  # (one_thread: autouse here too)

pytestmark = pytest.mark.filterwarnings("ignore:cache of table .* growing it:RuntimeWarning")


def train_naming_the_next_batch_now(tmp_path, batches, when: str):
    """Train a cached collection against the uncached one (equal at every step), naming batch
    i + 1 with ``prefetch(now=True)`` after step i's backward, before it, or never; returns the
    caches' statistics and the rows loaded by the ``prefetch`` calls themselves."""
    optimizer = SparseOptimizerConfig("rowwise_adagrad", 0.1)
    reference = EmbeddingBagCollection(TABLES, optimizer, init_seed=5)
    cached = CachedEmbeddingBagCollection(TABLES, optimizer, locations=locations(tmp_path / when, 40, "lru"),
                                          init_seed=5)
    generator = torch.Generator().manual_seed(1)
    loaded_by_prefetch = 0
    for step, kjt in enumerate(batches):
        expected, got = reference(kjt).values, cached(kjt).values
        assert torch.equal(expected, got), f"pooled outputs differ at step {step}"
        grad = torch.randn(expected.shape, generator=generator)
        (expected * grad).sum().backward()
        following = batches[step + 1] if step + 1 < len(batches) else None
        if following is not None and when == "before_backward":
            cached.prefetch(following, now=True)
        (got * grad).sum().backward()
        if following is not None and when == "after_backward":
            before = sum(s["prefetch_loads"] for s in cached.cache_stats().values())
            cached.prefetch(following, now=True)
            for cache in cached.caches.values():
                cache.wait()
            loaded_by_prefetch += sum(s["prefetch_loads"] for s in cached.cache_stats().values()) - before
    assert_same_tables(reference, cached)
    stats = cached.cache_stats()
    cached.close()
    return stats, loaded_by_prefetch


def test_prefetch_now_starts_the_next_forwards_loads_at_once(tmp_path):
    """``prefetch(features, now=True)`` names the NEXT forward's batch (a sharded rank names it
    from the pipeline's look-ahead exchange, after the backward): its rows load at once, not at the
    next forward; training stays equal to the uncached collection bit for bit (also when named
    between a forward and its backward, while the previous batch's rows are pinned), and the
    loaded rows are hits of the lookup that follows."""
    batches = make_batches(12)
    plain, _ = train_naming_the_next_batch_now(tmp_path, batches, "never")
    after, loaded = train_naming_the_next_batch_now(tmp_path, batches, "after_backward")
    before, _ = train_naming_the_next_batch_now(tmp_path, batches, "before_backward")
    assert loaded > 0 and loaded == sum(s["prefetch_loads"] for s in after.values())
    for stats in (after, before):
        for name in ("shared", "big", "wide"):
            assert stats[name]["lookups"] == plain[name]["lookups"]
            assert stats[name]["prefetch_loads"] > 0 and plain[name]["prefetch_loads"] == 0, name
            assert stats[name]["hits"] > plain[name]["hits"], name


def test_a_bad_prefetch_is_refused_when_named_and_spoils_no_forward(tmp_path):
    """prefetch() checks the batch it is given: an id outside its table or a missing feature raises
    there, and the next forward (of a good batch) runs as if nothing had been named."""
    optimizer = SparseOptimizerConfig("rowwise_adagrad", 0.1)
    reference = EmbeddingBagCollection(TABLES, optimizer)
    cached = CachedEmbeddingBagCollection(TABLES, optimizer, locations=locations(tmp_path, 40, "lru"))
    good, bad = make_batches(2)
    values = bad.values.clone()
    values[-1] = 10**6
    with pytest.raises(ValueError, match="id 1000000 is outside the table's rows"):
        cached.prefetch(KeyedJaggedTensor(bad.keys(), values, bad.lengths, validate=False))
    with pytest.raises(ValueError, match="lacks feature"):
        cached.prefetch(bad.select_keys(bad.keys()[:1]))
    out_ref, out = reference(good).values, cached(good).values
    assert torch.equal(out_ref, out)
    out_ref.sum().backward()
    out.sum().backward()
    assert_same_tables(reference, cached)


def test_cache_slots_are_not_loaded_from_a_state_dict_and_the_collection_is_not_copied():
    """load_state_dict "matched all keys" and put the saved slots under the current tags (other rows
    changed; a fresh module restored nothing); deepcopy failed on "cannot pickle SimpleQueue"."""
    import copy
    import pickle

    tables = [TableConfig("user", 16, 4), TableConfig("item", 1000, 4)]
    locations = {"item": TableLocation("cached_dram", cache_rows=8, ways=8)}
    cached = CachedEmbeddingBagCollection(tables, SparseOptimizerConfig("sgd", 0.5), locations=locations)
    kjt = KeyedJaggedTensor(["user", "item"], torch.tensor([1, 1, 2, 3]), torch.tensor([1, 3]))
    cached(kjt).values.sum().backward()
    saved = {k: v.clone() for k, v in cached.state_dict().items()}  # still given (the trainer filters it)
    before = cached.table_weight("item").clone()
    with pytest.raises(ValueError, match=r"holds the cache slots of the cached tables \['item'\], not which rows"):
        cached.load_state_dict(saved)
    assert torch.equal(cached.table_weight("item"), before)
    for copy_it in (copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match=r"cached tables \['item'\] cannot be copied or pickled"):
            copy_it(cached)
    host_only = CachedEmbeddingBagCollection(tables, locations={"item": TableLocation("dram")})  # no cache
    twin = copy.deepcopy(host_only)
    assert torch.equal(twin.table_weight("item"), host_only.table_weight("item"))
    host_only.load_state_dict(twin.state_dict())


def test_moving_a_collection_with_caches_is_refused_and_new_buffers_are_taken(tmp_path):
    """``.to(device)`` replaced the fused module's buffers while the caches kept the old slots
    (and their metadata on the old device): misses loaded rows the forward no longer read, and
    training went silently wrong. A move is refused; buffers replaced in place (same device) are
    the caches' from then on, and training stays equal to the uncached collection."""
    optimizer = SparseOptimizerConfig("rowwise_adagrad", 0.1)
    reference = EmbeddingBagCollection(TABLES, optimizer, init_seed=5)
    cached = CachedEmbeddingBagCollection(TABLES, optimizer, locations=locations(tmp_path, 40, "lru"), init_seed=5)
    with pytest.raises(RuntimeError, match=r"cached tables \['big', 'shared', 'wide'\] cannot move from cpu to meta: "
                                           r"build it there"):
        cached.to("meta")
    cached._apply(lambda t: t.clone())  # what a move does to the buffers, on the same device
    assert cached.caches["big"].weights.data_ptr() == cached._slot_storage("big")[0].data_ptr()
    train_both(reference, cached, make_batches(6), prefetch=False)
    assert_same_tables(reference, cached)
    cached.half()  # (the fused module keeps its storage types: nothing moves)
    train_both(reference, cached, make_batches(3, seed=1), prefetch=False)
    cached.close()
    cached.close()  # a second close does nothing (it flushed closed stores: "row store 'big' is closed")


def test_every_table_in_host_dram_on_a_device_run_is_said_plainly():
    placed = {t.name: TableLocation("dram") for t in TABLES}
    with pytest.raises(ValueError, match=r"every table \(.*\) is placed in \"dram\" \(host memory\) on a cpu run: the "
                                         r"fused module on the device would hold none"):
        CachedEmbeddingBagCollection(TABLES, SparseOptimizerConfig("sgd", 0.1), locations=placed,
                                     separate_host_tables=True)
