"""``ShardedEmbeddingBagCollection``: an ``EmbeddingBagCollection`` whose tables are spread over the
ranks of a process group by a ``ShardingPlan`` (4D parallelism: table-, row-, column-wise and data
parallel, plus table-row-wise and table-column-wise).

    collection = ShardedEmbeddingBagCollection(tables, plan, process_group, optimizer, storage)
    pooled = collection(kjt)     # kjt: this rank's B samples -> KeyedTensor [B, sum of dims]

forward = input_dist(kjt) -> wait -> compute -> output_dist -> wait; each step is public so that a
pipeline can overlap the exchanges with compute. On each rank ALL its pieces, whatever their
sharding type, and its replicas of the data-parallel tables live in ONE ``TableBatchedEmbeddingBags``
looked up by one fused call (Neo's hybrid kernel fusion).

Gradients. Each rank's loss is its share of the global mean loss (``local_loss``,
neorec/train/distributed.py), so the fused optimizer simply sums the pooled gradients that come
back to a piece from all ranks, and a replica's dense gradient is summed over the ranks
(all-reduce) and then applied: no scaling pass. Both match single-process training on the global
batch.

Row-wise AdaGrad on column pieces: its per-row statistic is the mean of g^2 over the piece's
columns, not over the full row, so COLUMN_WISE / TABLE_COLUMN_WISE tables with row-wise AdaGrad
train like a model whose table is cut into per-piece tables (exact for the other optimizers).

Tables off the device (``locations``: cached in front of a DRAM or SSD store, or "dram"): each
rank's pieces of such a table become tables of a ``CachedEmbeddingBagCollection`` (``cached``),
which holds this rank's device pieces and replicas in its fused module too, so one fused call
still looks up everything; each piece gets its own cache (``cache_fraction`` of the piece's rows,
or ``cache_rows`` each) and store (``<path>@<shard index>`` for SSD). Data-parallel tables stay on
the device (each rank would hold a whole replica in its store).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from neorec.devices import concrete_device
from neorec.embedding.cached import CachedEmbeddingBagCollection
from neorec.embedding.config import SparseOptimizerConfig, StorageConfig, TableConfig
from neorec.embedding.init_stream import TableInit
from neorec.embedding.locations import TableLocation
from neorec.embedding.precision import first_overflow, overflow_message
from neorec.embedding.tbe import TableBatchedEmbeddingBags
from neorec.sharding.comm import Awaitable, CommStats, all_reduce_sum_reducer, ready
from neorec.sharding.input_dist import LocalBatch, input_dist
from neorec.sharding.output_dist import OutputPlacement, output_dist
from neorec.sharding.plan import ShardingPlan, ShardingType
from neorec.sharding.qcomm import CommConfig
from neorec.sharding.routing import Routing
from neorec.sparse.jagged import KeyedJaggedTensor
from neorec.sparse.keyed import KeyedTensor


class ShardedEmbeddingBagCollection(nn.Module):
    """Sharded pooled embeddings; same output as ``EmbeddingBagCollection(tables)``.

    Args:
        tables: the model's tables (as for ``EmbeddingBagCollection``).
        plan: a ``ShardingPlan`` for these tables and this group's world size (validated here).
        process_group: the group the ranks of the plan belong to (plan rank = group rank).
        optimizer, storage: of the fused module (one precision per rank: a table's plan
            ``precision``, if set, must equal ``storage.precision``).
        device: where this rank's buffers live (its CUDA device under NCCL).
        init_seed: init of the local module: each piece is drawn as a table of its own (named as the
            piece), not as the rows of the unsharded table (``load_initial_weights`` or ``shard()``
            set those); None: nothing is drawn (pieces on the device hold zeros, stores are not
            filled), for a caller that sets every piece next (``load_initial_weights``,
            ``load_table_weight`` of every table, or a checkpoint restore).
        comm_stats: counts the bytes this rank hands to each collective (optional).
        comm: codecs of the pooled-embedding all-to-all, forward and backward (``qcomm.py``;
            default fp32 both ways).
        locations: {table name: TableLocation} of tables off the device (see the module doc);
            tables not named stay on the device.

    Attributes:
        feature_names / embedding_dims: output keys and widths (as ``EmbeddingBagCollection``).
        tbe: this rank's fused module (None when it holds no piece and no replica).
        cached: this rank's ``CachedEmbeddingBagCollection`` when it holds a piece off the device
            (its fused module is ``tbe``), else None.
        routing: the static plan routing (``routing.py``).
    """

    def __init__(
        self,
        tables: Sequence[TableConfig],
        plan: ShardingPlan,
        process_group: Optional[dist.ProcessGroup],
        optimizer: SparseOptimizerConfig = SparseOptimizerConfig(),
        storage: StorageConfig = StorageConfig(),
        device: Optional[torch.device | str] = None,
        init_seed: Optional[int] = 0,
        comm_stats: Optional[CommStats] = None,
        comm: Optional[CommConfig] = None,
        locations: Optional[Dict[str, TableLocation]] = None,
    ) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise ValueError("ShardedEmbeddingBagCollection needs torch.distributed to be initialized "
                             "(init_process_group) first")
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.routing = Routing(tables, plan, self.world_size)
        self.plan = plan
        plan.check_precision(storage.precision)
        self.tables: List[TableConfig] = list(self.routing.tables)
        self.feature_names: List[str] = list(self.routing.feature_names)
        self.embedding_dims: List[int] = list(self.routing.feature_dims)
        self.comm_stats = comm_stats
        self.comm = comm if comm is not None else CommConfig()
        self.device = concrete_device(device)  # inputs are checked against it: "cuda" must say "cuda:0"
        local_tables = self.routing.local_tables(self.rank)
        local_locations = self._local_locations(locations or {})
        options = dict(dense_gradient_tables=[t.name for t in self.routing.replicas],
                       gradient_reducer=all_reduce_sum_reducer(process_group, comm_stats))
        fused, cached = None, None
        if local_tables and local_locations:
            cached = CachedEmbeddingBagCollection(local_tables, optimizer, storage, locations=local_locations,
                                                  device=self.device, init_seed=init_seed, tbe_options=options)
        elif local_tables:
            fused = TableBatchedEmbeddingBags(local_tables, optimizer, storage, device=self.device,
                                              init_seed=init_seed, **options)
        self._modules["tbe"] = fused  # read through the ``tbe`` property (add_module refuses its name)
        self._modules["cached"] = cached
        # which rows and columns of which table this rank's pieces hold, saved by state_dict() and
        # checked by load_state_dict() before any buffer is copied: another plan's pieces can have
        # this rank's piece names and shapes and hold other rows (they were loaded without a word)
        self.register_buffer("shard_layout", _json_bytes(self._shard_layout()).to(self.device))
        self._register_load_state_dict_pre_hook(_check_shard_layout, with_module=True)
        self._placement = OutputPlacement(self.routing, self.device)
        self._launched = None  # (values, lengths, awaitable) of an id exchange launched ahead
        self.timeline = None  # a StepTimeline while profiling (neorec/train/timeline.py)

    @property
    def tbe(self) -> Optional[TableBatchedEmbeddingBags]:  # type: ignore[override]
        """This rank's fused module: its own, or its cached collection's (rebuilt when a cache grows)."""
        cached = self._modules.get("cached")
        return cached.tbe if cached is not None else self._modules.get("tbe")

    def _local_locations(self, locations: Dict[str, TableLocation]) -> Dict[str, TableLocation]:
        """{shard table name: its location} of this rank's pieces of tables off the device."""
        off = {name: location for name, location in locations.items() if location.kind != "device"}
        unknown = sorted(set(off) - {t.name for t in self.tables})
        if unknown:
            raise ValueError(f"locations name {unknown}, which are not tables; tables are {[t.name for t in self.tables]}")
        planned = self.plan.tiers_off_device()
        differ = {name: tier for name, tier in planned.items() if name not in off or off[name].kind != tier}
        if differ:
            raise ValueError(f"the plan places tables {differ} off the device, but the locations given "
                             f"{ {name: off[name].kind if name in off else 'device' for name in differ} } differ: "
                             f"give each such table a TableLocation of its tier (the trainer makes them from the "
                             f"plan and [embedding.location])")
        replicated = sorted(t.name for t in self.routing.replicas if t.name in off)
        if replicated:
            raise ValueError(f"tables {replicated} are data-parallel in the plan and placed off the device "
                             f"({', '.join(off[n].kind for n in replicated)}): every rank would hold a whole replica "
                             f"in a store of its own; keep them on the device (embedding.location.tables) or shard "
                             f"them another way")
        out = {}
        for piece in self.routing.shards_on[self.rank]:
            location = off.get(piece.table.name)
            if location is not None:
                path = f"{location.path}{piece.config.name[len(piece.table.name):]}" if location.path else ""
                out[piece.config.name] = dataclasses.replace(location, path=path)
        return out

    # ------------------------------------------------------------------------------ info
    def embedding_dim_per_feature(self) -> Dict[str, int]:
        return dict(zip(self.feature_names, self.embedding_dims))

    @property
    def total_dim(self) -> int:
        return sum(self.embedding_dims)

    # ------------------------------------------------------------------------------ forward
    def input_dist(self, features: KeyedJaggedTensor) -> Awaitable[LocalBatch]:
        """Launch the id exchange of this rank's ``features``; ``wait()`` -> its LocalBatch."""
        if features.values.device != self.device:
            raise ValueError(f"KeyedJaggedTensor is on {features.values.device}, the embedding tables on {self.device}")
        return input_dist(self.routing, self.rank, features, self.process_group, self.comm_stats)

    def compute(self, local: LocalBatch) -> torch.Tensor:
        """One fused lookup of all local pieces and replicas:
        [sum(batch_sizes), dims_on[rank] + replica_dim] fp32."""
        if self.cached is not None:
            return self.cached(local.features).values
        if self.tbe is None:
            return torch.zeros(sum(local.batch_sizes), 0, device=self.device)
        return self.tbe(local.features).values

    def output_dist(self, local: LocalBatch, pooled: torch.Tensor) -> Awaitable[KeyedTensor]:
        """Launch the return of the pooled rows; ``wait()`` -> KeyedTensor of this rank's samples."""
        return output_dist(self.routing, self._placement, local, pooled, self.process_group, self.comm_stats,
                           comm=self.comm)

    def launch_input_dist(self, features: KeyedJaggedTensor) -> None:
        """Start the id exchange of a LATER forward's ``features`` now (``TrainPipeline``): the
        forward whose features hold the same values and lengths tensors waits on it instead of
        exchanging again. Forwards of other features (an evaluation between steps) exchange their
        own ids as usual; the launched exchange stays pending until its forward or
        ``drop_launched_input_dist``. Collective: every rank launches for its part of the batch."""
        self.drop_launched_input_dist()
        self._launched = (features.values, features.lengths, self.input_dist(features))

    def progress_launched_input_dist(self) -> None:
        """Stage 2 of a launched id exchange: its header is in, launch the ids (no wait on them)."""
        if self._launched is not None:
            self._launched[2].progress()

    def prefetch_launched(self) -> None:
        """Wait for the launched id exchange and start loading its rows into this rank's caches
        (``CachedEmbeddingBagCollection.prefetch(now=True)``): the pipeline calls it after step
        i's backward, so that batch i + 1's cached rows load during the optimizer step and the wait
        for the next batch. Nothing without a launched exchange or cached pieces."""
        cached = self._modules.get("cached")
        if self._launched is None or cached is None or not cached.caches:
            return
        cached.prefetch(self._launched[2].wait().features, now=True)  # (waiting again gives the same batch)

    def drop_launched_input_dist(self) -> None:
        """Complete (so the ranks stay matched) and forget a launched, unused id exchange."""
        launched, self._launched = self._launched, None
        if launched is not None:
            launched[2].wait()

    def abandon_launched_input_dist(self) -> None:
        """Forget a launched exchange without completing it (a failed step: the ranks are out of
        step and the run ends; completing it could meet another collective elsewhere)."""
        self._launched = None

    def _local_batch(self, features: KeyedJaggedTensor) -> LocalBatch:
        launched = self._launched
        if launched is not None and launched[0] is features.values and launched[1] is features.lengths:
            self._launched = None
            return launched[2].wait()
        return self.input_dist(features).wait()

    def forward_awaitable(self, features: KeyedJaggedTensor) -> Awaitable[KeyedTensor]:
        """``forward`` with the return of the pooled rows still in flight: ``wait()`` gives what
        ``forward`` returns. The caller computes in between (the DLRM runs its bottom MLP while the
        rows travel). With a ``timeline`` the exchange is waited for at once (timed phases)."""
        if self.timeline is not None:
            return ready(self.forward(features))
        local = self._local_batch(features)
        return self.output_dist(local, self.compute(local))

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """``features``: this rank's samples (keys ⊇ feature_names). Returns values [B, total_dim].
        With a ``timeline`` attribute (a ``StepTimeline``), the phases are timed."""
        timeline = self.timeline
        if timeline is None:
            return self.forward_awaitable(features).wait()
        with timeline.phase("input_dist"):
            local = self._local_batch(features)
        with timeline.phase("lookup"):
            pooled = self.compute(local)
        with timeline.phase("output_dist"):
            return self.output_dist(local, pooled).wait()

    # ------------------------------------------------------------------------------ weights
    @torch.no_grad()
    def load_table_weight(self, name: str, weight: torch.Tensor) -> None:
        """Copy this rank's pieces (and replica) of table ``name`` from the full ``weight``
        [rows, dim], as initial rows (before training: pieces in stores get their optimizer state
        reset to its initial value, ``init_rows``). Local: every rank calls it with the same full
        table."""
        table = self._table(name)
        if tuple(weight.shape) != (table.num_embeddings, table.embedding_dim):
            raise ValueError(f"load_table_weight({name!r}): expected shape "
                             f"{(table.num_embeddings, table.embedding_dim)}, got {tuple(weight.shape)}")
        for piece in self.routing.shards_on[self.rank]:
            if piece.table.name == name:
                s = piece.shard
                part = weight[s.row_start : s.row_end, s.col_start : s.col_end]
                for lo in range(0, s.num_rows, 1 << 16):  # bounded temporaries for pieces in stores
                    self._set_rows(piece.config.name, lo, part[lo : lo + (1 << 16)])
        if self.plan.tables[name].sharding_type == ShardingType.DATA_PARALLEL:
            self._set_rows(name, 0, weight)

    @torch.no_grad()
    def load_initial_weights(self, init_seed: int) -> None:
        """Set this rank's pieces and replicas to the rows ``EmbeddingBagCollection(tables,
        init_seed=init_seed)`` starts from, without building it: each table's rows come from
        ``TableInit``, which draws any rows without the ones before them, so this rank draws only
        the rows its pieces span (all of a replicated or column-wise table, its range of a row-wise
        one, nothing of a table held elsewhere), a block at a time, and writes each block's rows to
        the pieces they overlap. Local: no collective; memory: one block beside the pieces."""
        replicas = {t.name for t in self.routing.replicas}
        for table in self.tables:
            pieces = [p for p in self.routing.shards_on[self.rank] if p.table.name == table.name]
            if table.name in replicas:
                spans = [(0, table.num_embeddings)]
            else:
                spans = sorted((p.shard.row_start, p.shard.row_end) for p in pieces)
            init = TableInit(init_seed, table)
            for lo, hi in _merged(spans):
                for start, block in init.blocks(lo, hi):
                    end = start + block.shape[0]
                    if table.name in replicas:
                        self._set_rows(table.name, start, block)
                    for piece in pieces:
                        s = piece.shard
                        a, b = max(start, s.row_start), min(end, s.row_end)
                        if a < b:
                            self._set_rows(piece.config.name, a - s.row_start,
                                           block[a - start : b - start, s.col_start : s.col_end])

    def _set_rows(self, name: str, start: int, rows: torch.Tensor) -> None:
        """Rows ``start ..`` of local table ``name`` (a piece or a replica) = ``rows`` (fp32), rounded
        to nearest into fp16 / bf16 storage (as ``set_table_weight``); a piece in a store gets them as
        its initial rows (``init_rows``: rounded to nearest, optimizer state at its initial value)."""
        if self.cached is not None and name in self.cached.caches:
            self.cached.init_rows(name, start, rows)
            return
        module = self.cached._module_of(name) if self.cached is not None else self.tbe
        target = module.table_view(name)[start : start + rows.shape[0]]
        rounded = rows.to(target.device, target.dtype)
        bad = first_overflow(rows, rounded)
        if bad is not None:  # (a value beyond fp16's range became inf without a word)
            raise ValueError(overflow_message(f"table piece {name!r}: its row {start + bad // rows.shape[1]}",
                                              float(rows.reshape(-1)[bad]), target.dtype))
        target.copy_(rounded)

    @torch.no_grad()
    def full_table_weight(self, name: str) -> torch.Tensor:
        """fp32 [rows, dim] of table ``name`` gathered from all ranks (a collective: every rank must
        call it, for the same tables in the same order). Replicas come from rank 0."""
        table = self._table(name)
        full = torch.zeros(table.num_embeddings, table.embedding_dim, device=self.device)
        for piece in self.routing.shards_on[self.rank]:
            if piece.table.name == name:
                s = piece.shard
                full[s.row_start : s.row_end, s.col_start : s.col_end] = (
                    self.cached.table_weight(piece.config.name).to(self.device) if self.cached is not None
                    else self.tbe.get_table_weight(piece.config.name))
        if self.plan.tables[name].sharding_type == ShardingType.DATA_PARALLEL and self.rank == 0:
            full.copy_(self.tbe.get_table_weight(name))
        if self.world_size > 1:
            dist.all_reduce(full, group=self.process_group)
        return full

    def _shard_layout(self) -> List[List]:
        """[table, rows [start, end), columns [start, end)] of each piece on this rank, in the fused
        module's order, then [table, "replica"] of each data-parallel table."""
        pieces = [[p.table.name, [p.shard.row_start, p.shard.row_end], [p.shard.col_start, p.shard.col_end]]
                  for p in self.routing.shards_on[self.rank]]
        return pieces + [[t.name, "replica"] for t in self.routing.replicas]

    def _table(self, name: str) -> TableConfig:
        for table in self.tables:
            if table.name == name:
                return table
        raise ValueError(f"no table named {name!r}; tables are {[t.name for t in self.tables]}")

    def extra_repr(self) -> str:
        kinds = {}
        for name, entry in self.plan.tables.items():
            kinds[entry.sharding_type.value] = kinds.get(entry.sharding_type.value, 0) + 1
        return f"rank={self.rank}/{self.world_size}, tables by type={kinds}"


def _json_bytes(value) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8).clone()


def _check_shard_layout(module: ShardedEmbeddingBagCollection, state_dict, prefix, local_metadata, strict,
                        missing_keys, unexpected_keys, error_msgs) -> None:
    """load_state_dict's check that the state dict's pieces hold the rows and columns this rank's
    hold (a state dict saved before the layout was recorded is taken as it is)."""
    key = prefix + "shard_layout"
    if key not in state_dict:
        state_dict[key] = module.shard_layout
        return
    try:
        saved = json.loads(bytes(state_dict[key].cpu().tolist()).decode())
    except (ValueError, TypeError, AttributeError):
        saved = None
    if saved != module._shard_layout():
        raise ValueError(f"load_state_dict: the state dict's pieces on rank {module.rank} hold {saved} (table, rows, "
                         f"columns), this collection's {module._shard_layout()}: it was saved under another sharding "
                         "plan, and its rows would land in other places (neorec train's checkpoints reshard; or "
                         "move each table with full_table_weight / load_table_weight)")


def _merged(spans: List[Tuple[int, int]]) -> List[Tuple[int, int]]:
    """Sorted row ranges merged where they overlap or touch."""
    merged: List[Tuple[int, int]] = []
    for lo, hi in spans:
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged
