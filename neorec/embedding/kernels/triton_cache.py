"""Triton kernels for the hot path of ``SetAssociativeCache`` (``neorec/embedding/cache.py``):
the tag lookup of unique row ids and the victim choice for the misses.

Importing this module imports triton; use ``neorec.embedding.kernels.triton_available()`` first.
The cache dispatches here through ``neorec/embedding/cache_kernels.py`` (CUDA tensors, or
``kernel="triton"`` under ``TRITON_INTERPRET=1`` on CPU tensors, which is how the tests check them):

    TRITON_INTERPRET=1 python -m pytest tests/gpu/test_triton_cache.py -q

Both return exactly what the torch methods ``_find`` / ``_place`` return (same slots, same pins):

* ``cache_find``: one program per ``BLOCK`` ids. Each id is hashed to its home set (the same
  wrapping int64 multiply-xorshift as ``_home_sets``), the set's ``ways`` tags are compared with it
  ``BLOCK_W`` ways at a time, and the first matching way gives the slot (-1 when none matches).
* ``cache_place``: the misses are grouped by home set with torch ops (stable sort: a set's misses
  keep their input order, their rank); then one program per set with misses computes the victim
  key of each of its ways (empty -1; LRU: last use; LFU: count << 31 | last use; pinned ways
  unavailable) and hands its misses, in rank order, the ways of smallest key (ties on the lowest
  way), each way once: the ``r``-th miss takes the ``r``-th way of the stable sort of the keys,
  as ``_place`` does, or -1 when no usable way is left. The program pins what it hands out. Sets
  are disjoint, so no two programs touch the same slot: no atomics.
"""

from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from neorec.embedding.kernels.layout import launch_device

_UNAVAILABLE = torch.iinfo(torch.int64).max  # the key of a pinned way (as cache._UNAVAILABLE)
_FIND_BLOCK = 128
_LFU_MASK = (1 << 31) - 1


