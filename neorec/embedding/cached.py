"""``CachedEmbeddingBagCollection``: an ``EmbeddingBagCollection`` whose tables may live off the
device: in host DRAM, or in a DRAM or SSD row store behind a software cache.

    locations = {"t_item": TableLocation("cached_ssd", cache_fraction=0.1, precision="fp16",
                                         path="runs/ssd/t_item")}
    collection = CachedEmbeddingBagCollection(tables, optimizer, locations=locations)
    collection.prefetch(next_batch.sparse)   # optional: rows of the batch after this one
    pooled = collection(batch.sparse)        # same output as EmbeddingBagCollection(tables)
    pooled.values.sum().backward()           # fused update of the cached rows, in the cache
    collection.flush()                       # every dirty row back to its store

How cached tables train through the same fused op. The one ``TableBatchedEmbeddingBags``
(``self.tbe``) holds every device table in full and, for each cached table, a table of
``num_slots`` rows: that slice of the flat weight buffer and of the optimizer-state buffers IS the
cache's fp32 storage. Each forward maps the ids of a cached table's features to slots
(``SetAssociativeCache.lookup``: misses loaded with their optimizer state, victims written back),
then runs the unchanged fused forward on the slot ids; its backward applies the optimizer to the
slots in place. With fp32 stores the result equals the uncached collection's bit for bit (same
initial rows, same arithmetic on the same values; only where the rows sit differs).

Contract: each batch's backward runs before the next forward (checked: a late backward raises
before touching any row). ``prefetch(features)`` names the batch after the next forward; its rows
load while that forward/backward runs. ``flush()`` may be called between steps.

Not covered by ``state_dict``: the rows of cached tables live in their stores; the module's buffers
hold only the device tables and cache slots (``load_state_dict`` refuses them, and copies and
pickles of a collection with cached tables are refused). The trainer's checkpoints cover them
(``neorec/train/checkpoint_tables.py``, ``CachedPieces``) through ``read_rows`` / ``write_rows``
(rows where training sees them, between steps) and ``track_modified_rows`` /
``take_modified_rows`` (every table; a cached table's rows are marked at each training lookup), in
``neorec/embedding/cached_rows.py``.
"""

from __future__ import annotations

import math
import warnings
import zlib
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from neorec.embedding.cache import CacheTooSmallError, SetAssociativeCache
from neorec.embedding.cached_rows import CachedRows
from neorec.embedding.config import SparseOptimizerConfig, StorageConfig, TableConfig
from neorec.embedding.layout import validate_tables
from neorec.embedding.locations import TableLocation
from neorec.embedding.optimizers import STATE_LAYOUT, state_views
from neorec.embedding.path_common import check_lookup_input
from neorec.embedding.ssd_store import SsdRowStore
from neorec.embedding.storage import DramRowStore, RowStore
from neorec.embedding.init_stream import TableInit
from neorec.embedding.tbe import TableBatchedEmbeddingBags
from neorec.sparse.jagged import KeyedJaggedTensor
from neorec.sparse.keyed import KeyedTensor


def _store_seed(seed: int, table: str) -> int:
    """The rounding seed of table ``table``'s store: tables of one location seed draw unrelated noise."""
    return (int(seed) * 1_000_003 + zlib.crc32(table.encode())) % 2**63


class _UpdateGuard(torch.autograd.Function):
    """Identity on the pooled output; its backward (which runs before the fused update) checks
    that the slots of this batch have not been reassigned by a later forward."""

    @staticmethod
    def forward(ctx, values, collection, generation):  # type: ignore[override]
        ctx.collection, ctx.generation = collection, generation
        return values.view_as(values)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ctx.collection._before_update(ctx.generation)
        return grad, None, None


