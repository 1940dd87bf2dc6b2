"""``SetAssociativeCache`` on its own: a randomised check against a plain full table (every
lookup returns slots holding exactly the current rows; write-back loses nothing), replacement
order of LRU and LFU, pinning by prefetch, transient placement, statistics and errors.

    python -m pytest tests/unit/embedding/test_cache.py -q
"""

from __future__ import annotations

from typing import List

import pytest
import torch

from neorec.embedding.cache import CacheTooSmallError, SetAssociativeCache
from neorec.embedding.ssd_store import SsdRowStore
from neorec.embedding.storage import DramRowStore

DIM = 4


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_cache(num_rows: int = 100, num_slots: int = 8, ways: int = 4, policy: str = "lru", store=None,
               background: bool = False, counts: bool = False) -> SetAssociativeCache:
    """Row r of the store holds r in every column; state momentum1 = -r."""
    if store is None:
        store = DramRowStore(num_rows, DIM, "fp32", {"momentum1": 1}, with_counts=counts, name="t")
        ids = torch.arange(num_rows)
        store.write(ids, ids.float().unsqueeze(1).expand(num_rows, DIM), {"momentum1": -ids.float()})
    weights = torch.zeros(num_slots, DIM)
    state = {"momentum1": torch.zeros(num_slots)}
    return SetAssociativeCache(store, weights, state, ways=ways, policy=policy, background=background)


def resident(cache: SetAssociativeCache) -> List[int]:
    return cache.resident_rows().tolist()


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("ways,num_slots", [(1, 16), (4, 16), (8, 64), (32, 64)])
@pytest.mark.parametrize("prefetch", [False, True])
def test_random_training_matches_a_full_table(tmp_path, policy, ways, num_slots, prefetch):
    """Updates applied through slots equal updates applied to a plain table, at every step and in
    the store after a flush; state travels with its row."""
    num_rows = 300
    generator = torch.Generator().manual_seed(ways * 7 + num_slots)
    truth = torch.randn(num_rows, DIM, generator=generator)
    truth_state = torch.rand(num_rows, generator=generator)
    store = SsdRowStore.create(tmp_path / "t", num_rows, DIM, "fp32", {"momentum1": 1}, with_counts=policy == "lfu")
    store.write(torch.arange(num_rows), truth, {"momentum1": truth_state})
    cache = make_cache(num_rows, num_slots, ways, policy, store=store, background=prefetch)
    batches = [(torch.rand(int(torch.randint(1, 40, (1,), generator=generator)), generator=generator) ** 2
                * num_rows).long() for _ in range(40)]
    for step, ids in enumerate(batches):
        if len(torch.unique(ids)) > num_slots:
            with pytest.raises(CacheTooSmallError):
                cache.lookup(ids)
            continue
        slots = cache.lookup(ids, update=step % 5 != 4)
        assert torch.equal(cache.weights[slots], truth[ids])
        assert torch.equal(cache.state["momentum1"][slots], truth_state[ids])
        if prefetch and step + 1 < len(batches):
            cache.prefetch(batches[step + 1])
        if step % 5 != 4:  # an "optimizer step" on the unique rows
            rows, first = torch.unique(ids, return_inverse=True)
            unique_slots = torch.empty_like(rows).index_put_((first,), slots)
            delta = torch.randn(rows.numel(), DIM, generator=generator)
            cache.weights.index_add_(0, unique_slots, delta)
            truth.index_add_(0, rows, delta)
            cache.state["momentum1"][unique_slots] += 1
            truth_state[rows] += 1
    cache.flush()
    rows, state = store.read(torch.arange(num_rows))
    assert torch.equal(rows, truth) and torch.equal(state["momentum1"], truth_state)
    stats = cache.stats
    assert stats.lookups == stats.hits + stats.misses
    assert stats.misses > 0 and stats.evictions > 0
    if prefetch:
        assert stats.prefetch_loads > 0
    cache.close()