@triton.jit
def _cache_find_kernel(
    rows_ptr, slot_rows_ptr, out_slots_ptr, out_sets_ptr, num_rows, num_sets, ways, hash_multiplier,
    BLOCK: tl.constexpr, BLOCK_W: tl.constexpr,
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = offsets < num_rows
    rows = tl.load(rows_ptr + offsets, mask=in_range, other=0)
    mixed = rows * hash_multiplier  # wraps modulo 2**64, as torch's int64 multiply
    mixed = mixed ^ (mixed >> 29)  # arithmetic shift of a signed value, as torch's
    sets = mixed % num_sets
    sets = tl.where(sets < 0, sets + num_sets, sets)  # C remainder -> torch.remainder (>= 0)
    base = sets * ways
    found = tl.full([BLOCK], -1, tl.int64)
    for start in range(0, ways, BLOCK_W):
        way = start + tl.arange(0, BLOCK_W)
        tile_mask = in_range[:, None] & (way[None, :] < ways)
        tags = tl.load(slot_rows_ptr + base[:, None] + way[None, :], mask=tile_mask, other=0)
        match = tile_mask & (tags == rows[:, None])
        first = tl.min(tl.where(match, way[None, :], ways), axis=1)
        found = tl.where((found < 0) & (first < ways), base + first, found)
    tl.store(out_slots_ptr + offsets, found, mask=in_range)
    tl.store(out_sets_ptr + offsets, sets, mask=in_range)


@triton.jit
def _cache_place_kernel(
    slot_rows_ptr, last_use_ptr, counts_ptr, pinned_until_ptr,
    set_ids_ptr, set_starts_ptr, set_counts_ptr, order_ptr, out_slots_ptr,
    ways, completed, generation,
    LFU: tl.constexpr, UNAVAILABLE: tl.constexpr, LFU_MASK: tl.constexpr, BLOCK_W: tl.constexpr,
):
    program = tl.program_id(0)
    set_id = tl.load(set_ids_ptr + program)
    start = tl.load(set_starts_ptr + program)
    num_misses = tl.load(set_counts_ptr + program)
    way = tl.arange(0, BLOCK_W)
    in_set = way < ways
    slots = set_id * ways + way
    last_use = tl.load(last_use_ptr + slots, mask=in_set, other=0)
    if LFU:
        counts = tl.load(counts_ptr + slots, mask=in_set, other=0)
        key = (tl.minimum(counts, LFU_MASK) << 31) | (last_use & LFU_MASK)
    else:
        key = last_use
    occupant = tl.load(slot_rows_ptr + slots, mask=in_set, other=0)
    key = tl.where(occupant < 0, -1, key)
    pinned = tl.load(pinned_until_ptr + slots, mask=in_set, other=0)
    key = tl.where(in_set & (pinned <= completed), key, UNAVAILABLE)
    for rank in range(0, tl.minimum(num_misses, ways)):
        best = tl.min(key, axis=0)
        chosen = tl.min(tl.where(key == best, way, BLOCK_W), axis=0)
        usable = best != UNAVAILABLE
        slot = set_id * ways + chosen
        target = tl.load(order_ptr + start + rank)
        tl.store(out_slots_ptr + target, slot, mask=usable)
        pin = tl.load(pinned_until_ptr + slot, mask=usable, other=0)
        tl.store(pinned_until_ptr + slot, tl.maximum(pin, generation), mask=usable)
        key = tl.where(way == chosen, UNAVAILABLE, key)


def cache_find(slot_rows: torch.Tensor, num_sets: int, ways: int, rows: torch.Tensor,
               hash_multiplier: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(slot of each row or -1 [n] int64, home set [n] int64) for unique ``rows`` [n] int64.

    slot_rows: [num_sets * ways] int64, the row held by each slot (-1 = empty), on rows' device.
    hash_multiplier: the signed int64 multiplier of the cache's home-set hash.
    """
    rows = rows.contiguous()
    slots = torch.empty_like(rows)
    sets = torch.empty_like(rows)
    if rows.numel() == 0:
        return slots, sets
    block_w = min(triton.next_power_of_2(ways), 64)
    grid = (triton.cdiv(rows.numel(), _FIND_BLOCK),)
    with launch_device(rows):
        _cache_find_kernel[grid](rows, slot_rows, slots, sets, rows.numel(), num_sets, ways, hash_multiplier,
                                 BLOCK=_FIND_BLOCK, BLOCK_W=block_w)
    return slots, sets


def cache_place(slot_rows: torch.Tensor, last_use: torch.Tensor, counts: torch.Tensor,
                pinned_until: torch.Tensor, ways: int, lfu: bool, completed: int, generation: int,
                sets: torch.Tensor) -> torch.Tensor:
    """Slots for the misses whose home sets are ``sets`` [n] int64 (-1 where the set has no usable
    way left), pinning the chosen slots with ``generation`` in ``pinned_until`` (in place).

    slot_rows, last_use, counts, pinned_until: [num_slots] int64 cache metadata; ways > 0;
    ``completed``: the latest generation whose update is done (pins above it are live).
    """
    count = sets.numel()
    slots = torch.full((count,), -1, dtype=torch.int64, device=sets.device)
    if count == 0:
        return slots
    order = torch.argsort(sets, stable=True)
    set_ids, per_set = torch.unique_consecutive(sets.index_select(0, order), return_counts=True)
    starts = torch.cumsum(per_set, 0).sub_(per_set)
    with launch_device(slot_rows):
        _cache_place_kernel[(set_ids.numel(),)](
            slot_rows, last_use, counts, pinned_until, set_ids, starts, per_set, order, slots,
            ways, completed, generation,
            LFU=bool(lfu), UNAVAILABLE=_UNAVAILABLE, LFU_MASK=_LFU_MASK, BLOCK_W=triton.next_power_of_2(ways),
        )
    return slots