class CachedEmbeddingBagCollection(CachedRows, nn.Module):
    """Pooled embedding lookups like ``EmbeddingBagCollection``, with per-table locations.

    Args:
        tables, optimizer, storage, device, init_seed: as ``EmbeddingBagCollection``. With cached
            tables ``storage.precision`` must be "fp32" (the cache slots are fp32; the store's
            precision is the location's ``precision``). ``init_seed`` None: nothing is drawn
            (zeros on the device, stores not filled) for a caller that sets every row next
            (``init_rows``, a checkpoint restore).
        locations: {table name: TableLocation}; tables not named stay on the device.
        separate_host_tables: put "dram" tables in a second fused module on the CPU (default:
            when ``device`` is not the CPU). Tests set it on a CPU run to check that path.
        cache_kernel: the caches' lookup/victim implementation, "auto" (Triton on CUDA when
            installed), "torch" or "triton" (see ``cache_kernels.py``).
        tbe_options: more keyword arguments of the fused module (``ShardedEmbeddingBagCollection``
            passes its data-parallel replicas' ``dense_gradient_tables`` and ``gradient_reducer``;
            those tables must stay on the device).

    Attributes: ``tables``, ``feature_names``, ``embedding_dims``, ``tbe`` (device tables and cache
    slots), ``host_tbe`` (or None), ``caches`` {table: SetAssociativeCache}, ``locations``.
    """

    def __init__(self, tables: Sequence[TableConfig], optimizer: SparseOptimizerConfig = SparseOptimizerConfig(),
                 storage: StorageConfig = StorageConfig(), locations: Optional[Mapping[str, TableLocation]] = None,
                 device: Optional[torch.device | str] = None, init_seed: Optional[int] = 0,
                 separate_host_tables: Optional[bool] = None, cache_kernel: str = "auto",
                 tbe_options: Optional[Mapping[str, object]] = None) -> None:
        super().__init__()
        self.tables: List[TableConfig] = validate_tables(tables)
        names = [t.name for t in self.tables]
        locations = dict(locations or {})
        unknown = sorted(set(locations) - set(names))
        if unknown:
            raise ValueError(f"locations name {unknown}, which are not tables; tables are {names}")
        for name, location in locations.items():
            if not isinstance(location, TableLocation):
                raise TypeError(f"location of table {name!r} must be a TableLocation, got {type(location).__name__}")
        self.locations: Dict[str, TableLocation] = {n: locations.get(n, TableLocation()) for n in names}
        cached = [t for t in self.tables if self.locations[t.name].cached]
        if cached and storage.precision != "fp32":
            raise ValueError(
                f"tables {[t.name for t in cached]} are cached: the cache slots live in the fused module, whose "
                f"storage.precision must then be 'fp32' (got {storage.precision!r}); choose the stored rows' "
                f"precision with the location's precision (fp16/bf16/int8)")
        device = torch.device(device if device is not None else "cpu")
        separate = device.type != "cpu" if separate_host_tables is None else bool(separate_host_tables)
        host = [t for t in self.tables if self.locations[t.name].kind == "dram" and separate]
        if host and len(host) == len(self.tables):  # (the fused module said only "tables must not be empty")
            raise ValueError(f"every table ({[t.name for t in host]}) is placed in \"dram\" (host memory) on a "
                             f"{device.type} run: the fused module on the device would hold none; keep at least one "
                             f"table on the device (embedding.location.tables, min_rows) or cache the large ones "
                             f"(cached_dram)")
        shapes = {t.name: self.locations[t.name].cache_shape(t.num_embeddings) for t in cached}
        self._host_tables, self._storage, self._device = host, storage, device
        self._tbe_options = dict(tbe_options or {})
        self.tbe = self._make_tbe(shapes, optimizer, init_seed)
        self.host_tbe = (TableBatchedEmbeddingBags(host, optimizer, storage, device="cpu", init_seed=init_seed)
                         if host else None)
        self.feature_names: List[str] = [f for t in self.tables for f in t.feature_names]
        self.embedding_dims: List[int] = [t.embedding_dim for t in self.tables for _ in t.feature_names]
        self._column_order = self._output_columns(device) if host else None

        kind = self.tbe.optimizer.kind
        initial = optimizer.initial_accumulator_value if kind in ("adagrad", "rowwise_adagrad") else 0.0
        self._initial_state = float(initial)
        self._state_widths = {t.name: {n: (1 if per == "row" else t.embedding_dim) for n, per in STATE_LAYOUT[kind]}
                              for t in self.tables}
        stores = self._initialize(init_seed, initial, cached)
        self._restore_step(stores)
        self.caches: Dict[str, SetAssociativeCache] = {}
        for table in cached:
            location = self.locations[table.name]
            weights, state = self._slot_storage(table.name)
            self.caches[table.name] = SetAssociativeCache(
                stores[table.name], weights, state, ways=shapes[table.name][1], policy=location.policy,
                background=location.background_prefetch, name=table.name, kernel=cache_kernel)
        self._table_of = {t.name: t for t in self.tables}
        self._generation = 0
        self._pending_update = False
        self._prefetch_request: Optional[List[Tuple[str, torch.Tensor]]] = None  # (cache, ids), checked
        self._modified: Optional[Dict[str, torch.Tensor]] = None  # cached tables' rows trained since a take
        if self.caches:  # its buffers hold cache slots, not which rows they are
            self._register_load_state_dict_pre_hook(_refuse_cache_slots, with_module=True)

    # ------------------------------------------------------------------------------ construction
    def _make_tbe(self, shapes: Dict[str, Tuple[int, int]], optimizer: SparseOptimizerConfig,
                  init_seed: Optional[int]) -> TableBatchedEmbeddingBags:
        """The fused module: device tables in full, cached tables as ``shapes[name][0]`` slots."""
        main = [TableConfig(t.name, shapes[t.name][0], t.embedding_dim, list(t.feature_names), t.pooling)
                if t.name in shapes else t for t in self.tables if t not in self._host_tables]
        return TableBatchedEmbeddingBags(main, optimizer, self._storage, device=self._device, init_seed=init_seed,
                                         **self._tbe_options)

    @torch.no_grad()
    def _grow_cache(self, name: str, needed: int) -> None:
        """Give cache ``name`` room for a batch of ``needed`` distinct rows: flush it, rebuild the
        fused module with more slots for it (every other table and cache copied over unchanged),
        and start it empty with the new geometry."""
        for cache in self.caches.values():
            cache.wait()
        old_cache, table = self.caches[name], self._table_of[name]
        ways = old_cache.ways
        slots = min(math.ceil(needed * 1.25 / ways), math.ceil(table.num_embeddings / ways)) * ways
        slots = max(slots, math.ceil(needed / ways) * ways)
        warnings.warn(f"cache of table {name!r}: a batch needs {needed} distinct rows, more than its "
                      f"{old_cache.num_slots} slots; growing it to {slots} slots", RuntimeWarning, stacklevel=3)
        self._flush_cache(old_cache)  # its store is durable and clean at this step, as after flush()
        old = self.tbe
        shapes = {n: (c.num_slots, c.ways) for n, c in self.caches.items()}
        shapes[name] = (slots, ways)
        new = self._make_tbe(shapes, old.optimizer, None)  # every row is copied from the old module
        new.step.copy_(old.step)
        if old.modified_rows is not None:  # the other tables' marks carry over (a cached table's are here)
            new.track_modified_rows()
        old_index = {t.name: i for i, t in enumerate(old.tables)}
        for i, t in enumerate(new.tables):
            if t.name == name:
                continue
            j = old_index[t.name]
            size = t.num_embeddings * t.embedding_dim
            new.weights[new.table_offsets[i] : new.table_offsets[i] + size].copy_(
                old.weights[old.table_offsets[j] : old.table_offsets[j] + size])
            for buffer, per in STATE_LAYOUT[old.optimizer.kind]:
                (ni, oi, n) = ((new.table_row_offsets[i], old.table_row_offsets[j], t.num_embeddings) if per == "row"
                               else (new.table_offsets[i], old.table_offsets[j], size))
                getattr(new, buffer)[ni : ni + n].copy_(getattr(old, buffer)[oi : oi + n])
            if old.modified_rows is not None:
                marks = old.modified_rows[old.table_row_offsets[j] : old.table_row_offsets[j] + t.num_embeddings]
                new.modified_rows[new.table_row_offsets[i] : new.table_row_offsets[i] + t.num_embeddings] = marks
        self.tbe = new
        stats = old_cache.stats
        self.caches[name] = SetAssociativeCache(old_cache.store, *self._slot_storage(name), ways=ways,
                                                policy=old_cache.policy,
                                                background=self.locations[name].background_prefetch, name=name,
                                                kernel=old_cache.kernel)
        self.caches[name].stats = stats
        old_cache.shutdown()
        for other, cache in self.caches.items():
            if other != name:
                cache.bind(*self._slot_storage(other))

    def _make_store(self, table: TableConfig, location: TableLocation, fill) -> RowStore:
        state = self._state_widths[table.name]
        counts = location.policy == "lfu"
        if location.kind == "cached_dram":
            store = DramRowStore(table.num_embeddings, table.embedding_dim, location.precision, state, counts,
                                 location.stochastic_rounding, _store_seed(location.seed, table.name), name=table.name)
            if fill is not None:  # (None: the caller sets every row, init_rows)
                fill(store)
            return store
        budget = location.resident_budget_mb << 20
        if location.open_existing:
            store = SsdRowStore.open(location.path, resident_budget_bytes=budget)
            expected = (table.num_embeddings, table.embedding_dim, location.precision, tuple(state.items()), counts)
            found = (store.num_rows, store.dim, store.precision, store.format.state, store.format.with_counts)
            if found != expected:
                store.close()
                raise ValueError(f"table {table.name!r}: the store at {location.path!r} holds (rows, dim, precision, "
                                 f"state, LFU counts) = {found}, the table needs {expected}")
            return store
        if not location.overwrite and Path(location.path).exists():  # (said as the store's API: open / overwrite=)
            raise ValueError(f"table {table.name!r}: a row store already exists at {location.path!r}; "
                             f"TableLocation(..., open_existing=True) reopens it (its rows and optimizer state), "
                             f"overwrite=True replaces it")
        return SsdRowStore.create(location.path, table.num_embeddings, table.embedding_dim, location.precision,
                                  state, counts, location.stochastic_rounding, _store_seed(location.seed, table.name), fill=fill,
                                  overwrite=location.overwrite, resident_budget_bytes=budget)

    def _restore_step(self, stores: Dict[str, RowStore]) -> None:
        """Reopened stores carry on from the optimizer step of their last flush (Adam's bias
        correction depends on it); stores of one model saved at different steps are refused."""
        steps = {name: stores[name].training_state.get("optimizer_step", 0) for name, location in
                 self.locations.items() if location.kind == "cached_ssd" and location.open_existing}
        if len(set(steps.values())) > 1:
            raise ValueError(f"the reopened row stores were flushed at different optimizer steps {steps}: they "
                             "are not one model's; reopen stores flushed together")
        for module in (self.tbe, self.host_tbe):
            if steps and module is not None:
                module.step.fill_(next(iter(steps.values())))

    @torch.no_grad()
    def _initialize(self, seed: Optional[int], initial_state: float, cached: List[TableConfig]) -> Dict[str, RowStore]:
        """The stores of cached tables, filled with their initial rows (``TableInit``: the rows an
        ``EmbeddingBagCollection(tables)`` starts from; the fused modules drew their own tables'
        rows from it already) unless reopened or ``seed`` is None (the caller sets every row)."""
        stores: Dict[str, RowStore] = {}
        for table in cached:
            location, fill = self.locations[table.name], None
            if seed is not None and not (location.kind == "cached_ssd" and location.open_existing):
                def fill(store: RowStore, init=TableInit(seed, table)) -> None:
                    store.fill(lambda start, count: init.rows(start, start + count), initial_state)

            stores[table.name] = self._make_store(table, location, fill)
        return stores

    def _host_names(self) -> set:
        return {t.name for t in self.host_tbe.tables} if self.host_tbe is not None else set()

    def _output_columns(self, device: torch.device) -> torch.Tensor:
        """Column permutation from [main features | host features] to ``feature_names`` order."""
        starts, column = {}, 0
        for module in (self.tbe, self.host_tbe):
            for feature, dim in zip(module.feature_names, module.feature_dims):
                starts[feature] = column
                column += dim
        return torch.cat([torch.arange(starts[f], starts[f] + d) for f, d in zip(self.feature_names, self.embedding_dims)]).to(device)

    def _slot_storage(self, name: str):
        """(weights [num_slots, dim], state views) of a cached table's slice of the fused module."""
        tbe = self.tbe
        index = [t.name for t in tbe.tables].index(name)
        slots, dim = tbe.table_rows[index], tbe.table_dims[index]
        offset = tbe.table_offsets[index]
        weights = tbe.weights[offset : offset + slots * dim].view(slots, dim)
        buffers = {n: getattr(tbe, n) for n, _ in STATE_LAYOUT[tbe.optimizer.kind]}
        state = state_views(tbe.optimizer.kind, buffers, tbe.table_row_offsets[index], slots, offset, dim)
        return weights, state

    # ------------------------------------------------------------------------------ properties
    def embedding_dim_per_feature(self) -> Dict[str, int]:
        return dict(zip(self.feature_names, self.embedding_dims))

    @property
    def total_dim(self) -> int:
        return sum(self.embedding_dims)

    # ------------------------------------------------------------------------------ forward
    def _table_ids(self, features: KeyedJaggedTensor, table: TableConfig, position: Dict[str, int],
                   offsets: List[int]) -> List[torch.Tensor]:
        """The ids of each feature of ``table``, range-checked."""
        out = []
        for feature in table.feature_names:
            if feature not in position:
                raise ValueError(f"KeyedJaggedTensor lacks feature {feature!r} (table {table.name!r}); expected all "
                                 f"of {self.feature_names} (got keys {features.keys()})")
            k = position[feature]
            ids = features.values[offsets[k] : offsets[k + 1]]
            bad = ids.lt(0) | ids.ge(table.num_embeddings)
            if bool(bad.any()):
                raise ValueError(f"feature {feature!r} (table {table.name!r}): id {int(ids[bad][0])} is outside "
                                 f"the table's rows [0, {table.num_embeddings})")
            out.append(ids)
        return out

    def _map_to_slots(self, features: KeyedJaggedTensor, update: bool) -> KeyedJaggedTensor:
        """``features`` with the ids of cached tables replaced by their cache slots."""
        if not self.caches:
            return features
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(f"expected a KeyedJaggedTensor, got {type(features).__name__}")
        keys = features.keys()
        position = {k: i for i, k in enumerate(keys)}
        offsets = features.offset_per_key()
        values = features.values.clone()
        for name in list(self.caches):
            table = self._table_of[name]
            parts = self._table_ids(features, table, position, offsets)
            ids = torch.cat(parts) if len(parts) > 1 else parts[0]
            if update and self._modified is not None:  # the rows this batch's update trains (marks in host memory)
                self._modified[name][ids.cpu()] = True
            try:
                slots = self.caches[name].lookup(ids, update=update)
            except CacheTooSmallError as error:
                self._grow_cache(name, error.needed)
                slots = self.caches[name].lookup(ids, update=update)
            slots = slots.to(values.dtype)
            start = 0
            for feature, part in zip(table.feature_names, parts):
                k = position[feature]
                values[offsets[k] : offsets[k + 1]] = slots[start : start + part.numel()]
                start += part.numel()
        return KeyedJaggedTensor(keys, values, features.lengths, features.weights, batch_size=features.batch_size,
                                 validate=False)

    def _start_prefetch(self) -> None:
        request, self._prefetch_request = self._prefetch_request, None
        for name, ids in request or ():
            self.caches[name].prefetch(ids)

    def prefetch(self, features: KeyedJaggedTensor, now: bool = False) -> None:
        """Name the batch that follows the next forward: its cached rows are loaded while that
        forward and its backward run, and stay pinned until its own update is done. Its ids are
        checked here (a missing feature or an id outside its table raises now, and the request is
        dropped), not in the forward that starts the loads.

        ``now=True``: ``features`` is the NEXT forward's batch, named after the previous forward
        (between two training steps, or between a forward and its backward); its rows start
        loading at once. A sharded rank does this: it learns its pieces' ids of batch i + 1 from
        the look-ahead exchange during step i (``TrainPipeline``)."""
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(f"prefetch expects a KeyedJaggedTensor, got {type(features).__name__}")
        self._prefetch_request = None
        if self.caches:
            position = {k: i for i, k in enumerate(features.keys())}
            offsets = features.offset_per_key()
            request = []
            for name in self.caches:
                parts = self._table_ids(features, self._table_of[name], position, offsets)
                request.append((name, torch.cat(parts) if len(parts) > 1 else parts[0]))
            self._prefetch_request = request
            if now:
                self._start_prefetch()

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pool every feature of ``feature_names`` (keys may be a superset); values [B, total_dim].
        Without autograd (evaluation) the caches are only read (``_read_only_forward``)."""
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(f"expected a KeyedJaggedTensor, got {type(features).__name__}")
        check_lookup_input(features)
        training = torch.is_grad_enabled()
        if not training and self.caches:
            return self._read_only_forward(features)
        self._generation += 1
        self._pending_update = False
        slotted = self._map_to_slots(features, update=training)
        self._start_prefetch()
        values = self._with_host_tables(self.tbe(slotted).values, features)
        if training and self.caches and values.requires_grad:
            self._pending_update = True
            values = _UpdateGuard.apply(values, self, self._generation)
        return KeyedTensor(self.feature_names, self.embedding_dims, values)

    def _read_only_forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """The forward of an evaluation: each cached table's rows are read where they are (its
        slot, else its store) and pooled here, the other tables by the fused modules; no row is
        placed, evicted or written back, no cache grows and no use is counted, so evaluating
        leaves the caches, and the training that follows, exactly as they were."""
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(f"expected a KeyedJaggedTensor, got {type(features).__name__}")
        keys, batch = features.keys(), features.batch_size
        position = {k: i for i, k in enumerate(keys)}
        offsets, bag_starts = features.offset_per_key(), features.offsets()
        lengths = features.lengths_2d()
        pooled: Dict[str, torch.Tensor] = {}
        for name, cache in self.caches.items():
            table = self._table_of[name]
            parts = self._table_ids(features, table, position, offsets)
            rows, inverse = cache.read_rows(torch.cat(parts) if len(parts) > 1 else parts[0])
            start = 0
            for feature, part in zip(table.feature_names, parts):
                k = position[feature]
                weights = None if features.weights is None else features.weights[offsets[k] : offsets[k + 1]]
                local = inverse[start : start + part.numel()].to(rows.device)
                start += part.numel()
                bags = (bag_starts[k * batch : (k + 1) * batch] - offsets[k]).to(rows.device)
                scale = None if weights is None else weights.to(rows.device, torch.float32)
                if table.pooling == "mean":  # each value times 1 / len(bag), as the fused kernels do
                    inverse_length = 1.0 / lengths[k].clamp(min=1).to(rows.device, torch.float32)
                    per_value = inverse_length.repeat_interleave(lengths[k].to(rows.device), output_size=part.numel())
                    scale = per_value if scale is None else scale * per_value
                pooled[feature] = F.embedding_bag(local, rows, bags, mode="sum", per_sample_weights=scale)
        # the fused modules see the cached features as empty bags; their columns are set below
        empty = torch.tensor([k in pooled for k in keys], device=lengths.device)
        kept = [features.values[offsets[k] : offsets[k + 1]] for k, key in enumerate(keys) if key not in pooled]
        kept_weights = None if features.weights is None else [
            features.weights[offsets[k] : offsets[k + 1]] for k, key in enumerate(keys) if key not in pooled]
        others = KeyedJaggedTensor(
            keys, torch.cat(kept) if kept else features.values[:0],
            lengths.masked_fill(empty.unsqueeze(1), 0).reshape(-1),
            None if kept_weights is None else (torch.cat(kept_weights) if kept_weights else features.weights[:0]),
            batch_size=batch, validate=False)
        values = self._with_host_tables(self.tbe(others).values, features)
        column = 0
        for feature, dim in zip(self.feature_names, self.embedding_dims):
            if feature in pooled:
                values[:, column : column + dim] = pooled[feature]
            column += dim
        return KeyedTensor(self.feature_names, self.embedding_dims, values)

    def __getstate__(self):
        """Copies (``copy.deepcopy``) and pickles: refused while tables are cached, whose rows live in
        stores this module owns (files, worker threads); a plain "cannot pickle SimpleQueue" said it."""
        if self.caches:
            raise TypeError(f"a CachedEmbeddingBagCollection with cached tables {sorted(self.caches)} cannot be "
                            "copied or pickled: their rows live in row stores it owns; build another one and copy "
                            "the rows with read_rows / write_rows (or save a checkpoint)")
        return super().__getstate__()

    def _apply(self, fn, recurse: bool = True):
        """``.to(device)`` / ``.cuda()`` / ``.half()`` leave ``host_tbe`` as it is: its tables live in
        host memory by design (``build_model`` moving the whole model put them on the GPU, and the
        first forward, which hands them host ids, failed). With cached tables a move to another
        device is refused (their caches' slots and metadata stay where they were built: the moved
        fused module no longer read the rows they loaded, and training went silently wrong); the
        caches take the fused module's buffers afterwards, whatever ``fn`` made of them."""
        if self.caches:
            here = self.tbe.weights.device
            there = fn(self.tbe.weights.new_empty(0)).device
            if there != here:
                raise RuntimeError(f"a CachedEmbeddingBagCollection with cached tables {sorted(self.caches)} cannot move "
                                   f"from {here} to {there}: build it there (device=..., as build_model does)")
        host = self._modules.pop("host_tbe", None)
        try:
            result = super()._apply(fn, recurse)
        finally:
            if host is not None:
                self._modules["host_tbe"] = host
        for name, cache in self.caches.items():
            cache.bind(*self._slot_storage(name))
        return result

    def _with_host_tables(self, values: torch.Tensor, features: KeyedJaggedTensor) -> torch.Tensor:
        """``values`` of the fused module with the host module's columns added, in feature order."""
        if self.host_tbe is None:
            return values
        host = self.host_tbe(features.to("cpu")).values.to(values.device)
        return torch.cat([values, host], dim=1).index_select(1, self._column_order)

    def _before_update(self, generation: int) -> None:
        if generation != self._generation:
            raise RuntimeError(
                "CachedEmbeddingBagCollection: backward of a batch after a later forward; the cache may have "
                "reassigned that batch's slots. Run each batch's backward before the next forward.")
        self._pending_update = False

    # ------------------------------------------------------------------------------ rows, state, stats
    def flush(self) -> None:
        """Write every dirty cached row (and its optimizer state) back to its store and make the
        stores durable, with the optimizer step (a reopened store goes on from it). Between a
        forward and its backward the in-flight rows stay dirty."""
        for cache in self.caches.values():
            self._flush_cache(cache, in_flight=self._pending_update)

    def _flush_cache(self, cache: SetAssociativeCache, in_flight: bool = False) -> None:
        """One cache's flush, its store marked with the optimizer step its rows are of (a store
        marked clean at another step would reopen as if its rows were of that step)."""
        cache.store.training_state["optimizer_step"] = int(self.tbe.step)
        cache.flush(in_flight=in_flight)

    def close(self) -> None:
        """Flush and close every store; the collection cannot train afterwards. Closing again does
        nothing (as for caches, stores and the trainer). A flush that fails (a store refusing a row
        that a diverged update left NaN) still closes every store and stops every worker thread,
        then raises its error: they had stayed open and locked, and a second close did nothing."""
        if all(cache.store.closed for cache in self.caches.values()):
            return
        errors = []
        try:
            self.flush()
        except BaseException as exc:  # (the stores keep what their last good writes left)
            errors.append(exc)
        for cache in self.caches.values():
            try:
                cache.close(flush=False)
            except BaseException as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    def cache_stats(self) -> Dict[str, Dict[str, float]]:
        """{table: cache counters + the store's row/byte counters (prefixed "store_")}."""
        out = {}
        for name, cache in self.caches.items():
            stats = cache.stats.as_dict()
            stats.update({f"store_{k}": v for k, v in cache.store.stats().items()})
            out[name] = stats
        return out

    def extra_repr(self) -> str:
        placed = {n: loc.kind for n, loc in self.locations.items() if loc.kind != "device"}
        return f"locations={placed}"


def _refuse_cache_slots(module: CachedEmbeddingBagCollection, state_dict, prefix, *args) -> None:
    """``load_state_dict`` of a collection with cached tables, given its buffers: they hold cache
    slots without the tags saying which row each slot holds, so loading them put old rows under
    other ids (rolled back on the same module) or restored nothing (into a fresh one)."""
    if any(key.startswith(prefix) for key in state_dict):
        raise ValueError(f"load_state_dict: the state dict of a CachedEmbeddingBagCollection holds the cache slots "
                         f"of the cached tables {sorted(module.caches)}, not which rows they are; restore their "
                         f"rows with write_rows (read_rows to save them) or with neorec train's checkpoints")
