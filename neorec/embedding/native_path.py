"""The native CPU path of ``TableBatchedEmbeddingBags``: the same flat buffers, pooled by the C
forward and updated by the C backward fused with the optimizer (``neorec/native/tbe.c``, built on
first use by ``neorec/native/build.py``; called through ``kernels/native_tbe.py``).

Against the torch path (``F.embedding_bag`` per dim group, a NumPy sort, ``index_add_``) it reads
the KeyedJaggedTensor as it is (no per-group id shift, no batch-major reorder, no transpose of the
pooled output), sorts the ids by row with a radix sort, and updates each touched row in one pass
(its gradient, the optimizer state and the weights while the row is in cache).

The module picks it (``kernel="auto"``) for CPU fp32 weights with SGD, AdaGrad or row-wise
AdaGrad and no dense-gradient tables, when the kernels build; otherwise it keeps the torch path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from neorec.embedding.kernels.native_tbe import KIND_CODES, NativeKernels
from neorec.embedding.path_common import PathLookup, features_in_order
from neorec.native import MAX_NATIVE_DIM, native_available
from neorec.sparse.jagged import KeyedJaggedTensor

if TYPE_CHECKING:  # pragma: no cover
    from neorec.embedding.tbe import TableBatchedEmbeddingBags

NATIVE_OPTIMIZERS = tuple(KIND_CODES)


def check_bags(ids: torch.Tensor, offsets: torch.Tensor, weights: Optional[torch.Tensor], num_bags: int) -> None:
    """What the C kernels trust: one offset per bag and one more, the last at the number of ids, none
    below the one before (no negative length), a weight per id (a KeyedJaggedTensor built with
    validate=False whose lengths sum past its values had the kernels read past the ids)."""
    if offsets.numel() != num_bags + 1:
        raise ValueError(f"KeyedJaggedTensor: {offsets.numel() - 1} bags, expected {num_bags} (features x batch size)")
    end = int(offsets[-1]) if num_bags else 0
    if int(offsets[0]) != 0 or end != ids.numel():
        raise ValueError(f"KeyedJaggedTensor: its lengths add up to {end - int(offsets[0])}, but it has {ids.numel()} "
                         "values (build it with validate=True to find the feature)")
    if num_bags and bool((offsets[1:] < offsets[:-1]).any()):  # a negative length: a bag past its neighbours
        raise ValueError("KeyedJaggedTensor: a negative length (build it with validate=True to find the feature)")
    if weights is not None and weights.numel() != ids.numel():
        raise ValueError(f"KeyedJaggedTensor: {weights.numel()} weights for {ids.numel()} values")


def native_unsupported_reason(module: "TableBatchedEmbeddingBags") -> Optional[str]:
    """Why the native path cannot serve ``module`` (None when it can)."""
    if module.weights.device.type != "cpu":
        return f"the weights are on {module.weights.device}, the native kernels run on the CPU"
    if module.weights.dtype != torch.float32:
        return f"the native kernels take fp32 weights, these are {module.weights.dtype}"
    if module.optimizer.kind not in NATIVE_OPTIMIZERS:
        return f"optimizer {module.optimizer.kind!r} has no native kernel (have {NATIVE_OPTIMIZERS})"
    if module.dense_gradient or module._replicas is not None:
        return "dense-gradient tables use the torch path"
    if max(module.table_rows) > 2**32:
        return f"a table of {max(module.table_rows)} rows: the native kernels take at most 2^32 rows per table"
    if max(module.table_dims) > MAX_NATIVE_DIM:
        return (f"a table of dim {max(module.table_dims)}: the native kernels take dims up to {MAX_NATIVE_DIM} "
                f"(one row of scratch on each thread's stack)")
    return native_available()


class NativePath:
    """Forward and fused backward of one ``TableBatchedEmbeddingBags`` on the native kernels."""

    def __init__(self, module: "TableBatchedEmbeddingBags") -> None:
        self.module = module
        self._kernels: Optional[NativeKernels] = None

    def __getstate__(self) -> dict:
        """Copies and pickles leave out the loaded library (a ctypes handle cannot be copied); it
        is loaded again on first use."""
        return {**self.__dict__, "_kernels": None}

    def kernels(self) -> NativeKernels:
        if self._kernels is None:
            m = self.module
            columns = [0]
            for dim in m.feature_dims:
                columns.append(columns[-1] + dim)
            self._kernels = NativeKernels(
                table_dims=m.table_dims, table_rows=m.table_rows, table_offsets=m.table_offsets,
                table_row_offsets=m.table_row_offsets, feature_table=m.layout.feature_tables,
                feature_mean=[m.tables[t].pooling == "mean" for t in m.layout.feature_tables],
                col_offsets=columns[:-1],
            )
        return self._kernels

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """[B, total_dim] fp32 pooled embeddings, features in ``module.feature_names`` order."""
        m = self.module
        features = features_in_order(features, m.feature_names, m.weights.device, check_sum=False)  # (check_bags)
        weights = features.weights
        if weights is not None:
            weights = weights.detach().to(torch.float32).contiguous()
        ids = features.values.to(torch.int64).contiguous()
        offsets = features.offsets()
        batch_size = features.batch_size
        if not torch.is_grad_enabled():
            return self.pool(ids, offsets, weights, batch_size)
        anchor = torch.zeros((), requires_grad=True)
        return PathLookup.apply(anchor, self, ids, offsets, weights, batch_size)

    def pool(self, ids: torch.Tensor, offsets: torch.Tensor, weights: Optional[torch.Tensor],
             batch_size: int) -> torch.Tensor:
        """[B, total_dim] pooled; ValueError naming the feature and table of an id outside its table."""
        self._check_buffers()
        check_bags(ids, offsets, weights, len(self.module.feature_names) * batch_size)
        pooled, bad = self.kernels().forward(self.module.weights, ids, offsets, weights, batch_size)
        if bad >= 0:
            self._raise_bad_id(ids, offsets, batch_size, bad)
        return pooled

    def _check_buffers(self) -> None:
        """The C kernels read raw memory: the buffers must still be contiguous and of the dtype they
        were built with (``module.double()``, say, would change them under the chosen path)."""
        m = self.module
        for name, dtype in (("weights", torch.float32), ("momentum1", torch.float32), ("modified_rows", torch.bool)):
            buffer = getattr(m, name, None)
            if buffer is not None and (not buffer.is_contiguous() or buffer.dtype != dtype):
                raise ValueError(f"TableBatchedEmbeddingBags.{name} must stay a contiguous {dtype} tensor for the "
                                 f"native kernels, it is now {buffer.dtype} with strides {buffer.stride()}; "
                                 f"assign with .copy_(), or build the module with kernel='torch'")

    def _raise_bad_id(self, ids: torch.Tensor, offsets: torch.Tensor, batch_size: int, position: int) -> None:
        m = self.module
        bag = int(torch.searchsorted(offsets, torch.tensor([position]), right=True)[0]) - 1
        feature = bag // batch_size
        table = m.tables[m.layout.feature_tables[feature]]
        raise ValueError(f"feature {m.feature_names[feature]!r} (table {table.name!r}): id {int(ids[position])} "
                         f"is outside the table's rows [0, {table.num_embeddings})")

    @torch.no_grad()
    def backward(self, ids, offsets, weights, batch_size, grad_output) -> None:
        m = self.module
        self._check_buffers()
        opt = m.checked_optimizer()
        m.step += 1
        self.kernels().backward_update(
            opt.kind, m.weights, getattr(m, "momentum1", None), ids, offsets, weights, batch_size,
            grad_output.to(torch.float32).contiguous(), learning_rate=opt.learning_rate, eps=opt.eps,
            weight_decay=opt.weight_decay, modified=m.modified_rows)
