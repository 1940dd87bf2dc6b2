"""A set-associative software cache of embedding rows (and their optimizer state) in fast memory,
in front of a ``RowStore`` (host DRAM or SSD), with LRU or LFU replacement, write-back of dirty
rows, and prefetch that pins the next batch's rows.

    cache = SetAssociativeCache(store, weights, state, ways=32, policy="lru")
    slots = cache.lookup(ids)          # [N] slot of every id; misses loaded, victims written back
    ...                                # the caller trains weights[slots] / state[slots] in place
    cache.prefetch(next_ids)           # load the next batch's rows ahead (optionally in a thread)
    cache.flush()                      # write every dirty row (+ state) back to the store
    rows, state = cache.read(ids)      # rows as training sees them (slot or store), between steps
    cache.write(ids, rows, state)      # set rows in the store and in their slot (checkpoint restore)

The cache does not own its fp32 storage: ``weights`` [num_slots, dim] and ``state``
({name: [num_slots] or [num_slots, dim]}) are views given by the caller. In
``CachedEmbeddingBagCollection`` they are a table's slice of the fused module's flat weight and
optimizer-state buffers, so the unchanged fused forward/backward/optimizer runs on slot ids.

Organisation. ``num_slots = num_sets * ways``; row ``r`` may live only in set ``hash(r) % num_sets``
(its "home" set), in any of its ``ways`` slots. Per slot the cache keeps the row id (-1 = empty), a
dirty bit, the last use (a tick per lookup), an access count (LFU) and the generation until which
the slot is pinned.

One lookup, all vectorised (no Python loop over ids or sets):
  1. unique ids; each compared with the ``ways`` row ids of its home set -> hits;
  2. hits are pinned for this batch (generation ``g``) and never evicted while it is in flight;
  3. misses are grouped by set (stable sort) and ranked within their set; each set's ways are
     ordered by victim priority (empty first, then LRU: oldest use / LFU: fewest accesses, ties by
     oldest use; pinned ways last and unusable), and the ``k``-th miss of a set takes the ``k``-th
     victim;
  4. misses that find no usable way in their home set (more distinct rows of one batch than
     ``ways`` in a set, or ways pinned by a prefetched batch) take the globally best victims of
     any set as *transient* slots: written back and emptied once the batch's update is done. Only
     a batch with more distinct rows than the cache has slots is an error;
  5. dirty victims are written back (row + state, and the count for LFU) in one store write,
     the misses read in one store read and copied into their slots.

Generations. Lookup ``g`` declares lookup ``g - 1``'s update done (the caller runs each batch's
backward before the next lookup). ``prefetch(ids)`` after lookup ``g`` pins its rows for lookup
``g + 1``; what does not fit is skipped (prefetch is a hint, never needed for correctness).
With ``background=True`` the prefetch's data movement (write-back of its victims, reads, copies
into free slots) runs in a worker thread while the current batch trains: its victims are unpinned
slots, which the current batch does not touch; the next lookup or flush waits for it first.

Statistics (``stats``): distinct ids looked up, hits, misses, evictions, write-backs, prefetch
loads and skips, transient rows, and bytes moved into and out of fast memory (fp32 rows + state);
the store counts the bytes it read and wrote in its own (possibly low-precision) format.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Dict, Mapping, Optional, Tuple

import numpy as np
import torch

from neorec.embedding import cache_kernels
from neorec.embedding.storage import RowStore

POLICIES = ("lru", "lfu")
_UNAVAILABLE = torch.iinfo(torch.int64).max
_HASH = 0x9E3779B97F4A7C15 - (1 << 64)  # golden-ratio multiplier as a signed int64 (wrapping multiply)
_FIND_CHUNK = 1 << 21  # set entries compared at a time in _find (bounds the [n, ways] temporaries)
_FLUSH_CHUNK = 1 << 14  # slots written back per store write in flush (bounds the pages touched at once)


def unique_with_inverse(ids: torch.Tensor):
    """(sorted unique ids [U], inverse [N], counts [U]) like ``torch.unique``. On CPU one NumPy
    sort of the unique keys ``id << bits | position`` (several times faster than torch's)."""
    count = ids.numel()
    position_bits = max(1, (count - 1).bit_length())
    if ids.device.type != "cpu" or count == 0 or int(ids.max()).bit_length() + position_bits > 62 or int(ids.min()) < 0:
        return torch.unique(ids, return_inverse=True, return_counts=True)
    keys = ids.numpy().astype(np.int64, copy=True)
    np.left_shift(keys, position_bits, out=keys)
    keys |= np.arange(count, dtype=np.int64)
    keys.sort()
    rows = keys >> position_bits
    first = np.empty(count, dtype=bool)
    first[0] = True
    np.not_equal(rows[1:], rows[:-1], out=first[1:])
    inverse = np.empty(count, dtype=np.int64)
    inverse[keys & ((1 << position_bits) - 1)] = np.cumsum(first) - 1
    starts = np.flatnonzero(first)
    counts = np.diff(np.append(starts, count))
    return torch.from_numpy(rows[starts]), torch.from_numpy(inverse), torch.from_numpy(counts)


class CacheTooSmallError(ValueError):
    """A batch needs more distinct rows of one table than its cache has slots."""

    def __init__(self, name: str, needed: int, num_slots: int) -> None:
        super().__init__(
            f"cache {name!r}: one batch needs {needed} distinct rows of this table but the cache has {num_slots} "
            f"slots; raise the table's cache size (cache_rows / cache_fraction) to at least the distinct rows of a batch")
        self.name, self.needed, self.num_slots = name, needed, num_slots


@dataclass
class CacheStats:
    """Counters since construction (or ``reset_stats``). Ids are counted once per lookup."""

    lookups: int = 0  # distinct ids looked up
    hits: int = 0  # of those, resident at lookup time (prefetched rows included)
    misses: int = 0  # loaded by the lookup itself (the training step waits for them)
    evictions: int = 0  # resident rows displaced by a load
    write_backs: int = 0  # dirty rows written to the store
    prefetch_requests: int = 0  # distinct ids given to prefetch
    prefetch_loads: int = 0  # rows loaded ahead by prefetch
    prefetch_skipped: int = 0  # prefetch ids that found no free way in their set
    transient_rows: int = 0  # rows placed outside their home set for one batch
    bytes_loaded: int = 0  # fp32 bytes (row + state) moved into fast memory
    bytes_written_back: int = 0  # fp32 bytes moved out of fast memory to the store

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else float("nan")

    def as_dict(self) -> Dict[str, float]:
        out = asdict(self)
        out["hit_rate"] = self.hit_rate
        return out


class SetAssociativeCache:
    """Set-associative cache of rows of ``store`` in ``weights`` / ``state`` (see module doc).

    Args:
        store: the backing ``RowStore``; its state fields must match ``state``.
        weights: [num_slots, dim] fp32 slot storage (any device; metadata lives there too).
        state: optimizer state per slot, {name: [num_slots] or [num_slots, dim]} fp32.
        ways: slots per set; ``num_slots`` must be a multiple of it.
        policy: "lru" or "lfu". LFU keeps each row's access count in the store when the store
            has counts (``with_counts=True``), else counts accesses since the row was loaded.
        background: run prefetch data movement in a worker thread.
        name: used in error messages.
        kernel: "auto" (Triton lookup/victim kernels for CUDA tensors when triton is installed,
            else torch ops), "torch", or "triton" (insist); see ``cache_kernels.py``.
    """

    def __init__(self, store: RowStore, weights: torch.Tensor, state: Optional[Dict[str, torch.Tensor]] = None,
                 ways: int = 32, policy: str = "lru", background: bool = False, name: str = "",
                 kernel: str = "auto") -> None:
        self.name = name or store.name
        if policy not in POLICIES:
            raise ValueError(f"cache {self.name!r}: policy must be one of {POLICIES}, got {policy!r}")
        if isinstance(ways, bool) or not isinstance(ways, int) or ways <= 0:
            raise ValueError(f"cache {self.name!r}: ways must be a positive integer, got {ways!r}")
        num_slots = int(weights.shape[0])
        if num_slots == 0 or num_slots % ways:
            raise ValueError(f"cache {self.name!r}: {num_slots} slots is not a positive multiple of ways={ways}")
        self.store = store
        self.ways = ways
        self.num_slots = num_slots
        self.num_sets = num_slots // ways
        self.policy = policy
        self.bind(weights, state or {})
        device = weights.device
        self.device = device
        self.kernel = kernel
        self.uses_triton = cache_kernels.choose_cache_kernel(kernel, device, self.name)
        self.slot_rows = torch.full((num_slots,), -1, dtype=torch.int64, device=device)
        self.last_use = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.counts = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.dirty = torch.zeros(num_slots, dtype=torch.bool, device=device)
        self.pinned_until = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self._store_counts = policy == "lfu" and store.format.with_counts
        self.transient: Optional[torch.Tensor] = None
        self.generation = 0  # lookups so far; lookup g pins its slots with g
        self.completed = 0  # the latest generation whose update is done
        self.tick = 0
        self.stats = CacheStats()
        self._row_bytes = 4 * (store.dim + sum(width for _, width in store.format.state))
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cache-prefetch") if background else None
        self._pending: Optional[Future] = None
        self._prefetched = None  # (ids, unique, inverse, occurrences, slots) of the last prefetch

    # ------------------------------------------------------------------------------ setup
    def bind(self, weights: torch.Tensor, state: Dict[str, torch.Tensor]) -> None:
        """(Re)attach the slot storage (e.g. after the owning module replaced its buffers)."""
        store = self.store
        if weights.dim() != 2 or weights.shape[1] != store.dim or weights.dtype != torch.float32:
            raise ValueError(f"cache {self.name!r}: weights must be [num_slots, {store.dim}] fp32, got "
                             f"{tuple(weights.shape)} {weights.dtype}")
        if hasattr(self, "num_slots") and weights.shape[0] != self.num_slots:
            raise ValueError(f"cache {self.name!r}: expected {self.num_slots} slots, got {weights.shape[0]}")
        if set(state) != set(store.format.state_names):
            raise ValueError(f"cache {self.name!r}: state fields {sorted(state)} differ from the store's "
                             f"{sorted(store.format.state_names)}")
        self.weights, self.state = weights, dict(state)

    def reset_stats(self) -> None:
        self.stats = CacheStats()

    # ------------------------------------------------------------------------------ helpers
    def _home_sets(self, rows: torch.Tensor) -> torch.Tensor:
        mixed = rows * _HASH
        mixed = mixed ^ (mixed >> 29)
        return mixed.remainder_(self.num_sets)

    def _find(self, rows: torch.Tensor):
        """(slot of each row or -1 [n], home set [n]) for unique ``rows`` [n]."""
        if self.uses_triton:
            return cache_kernels.find(self, rows, _HASH)
        sets = self._home_sets(rows)
        slots = torch.empty_like(rows)
        table = self.slot_rows.view(self.num_sets, self.ways)
        step = max(1, _FIND_CHUNK // self.ways)
        for start in range(0, rows.numel(), step):
            part_sets, part_rows = sets[start : start + step], rows[start : start + step]
            way = (table.index_select(0, part_sets) == part_rows.unsqueeze(1)).to(torch.uint8).argmax(1)
            slot = part_sets * self.ways + way  # way 0 when absent: check it
            slots[start : start + step] = torch.where(self.slot_rows.index_select(0, slot) == part_rows, slot, -1)
        return slots, sets

    def _victim_keys(self, sets: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Eviction priority of the ways of ``sets`` [D] -> [D, ways] (None: every slot -> [S]):
        lower goes first; empty = -1; pinned = _UNAVAILABLE."""
        def gather(values: torch.Tensor) -> torch.Tensor:
            return values if sets is None else values.view(self.num_sets, self.ways).index_select(0, sets)

        last_use = gather(self.last_use)
        if self.policy == "lru":
            key = last_use
        else:
            key = (gather(self.counts).clamp(max=(1 << 31) - 1) << 31) | (last_use & ((1 << 31) - 1))
        key = key.masked_fill(gather(self.slot_rows) < 0, -1)
        return key.masked_fill(gather(self.pinned_until) > self.completed, _UNAVAILABLE)

    def _place(self, rows: torch.Tensor, sets: torch.Tensor, generation: int) -> torch.Tensor:
        """Slots for rows that missed (their home ``sets``), or -1 where the set has no usable way.
        The chosen slots are pinned with ``generation``.

        Misses are sorted by set and ranked within it; the ``r``-th miss of a set takes the set's
        ``r``-th best victim. Sets with one miss (most) take theirs by one ``argmin`` over the ways,
        the others by one sort of their ways; both put ties on the lowest way, deterministically."""
        if self.uses_triton:
            return cache_kernels.place(self, sets, generation)
        count, ways = rows.numel(), self.ways
        order = torch.argsort(sets, stable=True)
        set_ids, per_set = torch.unique_consecutive(sets.index_select(0, order), return_counts=True)
        which = torch.repeat_interleave(torch.arange(set_ids.numel(), device=rows.device), per_set, output_size=count)
        rank = torch.arange(count, device=rows.device) - torch.cumsum(per_set, 0).sub_(per_set).index_select(0, which)
        keys = self._victim_keys(set_ids)  # [D, ways]
        way = keys.argmin(1)
        best = set_ids * ways + way
        best.masked_fill_(keys.gather(1, way.unsqueeze(1)).squeeze(1) == _UNAVAILABLE, -1)
        chosen = best.index_select(0, which)  # right for every set's first miss
        later = rank > 0
        if bool(later.any()):
            several = (per_set > 1).nonzero().squeeze(1)
            sorted_keys, way_order = torch.sort(keys.index_select(0, several), dim=1, stable=True)
            position = torch.full_like(per_set, -1).index_put_((several,), torch.arange(several.numel(), device=rows.device))
            in_several = position.index_select(0, which) >= 0
            row, r = position.index_select(0, which)[in_several], rank[in_several].clamp(max=ways - 1)
            ok = (rank[in_several] < ways) & (sorted_keys[row, r] != _UNAVAILABLE)
            chosen[in_several] = torch.where(ok, set_ids.index_select(0, which[in_several]) * ways + way_order[row, r], -1)
        slots = torch.empty_like(chosen).index_put_((order,), chosen)
        placed = slots[slots >= 0]
        self.pinned_until[placed] = torch.clamp(self.pinned_until[placed], min=generation)
        return slots

    def _place_anywhere(self, count: int, generation: int, batch_slots: torch.Tensor) -> torch.Tensor:
        """``count`` transient slots from any set (best victims first), pinned with ``generation``.
        ``batch_slots``: the slots this lookup already holds."""
        keys = self._victim_keys()
        usable = int(keys.ne(_UNAVAILABLE).sum())
        if usable < count:
            # pins for another lookup (a prefetch) are hints: give them up first
            others = self.pinned_until > self.completed
            others[batch_slots] = False
            self.pinned_until[others] = self.completed
            keys = self._victim_keys()
            usable = int(keys.ne(_UNAVAILABLE).sum())
        assert usable >= count, "lookup checks that the batch fits the cache before placing any row"
        slots = torch.sort(keys, stable=True).indices[:count]
        self.pinned_until[slots] = generation
        self.transient = slots if self.transient is None else torch.cat([self.transient, slots])
        self.stats.transient_rows += count
        return slots

    def _write_back(self, slots: torch.Tensor, rows: torch.Tensor, dirty: torch.Tensor, counts: torch.Tensor) -> None:
        """Write dirty ``slots`` (holding ``rows``) to the store: row, state and (LFU) count; for
        clean slots only the count changes (LFU with store counts)."""
        if slots.numel() == 0:
            return
        if bool(dirty.any()):
            dirty_slots = slots[dirty]
            state = {name: value.index_select(0, dirty_slots).cpu() for name, value in self.state.items()}
            self.store.write(rows[dirty].cpu(), self.weights.index_select(0, dirty_slots).cpu(), state,
                             counts=counts[dirty].cpu() if self._store_counts else None)
            self.stats.write_backs += dirty_slots.numel()
            self.stats.bytes_written_back += dirty_slots.numel() * self._row_bytes
        if self._store_counts and not bool(dirty.all()):
            clean = ~dirty
            self.store.write_counts(rows[clean].cpu(), counts[clean].cpu())

    def _load(self, slots: torch.Tensor, rows: torch.Tensor, background: bool) -> None:
        """Evict the occupants of ``slots`` (writing dirty ones back) and load ``rows`` there.
        Metadata changes now; the data moves now or in the worker thread."""
        old = self.slot_rows.index_select(0, slots)
        valid = old >= 0
        victim_slots, victim_rows = slots[valid], old[valid]
        victim_dirty = self.dirty.index_select(0, victim_slots)
        victim_counts = self.counts.index_select(0, victim_slots)
        old_dirty, old_counts = self.dirty.index_select(0, slots), self.counts.index_select(0, slots)
        old_use = self.last_use.index_select(0, slots)
        self.stats.evictions += victim_slots.numel()
        self.slot_rows[slots] = rows
        self.dirty[slots] = False
        self.counts[slots] = 0
        self.last_use[slots] = self.tick
        self.stats.bytes_loaded += rows.numel() * self._row_bytes

        def move() -> None:
            try:  # the slots' data changes only after both store calls succeeded
                self._write_back(victim_slots, victim_rows, victim_dirty, victim_counts)
                cpu_rows = rows.cpu()
                values, state = self.store.read(cpu_rows)
                counts = self.store.read_counts(cpu_rows) if self._store_counts else None
            except BaseException:  # the slots still hold their old rows: say so again
                self.slot_rows[slots], self.dirty[slots] = old, old_dirty
                self.counts[slots], self.last_use[slots] = old_counts, old_use
                raise
            self.weights.index_copy_(0, slots, values.to(self.device))
            for name, value in state.items():
                self.state[name].index_copy_(0, slots, value.to(self.device))
            if counts is not None:
                self.counts.index_copy_(0, slots, counts.to(self.device))

        if background and self._executor is not None:
            self._pending = self._executor.submit(move)
        else:
            move()

    def _complete(self) -> None:
        """The latest lookup's update is done: unpin its slots, write back and empty transients."""
        self.completed = self.generation
        if self.transient is None:
            return
        slots = self.transient
        self._write_back(slots, self.slot_rows.index_select(0, slots), self.dirty.index_select(0, slots),
                         self.counts.index_select(0, slots))
        self.transient = None  # (after the write-back: one the store refused keeps them tracked)
        self.slot_rows[slots] = -1
        self.dirty[slots] = False
        self.counts[slots] = 0
        self.last_use[slots] = 0

    # ------------------------------------------------------------------------------ public API
    def wait(self) -> None:
        """Wait for a background prefetch (re-raising its error, if any)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def lookup(self, ids: torch.Tensor, update: bool = True) -> torch.Tensor:
        """Map ``ids`` [N] (rows of the store, any order, repeats allowed) to slots [N] int64,
        loading misses. The previous lookup's update must be done. ``update``: the caller will
        modify the rows (marks them dirty). Raises ``CacheTooSmallError`` (before changing
        anything) when ``ids`` hold more distinct rows than the cache has slots."""
        ids = ids.to(self.device, torch.int64)
        known, self._prefetched = self._prefetched, None
        if known is not None and known[0].shape == ids.shape and torch.equal(known[0], ids):
            unique, inverse, occurrences, candidates = known[1:]  # the prefetched batch: no search
        else:
            unique, inverse, occurrences = unique_with_inverse(ids)
            candidates = None
        if unique.numel() > self.num_slots:
            raise CacheTooSmallError(self.name, unique.numel(), self.num_slots)
        self.wait()
        self._complete()
        self.generation += 1
        self.tick += 1
        generation = self.generation
        if candidates is None:
            slots, sets = self._find(unique)
        else:  # prefetched slots still hold their rows unless a pin was given up since
            slots = torch.where(self.slot_rows.index_select(0, candidates.clamp(min=0)) == unique, candidates, -1)
            sets = None
        hit = slots >= 0
        num_hits = int(hit.sum())
        if candidates is not None and num_hits < unique.numel():  # rows prefetch skipped: search
            miss = ~hit
            found, _ = self._find(unique[miss])
            slots[miss] = found
            hit = slots >= 0
            num_hits = int(hit.sum())
        self.stats.lookups += unique.numel()
        self.stats.hits += num_hits
        self.stats.misses += unique.numel() - num_hits
        hit_slots = slots[hit]
        self.pinned_until[hit_slots] = torch.clamp(self.pinned_until[hit_slots], min=generation)
        if num_hits < unique.numel():
            miss = ~hit
            miss_rows = unique[miss]
            placed = self._place(miss_rows, self._home_sets(miss_rows) if sets is None else sets[miss], generation)
            overflow = placed < 0
            if bool(overflow.any()):
                held = torch.cat([slots[hit], placed[~overflow]])
                placed[overflow] = self._place_anywhere(int(overflow.sum()), generation, held)
            slots[miss] = placed
            self._load(placed, miss_rows, background=False)
        self.last_use[slots] = self.tick
        if self.policy == "lfu":
            self.counts[slots] += occurrences
        if update:
            self.dirty[slots] = True
        return slots.index_select(0, inverse)

    def read_rows(self, ids: torch.Tensor):
        """(rows [U, dim] fp32, inverse [N]) of ``ids`` [N]: ``rows[inverse[i]]`` is row
        ``ids[i]``, read where it is: its slot when resident (dirty or not: the latest values),
        else the store. Changes nothing (no placement, eviction, use, count or statistic), so a
        read (an evaluation) leaves the cache, and the training that follows, as they were."""
        self.wait()  # a background prefetch may still be filling slots
        unique, inverse, _ = unique_with_inverse(ids.to(self.device, torch.int64))
        slots, _ = self._find(unique)
        hit = slots >= 0
        if self.transient is not None and not bool(hit.all()):  # rows outside their home set
            held = self.slot_rows.index_select(0, self.transient)
            order = torch.argsort(held)
            held = held.index_select(0, order)
            miss = (~hit).nonzero().squeeze(1)
            at = torch.searchsorted(held, unique.index_select(0, miss)).clamp(max=held.numel() - 1)
            found = held.index_select(0, at) == unique.index_select(0, miss)
            slots[miss[found]] = self.transient.index_select(0, order.index_select(0, at[found]))
            hit = slots >= 0
        rows = torch.empty(unique.numel(), self.store.dim, dtype=torch.float32, device=self.device)
        rows[hit] = self.weights.index_select(0, slots[hit])
        if not bool(hit.all()):
            rows[~hit] = self.store.read_rows(unique[~hit].cpu()).to(self.device)
        return rows, inverse

    def resident(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(rows, slots) of every resident row (home sets and transient slots), sorted by row, in
        host memory: the index ``read`` and ``write`` take to find rows in their slots."""
        self.wait()
        slots = (self.slot_rows >= 0).nonzero().squeeze(1)
        rows = self.slot_rows.index_select(0, slots)
        order = torch.argsort(rows)
        return rows.index_select(0, order).cpu(), slots.index_select(0, order).cpu()

    def _resident_slots(self, ids: torch.Tensor, resident: Optional[Tuple[torch.Tensor, torch.Tensor]]):
        """(positions in ``ids`` of the resident rows, their slots on the cache's device)."""
        held_rows, held_slots = resident if resident is not None else self.resident()
        if held_rows.numel() == 0 or ids.numel() == 0:
            empty = torch.zeros(0, dtype=torch.int64)
            return empty, empty.to(self.device)
        at = torch.searchsorted(held_rows, ids).clamp_(max=held_rows.numel() - 1)
        positions = (held_rows.index_select(0, at) == ids).nonzero().squeeze(1)
        return positions, held_slots.index_select(0, at.index_select(0, positions)).to(self.device)

    def read(self, ids: torch.Tensor, resident: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
             with_state: bool = True) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """(rows [n, dim], state) of the host ids [n] in host memory, as training sees them: from
        the slot when resident (the latest values), else from the store. Changes nothing.
        ``resident``: this cache's ``resident()``, when the caller reads many chunks;
        ``with_state=False``: the rows only (state {})."""
        self.wait()
        ids = ids.to("cpu", torch.int64)
        rows, state = self.store.read(ids) if with_state else (self.store.read_rows(ids), {})
        positions, slots = self._resident_slots(ids, resident)
        if positions.numel():
            rows[positions] = self.weights.index_select(0, slots).cpu()
            for name in state:
                state[name][positions] = self.state[name].index_select(0, slots).cpu()
        return rows, state

    def write(self, ids: torch.Tensor, rows: torch.Tensor, state: Optional[Mapping[str, torch.Tensor]] = None,
              resident: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> None:
        """Set the distinct host ids [n] to ``rows`` [n, dim] and ``state`` (every field; None:
        the state stays): in the store (rounded to its precision) and, for resident rows, in their
        slot too, which becomes dirty (its exact values reach the store when it is written back).
        Access counts stay."""
        self.wait()
        ids = ids.to("cpu", torch.int64)
        self.store.write(ids, rows, state)
        positions, slots = self._resident_slots(ids, resident)
        if positions.numel():
            self.weights.index_copy_(0, slots, rows.index_select(0, positions).to(self.device))
            for name, value in (self.state.items() if state is not None else ()):
                value.index_copy_(0, slots, state[name].index_select(0, positions).to(self.device))
            self.dirty[slots] = True

    def prefetch(self, ids: torch.Tensor) -> None:
        """Load the rows of ``ids`` for the next lookup and pin them until that lookup's update is
        done. Rows whose home set has no unpinned way are skipped. When the next lookup gets the
        same ``ids``, it reuses this search."""
        self.wait()
        generation = self.generation + 1
        ids = ids.to(self.device, torch.int64)
        unique, inverse, occurrences = unique_with_inverse(ids)
        slots, sets = self._find(unique)
        self._prefetched = (ids, unique, inverse, occurrences, slots)
        wanted = slots < 0
        if self.transient is not None:
            # rows in transient slots are not findable in their home set until written back
            wanted &= ~torch.isin(unique, self.slot_rows.index_select(0, self.transient))
        self.stats.prefetch_requests += unique.numel()
        hit_slots = slots[slots >= 0]
        self.pinned_until[hit_slots] = torch.clamp(self.pinned_until[hit_slots], min=generation)
        if not bool(wanted.any()):
            return
        placed = self._place(unique[wanted], sets[wanted], generation)
        slots[wanted] = placed
        ok = placed >= 0
        num_ok = int(ok.sum())
        self.stats.prefetch_skipped += placed.numel() - num_ok
        if num_ok:
            self.stats.prefetch_loads += num_ok
            self._load(placed[ok], unique[wanted][ok], background=True)

    def flush(self, in_flight: bool = False) -> None:
        """Write every dirty row (row, state, LFU count) back and flush the store; rows stay
        cached and become clean. ``in_flight``: the latest lookup's update has not run yet (flush
        between a forward and its backward): its rows are written but stay dirty and pinned."""
        self.wait()
        if not in_flight:
            self._complete()
        valid = (self.slot_rows >= 0).nonzero().squeeze(1)
        for start in range(0, valid.numel(), _FLUSH_CHUNK):
            slots = valid[start : start + _FLUSH_CHUNK]
            self._write_back(slots, self.slot_rows.index_select(0, slots), self.dirty.index_select(0, slots),
                             self.counts.index_select(0, slots))
        if in_flight:
            self.dirty &= self.pinned_until >= self.generation
        else:
            self.dirty.zero_()
        self.store.flush()

    def resident_rows(self) -> torch.Tensor:
        """Sorted row ids currently in the cache."""
        self.wait()
        return torch.sort(self.slot_rows[self.slot_rows >= 0]).values

    def shutdown(self) -> None:
        """Stop the worker thread (after waiting for it); the store stays open."""
        self.wait()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def close(self, flush: bool = True) -> None:
        """Flush (unless ``flush`` is False), stop the worker thread and close the store; a flush
        that fails (a store refusing a diverged row) still stops the thread and closes the store,
        then raises."""
        if self.store.closed:
            return
        try:
            if flush:
                self.flush()
        finally:
            try:
                self.shutdown()
            finally:
                self.store.close()

    def __repr__(self) -> str:
        return (f"SetAssociativeCache(name={self.name!r}, slots={self.num_slots}, sets={self.num_sets}, "
                f"ways={self.ways}, policy={self.policy}, store={self.store!r})")