def test_hits_misses_and_loaded_values():
    cache = make_cache(num_slots=8, ways=4)
    slots = cache.lookup(torch.tensor([5, 7, 5, 9]))
    assert slots[0] == slots[2] and len(set(slots.tolist())) == 3
    assert torch.equal(cache.weights[slots][:, 0], torch.tensor([5.0, 7, 5, 9]))
    assert torch.equal(cache.state["momentum1"][slots], torch.tensor([-5.0, -7, -5, -9]))
    cache.lookup(torch.tensor([7, 9, 11]))
    stats = cache.stats
    assert (stats.lookups, stats.hits, stats.misses) == (6, 2, 4)
    assert stats.bytes_loaded == 4 * (DIM + 1) * 4
    assert stats.as_dict()["hit_rate"] == pytest.approx(2 / 6)


def test_lru_evicts_the_least_recently_used_row():
    cache = make_cache(num_slots=4, ways=4)  # one set
    for ids in ([0, 1], [2, 3], [0]):
        cache.lookup(torch.tensor(ids), update=False)
    cache.lookup(torch.tensor([4]), update=False)  # 1 and 2/3 are older than 0; 1 was used first
    assert resident(cache) == [0, 2, 3, 4]
    cache.lookup(torch.tensor([5, 6]), update=False)
    assert resident(cache) == [0, 4, 5, 6]


def test_lfu_evicts_the_least_frequently_used_row_and_remembers_counts():
    cache = make_cache(num_slots=4, ways=4, policy="lfu", counts=True)
    for ids in ([0, 0, 0, 1], [2, 2, 3], [3, 3], [1, 1, 1]):
        cache.lookup(torch.tensor(ids), update=False)
    # counts: 0 -> 3, 1 -> 4, 2 -> 2, 3 -> 3
    cache.lookup(torch.tensor([4]), update=False)
    assert resident(cache) == [0, 1, 3, 4]
    cache.lookup(torch.tensor([5]), update=False)  # 4 (count 1) goes
    assert resident(cache) == [0, 1, 3, 5]
    assert cache.store.read_counts(torch.tensor([2, 4])).tolist() == [2, 1]  # counts written back
    cache.lookup(torch.tensor([2, 2, 2]), update=False)  # reloaded with its count: 2 + 3 = 5
    assert cache.counts[cache.lookup(torch.tensor([2]), update=False)].item() == 6


def test_dirty_rows_are_written_back_clean_rows_are_not():
    cache = make_cache(num_slots=2, ways=2)
    slot = cache.lookup(torch.tensor([10]), update=True)
    cache.weights[slot] = 99.0
    cache.state["momentum1"][slot] = 7.0
    cache.lookup(torch.tensor([11, 12]), update=False)  # 10 is evicted (its update is done)
    rows, state = cache.store.read(torch.tensor([10]))
    assert torch.equal(rows, torch.full((1, DIM), 99.0)) and state["momentum1"].item() == 7.0
    written = cache.store.rows_written
    cache.lookup(torch.tensor([13, 14]), update=False)  # 11 and 12 were clean
    assert cache.store.rows_written == written
    assert cache.stats.write_backs == 1 and cache.stats.evictions == 3


@pytest.mark.parametrize("background", [False, True])
def test_prefetch_loads_ahead_and_pins(background):
    cache = make_cache(num_slots=4, ways=4, background=background)  # one set
    cache.lookup(torch.tensor([0, 1]))
    cache.prefetch(torch.tensor([2, 3, 1]))  # 2 and 3 load into the empty ways; 1 is resident
    cache.wait()
    assert cache.stats.prefetch_loads == 2
    cache.prefetch(torch.tensor([4]))  # every way is pinned (0, 1 in flight; 2, 3 for the next)
    assert cache.stats.prefetch_skipped == 1
    slots = cache.lookup(torch.tensor([2, 3, 1]))  # the prefetched batch: all hits
    assert cache.stats.hits == 3 and torch.equal(cache.weights[slots][:, 0], torch.tensor([2.0, 3, 1]))
    cache.close()


