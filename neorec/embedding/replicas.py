"""Dense gradients for the tables of a ``TableBatchedEmbeddingBags`` that are data-parallel replicas.

A sharded collection keeps ONE fused module per rank: its model-parallel shards update in the
backward pass as usual, while its data-parallel (replicated) tables must first combine their
gradient over the replicas (summed, in distributed training: each rank's loss is its share of the
global mean loss). ``ReplicaGradients`` takes those tables' rows out of the fused update,
accumulates them into one compact fp32 buffer (the tables' elements back to back), hands that
buffer to a ``reducer`` (an all-reduce sum, say) at the end of every backward pass, and then
applies the optimizer to every row that some replica looked up (same arithmetic as the fused
update, which steps every looked-up row, also one whose gradient sums to zero: weight decay and
Adam's moments still move it). Which rows were looked up travels in the same buffer: one count per
row after the gradients (4 bytes per row against 4 x dim), summed by the same reduction. The
reducer is called on every backward, even when this process looked up no id of those tables, so
that collectives inside it stay matched across processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from neorec.embedding.layout import DimGroup, TableLayout


@dataclass
class _ReplicaTable:
    group: DimGroup
    row_start: int  # first row inside the group view
    num_rows: int
    element_start: int  # offset in the compact gradient buffer
    count_start: int = 0  # offset of its rows' look-up counts, after all gradients


class ReplicaGradients:
    """Compact dense gradient of ``table_names`` (tables of ``layout``); see the module docstring.

    ``reducer(grad)`` gets the [num_elements] fp32 buffer and must update it in place."""

    def __init__(self, layout: TableLayout, table_names: Sequence[str],
                 reducer: Optional[Callable[[torch.Tensor], None]]) -> None:
        index = {t.name: i for i, t in enumerate(layout.tables)}
        unknown = [n for n in table_names if n not in index]
        if unknown:
            raise ValueError(f"dense_gradient_tables: no tables named {unknown}; tables are {list(index)}")
        self.reducer = reducer
        self.tables: List[_ReplicaTable] = []
        self._spans: Dict[int, List[Tuple[int, int, _ReplicaTable]]] = {}
        offset = 0
        for name in sorted(set(table_names), key=lambda n: index[n]):
            t = index[name]
            group = layout.groups[layout.table_group[t]]
            table = _ReplicaTable(group, layout.table_row_offset_in_group[t], layout.tables[t].num_embeddings, offset)
            offset += table.num_rows * group.dim
            self.tables.append(table)
            self._spans.setdefault(group.row_start, []).append((table.row_start, table.row_start + table.num_rows, table))
        for table in self.tables:
            table.count_start = offset
            offset += table.num_rows
        self.num_elements = offset  # gradients, then one look-up count per row
        self.grad: Optional[torch.Tensor] = None

    def _view(self, table: _ReplicaTable) -> torch.Tensor:
        size = table.num_rows * table.group.dim
        return self.grad[table.element_start : table.element_start + size].view(table.num_rows, table.group.dim)

    def _counts(self, table: _ReplicaTable) -> torch.Tensor:
        return self.grad[table.count_start : table.count_start + table.num_rows]

    def take(self, group: DimGroup, rows: torch.Tensor, row_grad: torch.Tensor
             ) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """Accumulate the replica rows among ``rows`` ([C] ascending unique group rows, gradient
        ``row_grad`` [C, dim]); return the other rows and their gradient, or None if none are left."""
        spans = self._spans.get(group.row_start)
        if not spans:
            return rows, row_grad
        if self.grad is None:
            self.grad = torch.zeros(self.num_elements, device=row_grad.device)
        bounds = torch.tensor([b for lo, hi, _ in spans for b in (lo, hi)], device=rows.device, dtype=rows.dtype)
        cuts = torch.searchsorted(rows, bounds).tolist()
        keep: List[Tuple[int, int]] = []
        previous = 0
        for (lo, _, table), first, last in zip(spans, cuts[0::2], cuts[1::2]):
            if last > first:
                self._view(table).index_add_(0, rows[first:last] - lo, row_grad[first:last])
                self._counts(table).index_fill_(0, rows[first:last] - lo, 1.0)
            keep.append((previous, first))
            previous = last
        keep.append((previous, rows.numel()))
        keep = [(a, b) for a, b in keep if b > a]
        if not keep:
            return None
        if len(keep) == 1:
            a, b = keep[0]
            return rows[a:b], row_grad[a:b]
        return torch.cat([rows[a:b] for a, b in keep]), torch.cat([row_grad[a:b] for a, b in keep])

    def reduce_and_apply(self, update: Callable[[DimGroup, torch.Tensor, torch.Tensor], None],
                         device: torch.device) -> None:
        """Reduce the accumulated gradient, then ``update(group, group_rows, grad)`` for the rows
        some replica looked up; zero the buffer."""
        if self.grad is None:
            self.grad = torch.zeros(self.num_elements, device=device)
        if self.reducer is not None:
            self.reducer(self.grad)
        for table in self.tables:
            view = self._view(table)
            rows = self._counts(table).gt(0).nonzero().squeeze(1)
            if rows.numel():
                update(table.group, rows + table.row_start, view.index_select(0, rows))
        self.grad.zero_()
