"""The Triton cache kernels (``kernels/triton_cache.py``) give exactly what the cache's torch
methods give: ``_find`` (slot or -1, home set) and ``_place`` (victim slots, -1, pins) on random
cache states (empty ways, pinned ways, LRU and LFU, sets with several misses, more misses than
ways); and a cache whose find/place run on the kernels trains bit for bit like the torch one.

On a CPU machine the kernels run in triton's interpreter (tests/gpu/conftest.py sets
TRITON_INTERPRET=1) on CPU tensors; with CUDA the Triton side runs on the GPU.

    python -m pytest tests/gpu/test_triton_cache.py -q
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from neorec.embedding import EmbeddingBagCollection, SparseOptimizerConfig, TableConfig  # noqa: E402
from neorec.embedding.cache import SetAssociativeCache  # noqa: E402
from neorec.embedding.cache_kernels import choose_cache_kernel  # noqa: E402
from neorec.embedding.cached import CachedEmbeddingBagCollection  # noqa: E402
from neorec.embedding.kernels import triton_cache  # noqa: E402
from neorec.embedding.locations import TableLocation  # noqa: E402
from neorec.embedding.storage import DramRowStore  # noqa: E402
from neorec.sparse import KeyedJaggedTensor  # noqa: E402

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUM_ROWS = 2000
DIM = 2
METADATA = ("slot_rows", "last_use", "counts", "pinned_until")


def make_cache(ways: int, num_sets: int, policy: str, kernel: str, device: str = "cpu") -> SetAssociativeCache:
    store = DramRowStore(NUM_ROWS, DIM, "fp32", {}, name="t")
    weights = torch.zeros(ways * num_sets, DIM, device=device)
    return SetAssociativeCache(store, weights, {}, ways=ways, policy=policy, name="t", kernel=kernel)


def random_state(cache: SetAssociativeCache, generator: torch.Generator, empty: float, pinned: float) -> None:
    """Every slot empty (probability ``empty``) or holding a distinct row of its home set; random
    last uses and counts with many ties; ways pinned beyond ``completed`` with probability ``pinned``."""
    rows = torch.randperm(NUM_ROWS, generator=generator)
    homes = cache._home_sets(rows.clone())
    slot_rows = torch.full((cache.num_slots,), -1, dtype=torch.int64)
    for set_id in range(cache.num_sets):
        members = rows[homes == set_id][: cache.ways]
        keep = torch.rand(members.numel(), generator=generator) >= empty
        members = members[keep]
        slot_rows[set_id * cache.ways : set_id * cache.ways + members.numel()] = members
    slot_rows = slot_rows.view(cache.num_sets, cache.ways)
    slot_rows = slot_rows.gather(1, torch.argsort(torch.rand(slot_rows.shape, generator=generator), 1)).flatten()
    cache.completed, cache.generation = 5, 5
    cache.slot_rows = slot_rows
    cache.last_use = torch.randint(0, 6, (cache.num_slots,), generator=generator)
    cache.counts = torch.randint(0, 4, (cache.num_slots,), generator=generator)
    cache.counts[0] = 1 << 40  # clamped to 2**31 - 1 by the LFU key
    cache.last_use[-1] = (1 << 32) + 3  # only its low 31 bits enter the LFU key
    live_pin = torch.rand(cache.num_slots, generator=generator) < pinned
    cache.pinned_until = torch.where(live_pin, 6, torch.randint(0, 6, (cache.num_slots,), generator=generator))


def copy_state(source: SetAssociativeCache, target: SetAssociativeCache) -> None:
    for name in METADATA:
        setattr(target, name, getattr(source, name).clone().to(target.device))
    target.completed, target.generation = source.completed, source.generation


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("ways,num_sets", [(1, 16), (4, 8), (5, 3), (32, 2), (80, 2)])
def test_kernels_equal_torch_find_and_place(policy, ways, num_sets):
    generator = torch.Generator().manual_seed(ways * 31 + num_sets)
    reference = make_cache(ways, num_sets, policy, "torch")
    kernel = make_cache(ways, num_sets, policy, "triton", DEVICE)
    assert kernel.uses_triton and not reference.uses_triton
    for trial, (empty, pinned) in enumerate([(0.3, 0.2), (0.0, 0.0), (0.8, 0.5), (0.1, 0.9)]):
        random_state(reference, generator, empty, pinned)
        copy_state(reference, kernel)
        resident = reference.slot_rows[reference.slot_rows >= 0]
        resident = resident[torch.randperm(resident.numel(), generator=generator)[: max(1, resident.numel() // 2)]]
        absent = torch.randint(0, NUM_ROWS, (min(3 * ways * num_sets // 2 + 3, 60),), generator=generator)
        rows = torch.unique(torch.cat([resident, absent]))
        rows = rows[torch.randperm(rows.numel(), generator=generator)]  # _place keeps input order as rank
        expected_slots, expected_sets = reference._find(rows)
        slots, sets = kernel._find(rows.to(DEVICE))
        assert torch.equal(slots.cpu(), expected_slots) and torch.equal(sets.cpu(), expected_sets)
        assert int((expected_slots >= 0).sum()) >= resident.numel()  # the resident rows are found
        miss = expected_slots < 0
        per_set = torch.bincount(expected_sets[miss], minlength=num_sets)
        assert int(per_set.max()) > 1  # several misses in a set
        if trial == 0:
            assert int(per_set.max()) > ways or ways > 16  # more misses than ways somewhere
        expected = reference._place(rows[miss], expected_sets[miss], generation=7)
        got = kernel._place(rows[miss].to(DEVICE), sets[miss.to(DEVICE)], generation=7)
        assert torch.equal(got.cpu(), expected), f"trial {trial}"
        assert torch.equal(kernel.pinned_until.cpu(), reference.pinned_until)
        placed = expected[expected >= 0]
        assert placed.unique().numel() == placed.numel()
        if trial == 1:
            assert bool((expected >= 0).any())


def test_place_edge_cases_and_empty_inputs():
    slot_rows = torch.full((8,), -1, dtype=torch.int64, device=DEVICE)
    zeros = torch.zeros(8, dtype=torch.int64, device=DEVICE)
    pinned = zeros.clone()
    slots = triton_cache.cache_place(slot_rows, zeros, zeros, pinned, 4, False, 0, 3,
                                     torch.tensor([1, 1, 1, 1, 1, 0], dtype=torch.int64, device=DEVICE))
    # all ways empty with equal keys: lowest way first; the fifth miss of set 1 finds no way
    assert slots.tolist() == [4, 5, 6, 7, -1, 0]
    assert pinned.tolist() == [3, 0, 0, 0, 3, 3, 3, 3]
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    assert triton_cache.cache_place(slot_rows, zeros, zeros, pinned, 4, True, 0, 3, empty).numel() == 0
    found, sets = triton_cache.cache_find(slot_rows, 2, 4, empty, 12345)
    assert found.numel() == 0 and sets.numel() == 0


def test_kernel_choice():
    assert not make_cache(4, 2, "lru", "auto").uses_triton  # CPU tensors: torch ops, even when interpreting
    with pytest.raises(ValueError, match=r"cache 't': kernel must be one of"):
        make_cache(4, 2, "lru", "cuda")
    assert choose_cache_kernel("triton", torch.device(DEVICE), "t")
    assert make_cache(4, 2, "lru", "auto", DEVICE).uses_triton == (DEVICE == "cuda")


def test_kernel_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    reason = ("the cache's tensors are on the CPU" if torch.cuda.is_available() else
              r"there is no CUDA device \(TRITON_INTERPRET=1 runs the kernels on CPU tensors")
    with pytest.raises(ValueError, match=f"kernel='triton' was asked for but {reason}"):
        choose_cache_kernel("triton", torch.device("cpu"), "t")


TABLES = [TableConfig("a", 300, 4, ["f_a"]), TableConfig("b", 150, 8, ["f_b1", "f_b2"], pooling="mean")]
ROWS = {"f_a": 300, "f_b1": 150, "f_b2": 150}


def batches(count: int, batch_size: int = 16):
    generator = torch.Generator().manual_seed(3)
    out = []
    for _ in range(count):
        lengths = torch.randint(0, 4, (len(ROWS), batch_size), generator=generator)
        values = torch.cat([(torch.rand(int(lengths[k].sum()), generator=generator) ** 2 * rows).long()
                            for k, rows in enumerate(ROWS.values())])
        out.append(KeyedJaggedTensor(list(ROWS), values, lengths.flatten()))
    return out


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_training_through_kernel_cache_is_bit_identical(monkeypatch, policy):
    """Same pooled outputs at every step, same rows and state in the stores after a flush, and
    the same cache statistics, with prefetch, evictions and (ways=4, 32 slots) transient rows.
    With CUDA all three modules run there (the fused op then takes its Triton path in all three)."""
    calls = {"find": 0, "place": 0}
    for name in calls:
        real = getattr(triton_cache, f"cache_{name}")

        def counted(*args, _real=real, _name=name):
            calls[_name] += 1
            return _real(*args)

        monkeypatch.setattr(triton_cache, f"cache_{name}", counted)
    optimizer = SparseOptimizerConfig(kind="rowwise_adagrad", learning_rate=0.1)
    locations = {"a": TableLocation("cached_dram", cache_rows=32, ways=4, policy=policy),
                 "b": TableLocation("cached_dram", cache_rows=64, ways=8, policy=policy)}
    plain = EmbeddingBagCollection(TABLES, optimizer, init_seed=4, device=DEVICE)
    modules = {kernel: CachedEmbeddingBagCollection(TABLES, optimizer, locations=locations, init_seed=4,
                                                    device=DEVICE, cache_kernel=kernel)
               for kernel in ("torch", "triton")}
    assert all(c.uses_triton for c in modules["triton"].caches.values())
    assert not any(c.uses_triton for c in modules["torch"].caches.values())
    generator = torch.Generator().manual_seed(1)
    stream = [kjt.to(DEVICE) for kjt in batches(4)]
    for step, kjt in enumerate(stream):
        if step + 1 < len(stream):  # the next batch's rows load (and are pinned) during this step
            for module in modules.values():
                module.prefetch(stream[step + 1])
        outputs = [module(kjt).values for module in (plain, modules["torch"], modules["triton"])]
        assert torch.equal(outputs[1], outputs[0]) and torch.equal(outputs[2], outputs[1]), f"step {step}"
        grad = torch.randn(outputs[0].shape, generator=generator).to(DEVICE)
        for output in outputs:
            (output * grad).sum().backward()
    assert calls["find"] > 0 and calls["place"] > 0
    for name in locations:
        torch_cache, kernel_cache = modules["torch"].caches[name], modules["triton"].caches[name]
        assert kernel_cache.stats == torch_cache.stats
        assert torch_cache.stats.evictions > 0
        for field in METADATA:
            assert torch.equal(getattr(kernel_cache, field), getattr(torch_cache, field)), (name, field)
    assert sum(c.stats.transient_rows for c in modules["torch"].caches.values()) > 0
    for module in modules.values():
        module.flush()
    for name in locations:
        rows = torch.arange(TABLES[[t.name for t in TABLES].index(name)].num_embeddings)
        expected_values, expected_state = modules["torch"].caches[name].store.read(rows)
        values, state = modules["triton"].caches[name].store.read(rows)
        assert torch.equal(values, expected_values)
        assert all(torch.equal(state[key], expected_state[key]) for key in expected_state)