def test_overfull_set_uses_transient_slots():
    cache = make_cache(num_rows=1000, num_slots=8, ways=2)  # 4 sets of 2 ways
    ids = torch.arange(1000)
    same_set = ids[cache._home_sets(ids) == 0][:3]  # three rows of one home set
    slots = cache.lookup(same_set)
    assert torch.equal(cache.weights[slots][:, 0], same_set.float())
    assert cache.stats.transient_rows == 1
    transient = int(cache.transient[0])
    cache.weights[transient] += 1  # the update of that row
    elsewhere = ids[(cache._home_sets(ids) != 0) & (cache._home_sets(ids) != transient // 2)][0]
    cache.lookup(elsewhere.view(1))  # next batch: the transient row is written back, its slot emptied
    assert cache.slot_rows[transient] == -1
    moved = int(same_set[(slots == transient).nonzero()[0, 0]])
    assert cache.store.read_rows(torch.tensor([moved]))[0, 0].item() == moved + 1


def test_read_and_write_see_rows_where_they_are_and_change_no_cache_state():
    """What checkpoints use: ``read`` takes a resident row from its slot (a dirty or transient one
    too: the latest values) and the others from the store; ``write`` sets both, and the slot it
    wrote becomes dirty so that its exact values reach the store."""
    cache = make_cache(num_rows=1000, num_slots=8, ways=2)
    ids = torch.arange(1000)
    same_set = ids[cache._home_sets(ids) == 0][:3]  # one of them lands in a transient slot
    slots = cache.lookup(same_set, update=True)
    cache.weights[slots] += 0.5  # the batch's update, not written back yet
    cache.state["momentum1"][slots] = 3.0
    before = {k: getattr(cache, k).clone() for k in ("slot_rows", "dirty", "last_use", "counts", "pinned_until")}
    stats = cache.stats.as_dict()
    wanted = torch.cat([same_set, torch.tensor([5, 999])]).flip(0)  # any order; two rows not resident
    rows, state = cache.read(wanted, cache.resident())
    expected = wanted.float() + torch.isin(wanted, same_set).float() * 0.5
    assert torch.equal(rows[:, 0], expected) and torch.equal(rows[:, 1], expected)
    assert torch.equal(state["momentum1"], torch.where(torch.isin(wanted, same_set), 3.0, -wanted.float()))
    assert all(torch.equal(getattr(cache, k), v) for k, v in before.items()) and cache.stats.as_dict() == stats
    cache.lookup(torch.tensor([], dtype=torch.int64), update=False)  # the update is done: the transient row
    cache.flush()  # goes back to the store, its slot emptied; every slot clean
    values = torch.arange(10.0).view(5, 2).repeat_interleave(DIM // 2, dim=1)
    cache.write(wanted, values, {"momentum1": -torch.arange(5.0)})
    again, state = cache.read(wanted)
    assert torch.equal(again, values) and torch.equal(state["momentum1"], -torch.arange(5.0))
    stored, stored_state = cache.store.read(wanted)
    assert torch.equal(stored, values) and torch.equal(stored_state["momentum1"], -torch.arange(5.0))
    written = torch.isin(cache.slot_rows, wanted)
    assert int(written.sum()) == 2  # the rows of the home set's two ways
    slot_values = {int(r): cache.weights[i, 0].item() for i, r in zip(written.nonzero()[:, 0], cache.slot_rows[written])}
    assert slot_values == {int(r): v[0].item() for r, v in zip(wanted, values) if int(r) in slot_values}
    assert bool(cache.dirty[written].all()) and not bool(cache.dirty[~written].any())


def test_too_many_rows_for_the_cache_changes_nothing():
    cache = make_cache(num_slots=4, ways=2)
    cache.lookup(torch.tensor([1, 2]))
    generation, resident_before = cache.generation, resident(cache)
    with pytest.raises(CacheTooSmallError, match="needs 5 distinct rows .* has 4 slots"):
        cache.lookup(torch.arange(10, 15))
    assert cache.generation == generation and resident(cache) == resident_before


def test_constructor_errors():
    store = DramRowStore(10, DIM, "fp32", {"momentum1": 1})
    with pytest.raises(ValueError, match="policy must be one of"):
        SetAssociativeCache(store, torch.zeros(4, DIM), {"momentum1": torch.zeros(4)}, ways=2, policy="mru")
    with pytest.raises(ValueError, match="not a positive multiple of ways=4"):
        SetAssociativeCache(store, torch.zeros(6, DIM), {"momentum1": torch.zeros(6)}, ways=4)
    with pytest.raises(ValueError, match="weights must be"):
        SetAssociativeCache(store, torch.zeros(4, DIM + 1), {"momentum1": torch.zeros(4)}, ways=2)
    with pytest.raises(ValueError, match="state fields"):
        SetAssociativeCache(store, torch.zeros(4, DIM), {}, ways=2)


def test_a_transient_row_the_store_refuses_stays_tracked_and_is_not_loaded_twice():
    """A row placed outside its home set whose write-back the store refused was forgotten: its slot
    stayed dirty but untracked, so the next lookup of that row loaded the stale store copy into its
    home set (two resident copies, the slot's update lost)."""
    store = DramRowStore(1000, 2, "fp16", {}, False)
    store.write_range(0, torch.arange(2000.0).view(1000, 2) / 1000)
    cache = SetAssociativeCache(store, torch.zeros(8, 2), {}, ways=2)
    ids = torch.arange(1000)
    same = ids[cache._home_sets(ids) == 0][:3]
    cache.lookup(same)  # three rows of one 2-way set: one goes to a transient slot
    slot = int(cache.transient[0])
    row = int(cache.slot_rows[slot])
    cache.weights[slot] = 1e6  # past fp16's largest value: the write-back is refused
    other = torch.tensor([int(ids[cache._home_sets(ids) == 3][0])])
    with pytest.raises(ValueError, match="beyond the largest fp16 value"):
        cache.lookup(other)
    assert cache.transient is not None and int(cache.transient[0]) == slot and bool(cache.dirty[slot])
    cache.weights[slot] = 5.0  # repaired: the next lookup writes it back and goes on
    found = cache.lookup(torch.tensor([row]))
    rows, _ = cache.resident()
    assert rows.numel() == rows.unique().numel()  # one copy of every row
    assert cache.weights[found[0]].tolist() == [5.0, 5.0]
    assert store.read_rows(torch.tensor([row]))[0].tolist() == [5.0, 5.0]


@pytest.mark.parametrize("background", [False, True])
def test_a_row_the_store_cannot_hold_is_refused_and_the_cache_stays_consistent(background):
    """fp16 rows hold at most 65504: a cached row grown past it is refused at write-back (it was
    stored as inf), and the failed load leaves every slot holding the row it says it holds."""
    from neorec.embedding import SparseOptimizerConfig, TableConfig
    from neorec.embedding.cached import CachedEmbeddingBagCollection
    from neorec.embedding.locations import TableLocation
    from neorec.sparse import KeyedJaggedTensor

    location = TableLocation("cached_dram", cache_rows=1, ways=1, precision="fp16", background_prefetch=background)
    cached = CachedEmbeddingBagCollection([TableConfig("t", 64, 4)], SparseOptimizerConfig("sgd", 1.0),
                                          locations={"t": location})
    batch = lambda row: KeyedJaggedTensor(["t"], torch.tensor([row]), torch.tensor([1]))  # noqa: E731
    (cached(batch(0)).values * -7e4).sum().backward()  # row 0 is now about 70000: fine in the fp32 cache
    big = cached.table_weight("t")[0].clone()
    assert float(big.min()) > 65504
    row_1 = cached.caches["t"].store.read_rows(torch.tensor([1]))
    with pytest.raises(ValueError, match=r"row store 't': a row holds 7[\d.]+, beyond the largest fp16 value \(65504\)"):
        cached(batch(1))  # evicts row 0
    cache = cached.caches["t"]
    assert int(cache.slot_rows[0]) == 0 and bool(cache.dirty[0]) and torch.equal(cache.weights[0], big)
    assert torch.equal(cached.table_weight("t")[1], row_1[0])  # row 1 is read from the store, as it is there
