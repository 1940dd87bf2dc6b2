"""The native CPU forward and fused backward of the table-batched embedding op (``neorec/native/tbe.c``,
built by ``neorec/native/build.py``), over the flat buffers of ``TableBatchedEmbeddingBags``."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from neorec.native import build, threads

KIND_CODES = {"sgd": 0, "rowwise_adagrad": 1, "adagrad": 2}


def _threads(work: int) -> int:
    return threads.threads_for(work)


class NativeKernels:
    """The native forward and fused backward of one table-batched layout (fp32 weights).

    Metadata tensors are kept as contiguous CPU tensors whose pointers are passed to the C
    functions; scratch buffers of the backward grow as needed and are reused."""

    def __init__(self, table_dims: Sequence[int], table_rows: Sequence[int], table_offsets: Sequence[int],
                 table_row_offsets: Sequence[int], feature_table: Sequence[int], feature_mean: Sequence[bool],
                 col_offsets: Sequence[int]) -> None:
        self.lib = build.load()
        self.table_dims = torch.tensor(list(table_dims), dtype=torch.int32)
        self.table_rows = torch.tensor(list(table_rows), dtype=torch.int64)
        self.table_offsets = torch.tensor(list(table_offsets), dtype=torch.int64)
        self.table_row_offsets = torch.tensor(list(table_row_offsets), dtype=torch.int64)
        self.feature_table = torch.tensor(list(feature_table), dtype=torch.int32)
        self.feature_mean = torch.tensor([int(m) for m in feature_mean], dtype=torch.int32)
        self.col_offsets = torch.tensor(list(col_offsets), dtype=torch.int64)
        self.num_features = len(self.feature_table)
        self.total_cols = sum(int(table_dims[t]) for t in feature_table)
        self._feature_table = [int(t) for t in feature_table]  # host copy for splitting the work
        self._scratch: dict = {}

    def _buffer(self, name: str, size: int, dtype: torch.dtype) -> torch.Tensor:
        buffer = self._scratch.get(name)
        if buffer is None or buffer.numel() < size or buffer.dtype != dtype:
            buffer = torch.empty(max(size, 1), dtype=dtype)
            self._scratch[name] = buffer
        return buffer

    @staticmethod
    def _pointer(tensor: Optional[torch.Tensor]) -> Optional[int]:
        return None if tensor is None else tensor.data_ptr()

    def forward(self, weights: torch.Tensor, ids: torch.Tensor, bag_offsets: torch.Tensor,
                value_weights: Optional[torch.Tensor], batch_size: int) -> Tuple[torch.Tensor, int]:
        """-> (pooled [B, total_cols] fp32, -1 or the position of the first id outside its table).
        ``ids`` / ``bag_offsets`` int64 contiguous, ``value_weights`` fp32 contiguous or None."""
        out = torch.empty(batch_size, self.total_cols, dtype=torch.float32)
        num_bags = self.num_features * batch_size
        if num_bags == 0:
            return out, -1
        ranges = threads.ranges_tensor(threads.split_by_work(bag_offsets, num_bags, _threads(ids.numel() + num_bags)))
        bad = self.lib.neorec_forward(
            weights.data_ptr(), self.table_offsets.data_ptr(), self.table_dims.data_ptr(), self.table_rows.data_ptr(),
            self.feature_table.data_ptr(), self.feature_mean.data_ptr(), self.col_offsets.data_ptr(), ids.data_ptr(),
            bag_offsets.data_ptr(), self._pointer(value_weights), batch_size, self.total_cols, ranges.data_ptr(),
            len(ranges) // 2, out.data_ptr())
        return out, bad

    def _table_groups(self, bag_offsets: torch.Tensor, batch_size: int, parts: int) -> List[Tuple[int, int]]:
        """Up to ``parts`` feature ranges [begin, end) with about equal numbers of values, cut only
        where the table changes (a table's features are adjacent), so no two share a row."""
        cuts = [f for f in range(1, self.num_features) if self._feature_table[f] != self._feature_table[f - 1]]
        if parts <= 1 or not cuts:
            return [(0, self.num_features)]
        value_starts = bag_offsets[:: batch_size].tolist()  # [F + 1]: values before feature f
        total = value_starts[-1] - value_starts[0]
        edges = [0]
        for k in range(1, parts):
            target = value_starts[0] + total * k / parts
            best = min(cuts, key=lambda f: abs(value_starts[f] - target))
            if best > edges[-1]:
                edges.append(best)
        edges.append(self.num_features)
        return list(zip(edges[:-1], edges[1:]))

    def backward_update(self, kind: str, weights: torch.Tensor, state: Optional[torch.Tensor], ids: torch.Tensor,
                        bag_offsets: torch.Tensor, value_weights: Optional[torch.Tensor], batch_size: int,
                        grad_output: torch.Tensor, learning_rate: float, eps: float, weight_decay: float,
                        modified: Optional[torch.Tensor] = None) -> None:
        """One optimizer step on every row the batch touched (ids already checked by forward).
        ``grad_output`` [B, total_cols] fp32 contiguous; ``modified``: [total_rows] bool or None.
        Tables are split into groups (one per thread); each group is sorted by row and updated."""
        first = int(bag_offsets[0])
        count = int(bag_offsets[-1]) - first
        if count == 0:
            return
        if count >= 2**31 or self.num_features * batch_size >= 2**31:
            raise ValueError(f"the native embedding kernels take < 2^31 ids and bags per batch, got {count} ids "
                             f"in {self.num_features * batch_size} bags; use kernel='torch'")
        scaled = value_weights is not None or bool(self.feature_mean.any())
        buffers = [self._buffer(name, count, dtype) for name, dtype in (
            ("keys", torch.int32), ("keys_tmp", torch.int32), ("bags", torch.int32), ("bags_tmp", torch.int32),
            ("scales", torch.float32), ("scales_tmp", torch.float32)) if scaled or not name.startswith("scales")]
        groups = self._table_groups(bag_offsets, batch_size, _threads(count))
        group_bounds = threads.ranges_tensor(groups)  # keep a reference while C reads it
        if not scaled:
            buffers += [None, None]
        updated = self.lib.neorec_backward_update(
            KIND_CODES[kind], weights.data_ptr(), self._pointer(state), self.table_offsets.data_ptr(),
            self.table_dims.data_ptr(), self.table_rows.data_ptr(), self.table_row_offsets.data_ptr(),
            self.feature_table.data_ptr(), self.feature_mean.data_ptr(), self.col_offsets.data_ptr(), ids.data_ptr(),
            bag_offsets.data_ptr(), self._pointer(value_weights), batch_size, self.total_cols, grad_output.data_ptr(),
            group_bounds.data_ptr(), len(groups), float(learning_rate), float(eps),
            float(weight_decay), self._pointer(modified), *[self._pointer(b) for b in buffers])
        if updated < 0:
            raise ValueError("embedding backward: an id lies outside its table, although the forward checked "
                             "them; were the KeyedJaggedTensor's values changed between forward and backward?")
