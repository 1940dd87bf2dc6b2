"""``TableBatchedEmbeddingBags``: all embedding tables of a device in one flat buffer, looked up by
one fused op per embedding dim, with the sparse optimizer fused into the backward pass.

Layout (shared with the Triton GPU kernels, keep it fixed): ONE flat 1-D ``weights`` buffer.
Tables are sorted by ``embedding_dim`` (stable: table order within a dim); each table occupies
``num_embeddings * embedding_dim`` contiguous row-major elements, so the tables of one dim form a
"dim group" that is a 2-D [rows_of_group, dim] view. ``table_offsets[t]`` is the element offset of
table ``t`` (original order), ``table_row_offset_in_group[t]`` its first row inside its group.
Optimizer state (``momentum1``, ``momentum2``) lives in flat fp32 buffers: per row
([total_rows], rows numbered in the same layout order) or per element (like ``weights``).

Forward: per dim group, one ``F.embedding_bag(mode="sum")`` over the group view with ids shifted
by their table's row offset; mean pooling and KJT weights go in through ``per_sample_weights``
(``lookup.py`` prepares the ids; ``layout.py`` computes the layout). fp16/bf16 tables are pooled
in fp32: the batch's unique rows are gathered and upcast first, because ``F.embedding_bag`` on
half weights returns (and takes per-sample weights in) half precision.
Output: ``KeyedTensor`` with keys ``feature_names`` (table order, then feature order in a table),
values [B, sum of dims] fp32.

Backward never builds a dense [rows, dim] gradient nor a per-value [N, dim] one: per group the
row ids are stable-sorted, each unique row's gradient is pooled straight from the output gradient
with ``F.embedding_bag`` (the transpose of the forward), in chunks of at most ``_CHUNK_BYTES`` of
row gradients, and the optimizer updates exactly those rows in place. Sorted order, no atomics: same bits for
the same inputs.

The forward and backward above are the torch path. The same buffers are also served by the native C
kernels (``native_path.py``: CPU fp32 weights, the default there) and the Triton kernels
(``triton_path.py``: CUDA); ``kernel_choice.py`` picks one per device.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from neorec.embedding.config import SparseOptimizerConfig, StorageConfig, TableConfig
from neorec.embedding.kernel_choice import check_kernel, choose_kernel
from neorec.embedding.layout import DimGroup, build_layout
from neorec.embedding.lookup import GroupLookup, prepare_lookups
from neorec.embedding.memory import empty_huge
from neorec.embedding.native_path import NativePath
from neorec.embedding.path_common import PendingLookups
from neorec.embedding.optimizers import create_state, state_views, update_rows
from neorec.embedding.precision import Rounder, first_overflow, overflow_message, storage_dtype
from neorec.embedding.init_stream import TableInit
from neorec.embedding.replicas import ReplicaGradients
from neorec.embedding.triton_path import TritonPath
from neorec.sparse.jagged import KeyedJaggedTensor
from neorec.sparse.keyed import KeyedTensor

_CHUNK_BYTES = 1 << 22  # at most this many bytes of aggregated fp32 row gradients at a time


class _FusedLookup(torch.autograd.Function):
    """Forward pools; backward runs the module's fused gradient + optimizer step.

    ``anchor`` is a scalar leaf that requires grad, so that autograd calls ``backward`` although
    the weights are buffers; its gradient is None."""

    @staticmethod
    def forward(ctx, anchor, module, lookups, batch_size):  # type: ignore[override]
        ctx.module, ctx.lookups = module, lookups
        ctx.save_for_backward(anchor)  # freed by backward: a second backward raises, as autograd's own
        module.pending_lookups.started(ctx)
        return module._pool(lookups, batch_size)

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        _ = ctx.saved_tensors  # "Trying to backward through the graph a second time" (it stepped the optimizer again)
        ctx.module._backward(ctx.lookups, grad_output)
        PendingLookups.stepped(ctx)
        return None, None, None, None


class TableBatchedEmbeddingBags(nn.Module):
    """All tables in one flat buffer; one fused lookup per dim; optimizer fused into backward.

    Args:
        tables: the tables (unique names; a feature belongs to one table; several features may
            share a table).
        optimizer: sparse optimizer; a copy is kept as ``self.optimizer`` (change
            ``self.optimizer.learning_rate`` between steps).
        storage: weight precision (fp32/fp16/bf16) and stochastic rounding.
        dense_gradient: if True, backward accumulates into ``self.dense_grad`` ([total elements]
            fp32, allocated on first backward) instead of updating; ``apply_dense_gradients()``
            then steps. Meant for small tables (data parallel).
        device: where the buffers live (default CPU).
        init_seed: seed of the uniform(-sqrt(1/rows), sqrt(1/rows)) init (``init_stream.TableInit``:
            a table's rows depend on the seed, its name and its shape only); None: rows of zeros,
            for a caller that sets every table next (no values drawn).
        dense_gradient_tables: names of tables held as data-parallel replicas: their rows leave
            the fused update; at the end of every backward their dense gradient (one compact fp32
            buffer) goes to ``gradient_reducer`` (e.g. an all-reduce sum, in place) and the
            optimizer then steps their rows with a non-zero gradient (``replicas.py``).
        gradient_reducer: ``callable(grad)`` for ``dense_gradient_tables``; None = no reduction.
        kernel: "auto" (Triton kernels for CUDA weights, the native C kernels for CPU fp32
            weights with SGD / AdaGrad / row-wise AdaGrad, torch ops otherwise), "torch",
            "native" or "triton" (insist; Triton on CPU tensors only under
            ``TRITON_INTERPRET=1``). See ``kernel_choice.py``.
    """

    def __init__(
        self,
        tables: Sequence[TableConfig],
        optimizer: SparseOptimizerConfig,
        storage: StorageConfig = StorageConfig(),
        dense_gradient: bool = False,
        device: Optional[torch.device | str] = None,
        init_seed: Optional[int] = 0,
        dense_gradient_tables: Sequence[str] = (),
        gradient_reducer: Optional[Callable[[torch.Tensor], None]] = None,
        kernel: str = "auto",
    ) -> None:
        super().__init__()
        if not isinstance(optimizer, SparseOptimizerConfig):
            raise TypeError(f"optimizer must be a SparseOptimizerConfig, got {type(optimizer).__name__}")
        if not isinstance(storage, StorageConfig):
            raise TypeError(f"storage must be a StorageConfig, got {type(storage).__name__}")
        self.layout = build_layout(tables)
        self.tables: List[TableConfig] = list(self.layout.tables)
        self.optimizer = dataclasses.replace(optimizer)
        self._state_kind = optimizer.kind  # the kind the optimizer state buffers are laid out for
        self.storage = dataclasses.replace(storage)
        self.dense_gradient = bool(dense_gradient)
        self.feature_names: List[str] = list(self.layout.feature_names)
        self.feature_dims: List[int] = list(self.layout.feature_dims)
        self.table_offsets: List[int] = list(self.layout.table_offsets)
        self.table_dims: List[int] = [t.embedding_dim for t in self.tables]
        self.table_rows: List[int] = [t.num_embeddings for t in self.tables]
        self.table_row_offset_in_group: List[int] = list(self.layout.table_row_offset_in_group)
        # first row of each table among all rows (index into row-wise state such as momentum1)
        self.table_row_offsets: List[int] = [
            self.layout.groups[g].row_start + r for g, r in zip(self.layout.table_group, self.table_row_offset_in_group)
        ]
        self._table_index = {t.name: i for i, t in enumerate(self.tables)}
        if dense_gradient_tables and self.dense_gradient:
            raise ValueError("dense_gradient_tables cannot be combined with dense_gradient=True (all tables dense)")
        self._replicas = ReplicaGradients(self.layout, list(dense_gradient_tables), gradient_reducer) \
            if dense_gradient_tables else None
        self._rounder = Rounder(storage_dtype(self.storage.precision), self.storage.stochastic_rounding, self.storage.seed)
        # Replicated (data-parallel) rows get the same all-reduced gradients on every rank; their
        # rounding draws come from a generator of their own, seeded alike on every rank, so their
        # bits stay equal (the shards' generator advances by each rank's own rows).
        self._replica_rounder = None if self._replicas is None else Rounder(
            self._rounder.dtype, self.storage.stochastic_rounding, replica_rounding_seed(self.storage.seed))
        if self._replica_rounder is not None and self._replica_rounder.stochastic and self.storage.seed is None:
            raise ValueError("data-parallel tables (dense_gradient_tables) with stochastic rounding need a fixed "
                             "storage seed: every replica must draw the same rounding noise")

        weights = empty_huge(self.layout.num_elements, storage_dtype(self.storage.precision))  # host: init
        if init_seed is None:
            weights.zero_()
        else:
            self._initialize(weights, init_seed)
        self.register_buffer("weights", weights.to(device))
        for name, buffer in create_state(self.optimizer, self.layout.num_rows, self.layout.num_elements, device).items():
            self.register_buffer(name, buffer)
        self.register_buffer("step", torch.zeros((), dtype=torch.int64, device=device))
        self.register_buffer("dense_grad", None, persistent=False)
        self.register_buffer("dense_rows", None, persistent=False)  # [total rows] bool: looked up (dense mode)
        if self._rounder.stochastic:
            self._rounder.generator(self.weights.device)  # full-size state from the start
            self.register_buffer("rounding_rng_state", self._rounder.get_state())
            if self._replica_rounder is not None:
                self._replica_rounder.generator(self.weights.device)
                self.register_buffer("replica_rounding_rng_state", self._replica_rounder.get_state())
            self.register_state_dict_pre_hook(_save_rounding_state)
            self._register_load_state_dict_pre_hook(_adopt_rounding_state, with_module=True)
            self.register_load_state_dict_post_hook(_load_rounding_state)
        # the tables behind the flat buffers (name, rows, dim, in buffer order), as UTF-8 JSON: saved
        # by state_dict(), checked by load_state_dict before any buffer is copied (_check_layout)
        self.register_buffer("table_layout", _layout_bytes(self).to(device))
        self._register_load_state_dict_pre_hook(_check_layout, with_module=True)
        self.kernel = check_kernel(kernel)
        self._triton = TritonPath(self)
        self._native = NativePath(self)
        self._kernel_by_device: Dict[str, str] = {}
        self.pending_lookups = PendingLookups()  # warns when a second lookup comes before the first's backward
        # [num_rows] bool, layout row order: rows updated since the last take_modified_rows()
        # (Check-N-Run incremental checkpoints); None = not tracking (no cost)
        self.modified_rows: Optional[torch.Tensor] = None

    # ------------------------------------------------------------------------------ layout helpers
    @property
    def step_count(self) -> int:
        """Optimizer steps taken (fused backward passes, or ``apply_dense_gradients`` calls)."""
        return int(self.step)

    @property
    def groups(self) -> List[DimGroup]:
        """The dim groups in layout order (ascending dim)."""
        return self.layout.groups

    def group_weights(self, group: DimGroup) -> torch.Tensor:
        """[group.num_rows, group.dim] view of the weights of one dim group."""
        return self.weights[group.element_start : group.element_end].view(group.num_rows, group.dim)

    def checked_optimizer(self) -> SparseOptimizerConfig:
        """``self.optimizer`` (its learning rate, eps and weight decay may change between steps), after
        checking that its kind is still the one the state buffers were built for (the native kernels
        wrote through a missing state, SIGSEGV, or past a row-wise one, heap corruption) and that its
        settings are still in range, so that every kernel refuses alike before anything changes (a
        learning rate set to 0 between steps was refused by the Triton kernel alone, after the step
        had been counted)."""
        if self.optimizer.kind != self._state_kind:
            raise ValueError(f"TableBatchedEmbeddingBags: optimizer.kind is now {self.optimizer.kind!r}, but the "
                             f"optimizer state was built for {self._state_kind!r}; build a new module for another "
                             "kind of optimizer (learning_rate, eps and weight_decay may change)")
        try:
            self.optimizer.check()
        except (TypeError, ValueError) as e:
            raise type(e)(f"TableBatchedEmbeddingBags: the optimizer's settings changed since it was built: {e}") from None
        return self.optimizer

    def _group_states(self, group: DimGroup) -> Dict[str, torch.Tensor]:
        buffers = {name: getattr(self, name) for name in ("momentum1", "momentum2") if hasattr(self, name)}
        return state_views(self.checked_optimizer().kind, buffers, group.row_start, group.num_rows,
                           group.element_start, group.dim)

    def _table(self, name: str) -> int:
        if name not in self._table_index:
            raise ValueError(f"no table named {name!r}; tables are {list(self._table_index)}")
        return self._table_index[name]

    def _initialize(self, weights: torch.Tensor, seed: int) -> None:
        for table, offset in zip(self.tables, self.table_offsets):
            dim = table.embedding_dim
            for row, block in TableInit(seed, table).blocks():
                weights[offset + row * dim : offset + (row + block.shape[0]) * dim] = block.reshape(-1)

    def table_view(self, name: str) -> torch.Tensor:
        """[num_embeddings, embedding_dim] view (no copy) of table ``name`` in the storage dtype;
        writing into it (``copy_`` of fp32 values) rounds to nearest, as ``set_table_weight``."""
        t = self._table(name)
        rows, dim = self.table_rows[t], self.table_dims[t]
        return self.weights[self.table_offsets[t] : self.table_offsets[t] + rows * dim].view(rows, dim)

    def get_table_weight(self, name: str, device: Optional[torch.device | str] = None) -> torch.Tensor:
        """fp32 copy [num_embeddings, embedding_dim] of table ``name`` (on ``device``, default the module's)."""
        table = self.table_view(name)
        return table.to(torch.float32, copy=True) if device is None else table.to(device, torch.float32, copy=True)

    def set_table_weight(self, name: str, weight: torch.Tensor) -> None:
        """Overwrite table ``name`` with ``weight`` [num_embeddings, embedding_dim] (rounded to
        nearest when the storage is fp16/bf16; a value that would round to inf is refused)."""
        table = self.table_view(name)
        if tuple(weight.shape) != tuple(table.shape):
            raise ValueError(f"set_table_weight({name!r}): expected shape {tuple(table.shape)}, got {tuple(weight.shape)}")
        rounded = weight.to(table.device, table.dtype)
        bad = first_overflow(weight, rounded)
        if bad is not None:
            raise ValueError(overflow_message(f"set_table_weight({name!r}): row {bad // table.shape[1]}",
                                              float(weight.reshape(-1)[bad]), table.dtype))
        with torch.no_grad():
            table.copy_(rounded)

    def get_optimizer_state(self, name: str, device: Optional[torch.device | str] = None) -> Dict[str, torch.Tensor]:
        """Copies of table ``name``'s optimizer state: {"momentum1": [rows] or [rows, dim], ...} (on
        ``device``, default the module's)."""
        t = self._table(name)
        group = self.layout.groups[self.layout.table_group[t]]
        views = self._group_states(group)
        lo = self.table_row_offset_in_group[t]
        return {k: v[lo : lo + self.table_rows[t]].clone() if device is None
                else v[lo : lo + self.table_rows[t]].to(device, copy=True) for k, v in views.items()}

    def set_optimizer_state(self, name: str, state: Dict[str, torch.Tensor]) -> None:
        """Overwrite table ``name``'s optimizer state; ``state`` as ``get_optimizer_state`` returns."""
        t = self._table(name)
        group = self.layout.groups[self.layout.table_group[t]]
        views = self._group_states(group)
        if set(state) != set(views):
            raise ValueError(f"set_optimizer_state({name!r}): expected state {sorted(views)}, got {sorted(state)}")
        lo = self.table_row_offset_in_group[t]
        with torch.no_grad():
            for key, view in views.items():
                target = view[lo : lo + self.table_rows[t]]
                if tuple(state[key].shape) != tuple(target.shape):
                    raise ValueError(f"set_optimizer_state({name!r}): {key} must have shape {tuple(target.shape)}, "
                                     f"got {tuple(state[key].shape)}")
                target.copy_(state[key])

    # ------------------------------------------------------------------------------ modified rows
    def track_modified_rows(self, enabled: bool = True) -> None:
        """Start (or stop) marking the rows every optimizer step updates (cleared now)."""
        self.modified_rows = torch.zeros(self.layout.num_rows, dtype=torch.bool, device=self.weights.device) \
            if enabled else None

    def _marks(self, name: str, caller: str) -> torch.Tensor:
        if self.modified_rows is None:
            raise ValueError(f"{caller}: call track_modified_rows() first")
        t = self._table(name)
        return self.modified_rows[self.table_row_offsets[t] : self.table_row_offsets[t] + self.table_rows[t]]

    def take_modified_rows(self, name: str) -> torch.Tensor:
        """[K] int64 ascending rows of table ``name`` updated since tracking started or since this
        table's last take (its marks are cleared)."""
        marks = self._marks(name, "take_modified_rows")
        rows = marks.nonzero().squeeze(1)
        marks.zero_()
        return rows

    def count_modified_rows(self, name: str) -> int:
        """How many rows ``take_modified_rows(name)`` would return (the marks stay)."""
        return int(self._marks(name, "count_modified_rows").sum())

    def _mark_modified(self, group: DimGroup, rows: torch.Tensor) -> None:
        if self.modified_rows is not None:
            self.modified_rows[group.row_start + rows] = True

    def _apply(self, fn, recurse: bool = True):
        """``.to(device)`` / ``.cuda()`` move the tables; ``.half()`` / ``.double()`` / ``.to(dtype)`` of a
        model (meant for its dense layers) keep their storage types: converted, the rows and optimizer
        state no longer matched ``storage.precision`` (fp16 AdaGrad state overflowed to inf and its rows
        stopped training; fp64 rows failed in the backward after the step count had moved)."""
        def keep_dtype(tensor: torch.Tensor) -> torch.Tensor:
            probe = fn(tensor.new_empty(0))  # where and in what type fn puts it, without converting the tables
            return fn(tensor) if probe.dtype == tensor.dtype else tensor.to(probe.device)

        return super()._apply(keep_dtype, recurse)

    def first_non_finite_row(self) -> Optional[Tuple[str, int]]:
        """(table, row) of the first row holding NaN or inf, None when every row is finite (one
        pass over the flat weights: a check after an update that may have diverged)."""
        bad = ~torch.isfinite(self.weights)
        if not bool(bad.any()):
            return None
        return self.table_row_at(int(bad.to(torch.uint8).argmax()))  # (the first: argmax returns the first maximum)

    def table_row_at(self, element: int) -> Tuple[str, int]:
        """(table, row) holding element ``element`` of the flat weights."""
        index = max((t for t, offset in enumerate(self.table_offsets) if offset <= element),
                    key=lambda t: self.table_offsets[t])  # (the tables' blocks may lie in another order)
        return self.tables[index].name, (element - self.table_offsets[index]) // self.table_dims[index]

    # ------------------------------------------------------------------------------ forward
    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pool every feature of ``self.feature_names`` from ``features`` (keys may be a superset
        or a permutation; ids must lie in [0, num_embeddings) of the feature's table).

        A bag's output is ``sum_i w_i * row(id_i)`` ("sum" pooling) or the same divided by the bag
        length ("mean"), with ``w_i`` the KJT's per-value weights (1 without weights); an empty
        bag gives zeros. Returns a ``KeyedTensor`` with values [B, sum(feature_dims)] fp32
        (accumulated in fp32 whatever the storage precision). With grad enabled, the backward
        of these values updates the touched rows in place: each backward is one optimizer step
        (a second lookup while the first's backward is still to come warns once,
        ``SecondLookupWarning``: two lookups into one loss are two steps), and the tables take no
        part in ``requires_grad_`` (freeze them with ``torch.no_grad()``)."""
        if isinstance(features, KeyedJaggedTensor) and features.values.is_floating_point():  # else truncated to rows
            raise TypeError(f"KeyedJaggedTensor ids must be integers, got {features.values.dtype}")
        path = self.kernel_path()
        if path == "native":
            return KeyedTensor(self.feature_names, self.feature_dims, self._native.forward(features))
        if path == "triton":
            return KeyedTensor(self.feature_names, self.feature_dims, self._triton.forward(features))
        lookups = prepare_lookups(self.layout, features, self.weights.device)
        batch_size = features.batch_size
        if torch.is_grad_enabled():
            anchor = torch.zeros((), device=self.weights.device, requires_grad=True)
            values = _FusedLookup.apply(anchor, self, lookups, batch_size)
        else:
            values = self._pool(lookups, batch_size)
        return KeyedTensor(self.feature_names, self.feature_dims, values)

    def kernel_path(self) -> str:
        """"native", "triton" or "torch": what runs this module's lookups on its current device
        (``kernel_choice.py``; chosen once per device)."""
        device = str(self.weights.device)
        if device not in self._kernel_by_device:
            self._kernel_by_device[device] = choose_kernel(self, self.kernel)
        return self._kernel_by_device[device]

    def _uses_triton(self) -> bool:
        return self.kernel_path() == "triton"

    def _pool(self, lookups: List[GroupLookup], batch_size: int) -> torch.Tensor:
        """[B, total_dim] fp32 pooled embeddings, features in ``feature_names`` order."""
        total_dim = self.layout.total_dim
        out = None
        for lookup in lookups:
            group = lookup.group
            weights = self.group_weights(group)
            if weights.dtype == torch.float32:
                indices, table = lookup.rows, weights
            else:
                # Pool in fp32: F.embedding_bag on half weights rounds its output (and the
                # per-sample weights) to half. Gather the unique rows once, upcast, pool those.
                lookup.sort()
                indices, table = lookup.inverse(), weights.index_select(0, lookup.unique).float()
            pooled = F.embedding_bag(
                indices, table, lookup.offsets, mode="sum",
                per_sample_weights=lookup.weights, include_last_offset=True,
            )  # [num_bags, dim]
            if lookup.batch_major:
                pooled = pooled.view(batch_size, group.num_features, group.dim)
            else:
                pooled = pooled.view(group.num_features, batch_size, group.dim).transpose(0, 1)
            if group.covers_output(total_dim):
                return pooled.reshape(batch_size, total_dim)
            if out is None:
                out = torch.empty(batch_size, total_dim, device=pooled.device)
            for first, last, column in group.runs:
                width = (last - first) * group.dim
                out[:, column : column + width].view(batch_size, last - first, group.dim).copy_(pooled[:, first:last])
        if out is None:
            out = torch.zeros(batch_size, total_dim, device=self.weights.device)
        return out

    # ------------------------------------------------------------------------------ backward
    def _chunk_rows(self, dim: int) -> int:
        return max(1, _CHUNK_BYTES // (4 * dim))

    def _group_grad(self, group: DimGroup, grad_output: torch.Tensor, batch_size: int) -> torch.Tensor:
        """[B * F_g, dim] output gradient of one group, row ``b * F_g + f``."""
        if group.covers_output(self.layout.total_dim):
            return grad_output.contiguous().view(batch_size * group.num_features, group.dim)
        grad = grad_output.new_empty(batch_size, group.num_features, group.dim)
        for first, last, column in group.runs:
            width = (last - first) * group.dim
            grad[:, first:last].copy_(grad_output[:, column : column + width].view(batch_size, last - first, group.dim))
        return grad.view(batch_size * group.num_features, group.dim)

    @torch.no_grad()
    def _backward(self, lookups: List[GroupLookup], grad_output: torch.Tensor) -> None:
        """Aggregate per unique row and update (or accumulate into ``dense_grad``)."""
        grad_output = grad_output.to(torch.float32)
        batch_size = grad_output.shape[0]
        self.checked_optimizer()  # before anything changes
        if self.dense_gradient:
            if self.dense_grad is None:
                self.dense_grad = torch.zeros(self.layout.num_elements, device=self.weights.device)
                self.dense_rows = torch.zeros(self.layout.num_rows, dtype=torch.bool, device=self.weights.device)
        else:
            self.step += 1
        step = int(self.step)
        for lookup in lookups:
            if lookup.num_values == 0:
                continue
            group = lookup.group
            grad = self._group_grad(group, grad_output, batch_size)
            lookup.sort()
            bags = lookup.bags().index_select(0, lookup.permutation)  # [N] output-gradient row, by row
            weights = None if lookup.weights is None else lookup.weights.index_select(0, lookup.permutation)
            starts = lookup.segment_starts
            chunk = self._chunk_rows(group.dim)
            num_unique = lookup.unique.numel()
            value_bounds = starts[::chunk].tolist() + [lookup.num_values]
            for index, first in enumerate(range(0, num_unique, chunk)):
                last = min(first + chunk, num_unique)
                lo, hi = value_bounds[index], value_bounds[index + 1]
                row_grad = F.embedding_bag(
                    bags[lo:hi], grad, starts[first:last] - lo, mode="sum",
                    per_sample_weights=None if weights is None else weights[lo:hi],
                )  # [last - first, dim]
                self._consume(group, lookup.unique[first:last], row_grad, step)
        if self._replicas is not None:
            self._replicas.reduce_and_apply(self._update_replica_rows(step), self.weights.device)

    def _update_replica_rows(self, step: int) -> Callable[[DimGroup, torch.Tensor, torch.Tensor], None]:
        def update(group: DimGroup, rows: torch.Tensor, grad: torch.Tensor) -> None:
            update_rows(self.optimizer, self.group_weights(group), self._group_states(group), rows, grad, step,
                        self._replica_rounder)
            self._mark_modified(group, rows)
        return update

    def _consume(self, group: DimGroup, rows: torch.Tensor, row_grad: torch.Tensor, step: int) -> None:
        if self.dense_gradient:
            view = self.dense_grad[group.element_start : group.element_end].view(group.num_rows, group.dim)
            view.index_add_(0, rows, row_grad)
            self.dense_rows[group.row_start + rows] = True
            return
        if self._replicas is not None:
            rest = self._replicas.take(group, rows, row_grad)
            if rest is None:
                return
            rows, row_grad = rest
        update_rows(self.optimizer, self.group_weights(group), self._group_states(group), rows, row_grad, step, self._rounder)
        self._mark_modified(group, rows)

    @torch.no_grad()
    def apply_dense_gradients(self) -> None:
        """Dense-gradient mode: one optimizer step on every row looked up since the last call or
        with a non-zero ``dense_grad`` (e.g. added by an all-reduce of other processes' gradients),
        the same arithmetic as the fused mode, which steps every looked-up row, also one whose
        gradient sums to zero; then zero ``dense_grad`` and ``dense_rows``."""
        if not self.dense_gradient:
            raise ValueError("apply_dense_gradients() needs dense_gradient=True; this module updates in backward")
        if self.dense_grad is None:
            return
        self.checked_optimizer()
        self.step += 1
        step = int(self.step)
        for group in self.layout.groups:
            view = self.dense_grad[group.element_start : group.element_end].view(group.num_rows, group.dim)
            looked_up = self.dense_rows[group.row_start : group.row_start + group.num_rows]
            rows = (view.ne(0).any(dim=1) | looked_up).nonzero().squeeze(1)
            chunk = self._chunk_rows(group.dim)
            for first in range(0, rows.numel(), chunk):
                chunk_rows = rows[first : first + chunk]
                update_rows(self.optimizer, self.group_weights(group), self._group_states(group),
                            chunk_rows, view.index_select(0, chunk_rows), step, self._rounder)
                self._mark_modified(group, chunk_rows)
        self.dense_grad.zero_()
        self.dense_rows.zero_()

    def extra_repr(self) -> str:
        dims = ", ".join(f"{g.dim}: {g.num_tables} tables/{g.num_rows} rows" for g in self.layout.groups)
        return f"tables={len(self.tables)}, dims={{{dims}}}, optimizer={self.optimizer.kind}, precision={self.storage.precision}"


def replica_rounding_seed(seed: Optional[int]) -> Optional[int]:
    """The seed of the replicated rows' rounding generator: derived from the storage seed, the same
    on every rank, another stream than the shards'."""
    return None if seed is None else (int(seed) * 0x9E3779B1 + 0x5EB1CA) % 2**63


def _table_layout(module: TableBatchedEmbeddingBags) -> List[List]:
    return [[t.name, t.num_embeddings, t.embedding_dim] for t in module.tables]


def _layout_bytes(module: TableBatchedEmbeddingBags) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(_table_layout(module)).encode()), dtype=torch.uint8).clone()


def _check_layout(module: TableBatchedEmbeddingBags, state_dict, prefix, local_metadata, strict, missing_keys,
                  unexpected_keys, error_msgs) -> None:
    """Before a state dict's flat buffers are copied in: they must hold the same tables in the same
    order (same total size is not enough: rows would land in other tables without a word). A state
    dict saved before the layout was recorded is taken as it is. Float buffers are given in this
    module's types (``assign=True`` put an fp32 state dict's tensors in an fp16 module as they were),
    and the rounding generator's state is taken or left as this module's precision needs it."""
    key = prefix + "table_layout"
    if key not in state_dict:
        state_dict[key] = module.table_layout
    else:
        try:
            saved = json.loads(bytes(state_dict[key].cpu().tolist()).decode())
        except (ValueError, TypeError, AttributeError):
            saved = None
        if saved != _table_layout(module):
            raise ValueError(f"load_state_dict: the state dict holds the tables {saved} (name, rows, dim, in buffer "
                             f"order), this module {_table_layout(module)}; their rows cannot be loaded by position "
                             f"(rebuild the module with the same tables in the same order)")
    for name, buffer in module._buffers.items():
        given = state_dict.get(prefix + name)
        if (buffer is not None and isinstance(given, torch.Tensor) and given.is_floating_point()
                and buffer.is_floating_point() and given.dtype != buffer.dtype):
            state_dict[prefix + name] = given.to(buffer.dtype)
            bad = first_overflow(given, state_dict[prefix + name])
            if bad is not None:
                where = "load_state_dict: table {!r}, row {}".format(*module.table_row_at(bad)) \
                    if name == "weights" else f"load_state_dict: {prefix + name}"
                raise ValueError(overflow_message(where, float(given.reshape(-1)[bad]), buffer.dtype))
    # a state dict of another precision: fp32 rows round nothing (no generator state saved: this module
    # goes on from its own), and rounded rows' generator state has no use in an fp32 module (dropped);
    # either was a missing or unexpected key under strict loading
    for name, rounder in (("rounding_rng_state", module._rounder), ("replica_rounding_rng_state", module._replica_rounder)):
        key = prefix + name
        if module._buffers.get(name) is not None:
            if key not in state_dict:
                state_dict[key] = rounder.get_state().to(module._buffers[name].device)
        else:
            state_dict.pop(key, None)


def _save_rounding_state(module: TableBatchedEmbeddingBags, prefix: str, keep_vars: bool) -> None:
    module.rounding_rng_state = module._rounder.get_state().to(module.weights.device)
    if module._replica_rounder is not None:
        module.replica_rounding_rng_state = module._replica_rounder.get_state().to(module.weights.device)


def _adopt_rounding_state(module: TableBatchedEmbeddingBags, state_dict, prefix, *args) -> None:
    """Before loading: a rounding generator state saved on another kind of device (its size differs)
    cannot be restored; keep this module's own sequence and say so, instead of failing the load."""
    for name, rounder in (("rounding_rng_state", module._rounder), ("replica_rounding_rng_state", module._replica_rounder)):
        key, own = prefix + name, getattr(module, name, None)
        if own is not None and rounder is not None and key in state_dict and state_dict[key].shape != own.shape:
            warnings.warn(f"load_state_dict: {key} was saved by a generator of another kind of device; "
                          "stochastic rounding goes on from this module's own generator")
            state_dict[key] = rounder.get_state().to(own.device)  # its live state (the buffer is the last saved one)


def _load_rounding_state(module: TableBatchedEmbeddingBags, incompatible_keys) -> None:
    module._rounder.set_state(module.rounding_rng_state)
    if module._replica_rounder is not None:
        module._replica_rounder.set_state(module.replica_rounding_rng_state)
