"""Output distribution: pooled rows go back to the ranks that own the samples, which put them into
the ``EmbeddingBagCollection`` layout.

A rank's fused lookup gives [all ranks' samples, its shard-feature columns + replica columns]. The
shard-feature columns of rank s's samples (rows of s's block) are sent to s in one all-to-all
(a differentiable one: backward returns the gradient the reverse way).
The owner places every column of what it got from ranks 0..W-1 and of its own replica columns:
without row-wise pieces the output is those parts as ``ColumnBlocks`` (a permutation of column
blocks, copied into one matrix only when asked: the native dot interaction reads the blocks where
they are); with them, the parts are concatenated and the row-wise partial sums ADDED (index_add,
in rank order: ``addition_layers``).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from neorec.sharding.comm import Awaitable, CommStats, differentiable_all_to_all
from neorec.sharding.input_dist import LocalBatch
from neorec.sharding.qcomm import CommConfig, quantized_all_to_all
from neorec.sharding.routing import Routing
from neorec.sparse.column_blocks import ColumnBlocks, flat_views
from neorec.sparse.keyed import KeyedTensor


class OutputPlacement:
    """Static column placement of one rank's output (same on every rank).

    The received columns are, in order, rank 0's block .. rank W-1's block (``dims_on[r]`` columns
    each, skipped when empty), then the replica columns. Without row-wise pieces every output
    column comes from exactly one received column: the placement is a permutation of column
    blocks (runs of adjacent columns) of the received buffer, handed on as ``ColumnBlocks``
    (``materialize()`` copies them row by row). With row-wise pieces the partial sums are added
    (``index_add``)."""

    def __init__(self, routing: Routing, device: torch.device) -> None:
        self.routing = routing
        self.flat_widths = [d for d in routing.dims_on if d]  # the received blocks' widths
        self.runs: Optional[List[Tuple[int, int, int, int]]] = None
        self.columns = torch.tensor(routing.columns, dtype=torch.int64, device=device)
        self.layers: List[Tuple[torch.Tensor, torch.Tensor]] = []
        if not routing.additive:
            replica = [routing.replica_dim] if routing.replica_dim else []
            self.runs = part_runs(routing.columns, self.flat_widths + replica)
        elif torch.device(device).type != "cpu":  # the CPU's index_add adds in index order: one call
            self.layers = [(torch.tensor(src, dtype=torch.int64, device=device),
                            torch.tensor(dst, dtype=torch.int64, device=device))
                           for src, dst in addition_layers(routing.columns)]

    def place(self, flat: torch.Tensor, rows: int, replica: Optional[torch.Tensor]) -> Union[torch.Tensor, ColumnBlocks]:
        """The received blocks (``flat``: rank r's [rows, dims_on[r]] block after rank r-1's) and
        the replica columns ([rows, replica_dim] or None) -> [rows, total_dim]: without row-wise
        pieces as ``ColumnBlocks`` (copied into one matrix only when a consumer asks for it),
        otherwise a tensor."""
        extras = [replica] if replica is not None else []
        if self.runs is not None:
            return ColumnBlocks(flat, rows, tuple(self.flat_widths), tuple(extras), tuple(self.runs))
        parts = flat_views(flat, rows, self.flat_widths) + extras
        received = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
        out = received.new_zeros(rows, self.routing.total_dim)
        if not self.layers:  # CPU: the partial sums added in received (rank) order
            return out.index_add(1, self.columns, received)
        for src, dst in self.layers:  # no target twice in one index_add: CUDA's atomics add in any order
            out.index_add_(1, dst, received.index_select(1, src))
        return out


def addition_layers(columns: Sequence[int]) -> List[Tuple[List[int], List[int]]]:
    """The additions of received column ``i`` into output column ``columns[i]``, in layers: layer k
    holds each output column's k-th contribution (in received order), so that no layer names a
    column twice. Adding the layers in order adds every column's partial sums in rank order: the same
    bits on every device (one ``index_add`` with repeated targets is atomic, unordered, on CUDA)."""
    seen: dict = {}
    layers: List[Tuple[List[int], List[int]]] = []
    for source, target in enumerate(columns):
        k = seen.get(target, 0)
        seen[target] = k + 1
        if k == len(layers):
            layers.append(([], []))
        layers[k][0].append(source)
        layers[k][1].append(target)
    return layers


def column_runs(columns: Sequence[int]) -> List[Tuple[int, int, int]]:
    """Maximal runs of consecutive ``columns``: (first received column, first output column,
    width); received column ``i`` goes to output column ``columns[i]``."""
    runs: List[Tuple[int, int, int]] = []
    for source, target in enumerate(columns):
        if runs and runs[-1][1] + runs[-1][2] == target:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((source, target, 1))
    return runs


def part_runs(columns: Sequence[int], part_widths: Sequence[int]) -> List[Tuple[int, int, int, int]]:
    """``column_runs`` cut at the boundaries of the received parts: (part, first column in the
    part, first output column, width)."""
    starts = [0]
    for width in part_widths:
        starts.append(starts[-1] + width)
    out = []
    for source, target, width in column_runs(columns):
        while width:
            part = max(p for p in range(len(part_widths)) if starts[p] <= source)
            take = min(width, starts[part + 1] - source)
            out.append((part, source - starts[part], target, take))
            source, target, width = source + take, target + take, width - take
    return out


def output_dist(routing: Routing, placement: OutputPlacement, local: LocalBatch, pooled: torch.Tensor,
                group: Optional[dist.ProcessGroup], stats: Optional[CommStats] = None,
                comm: Optional[CommConfig] = None) -> Awaitable[KeyedTensor]:
    """Launch the exchange of ``pooled`` ([sum(batch_sizes), dims_on[rank] + replica_dim], from the
    fused lookup of ``local``); ``wait()`` gives the KeyedTensor of this rank's samples. ``comm``:
    codecs of the exchange and of its gradient (``qcomm.py``; None or fp32 both ways = exact).
    Row-wise partial sums are added after decoding, in fp32."""
    rank, sizes = local.rank, local.batch_sizes
    width = routing.dims_on[rank]
    model_parallel = pooled[:, :width] if routing.replica_dim else pooled
    send = [b * width for b in sizes]
    recv = [sizes[rank] * routing.dims_on[r] for r in range(routing.world_size)]
    if comm is not None and comm.quantized:
        exchange = quantized_all_to_all(model_parallel.reshape(-1), [(b, width) for b in sizes],
                                        [(sizes[rank], routing.dims_on[r]) for r in range(routing.world_size)],
                                        group, comm, stats, "output_dist")
    else:
        exchange = differentiable_all_to_all(model_parallel.reshape(-1), send, recv, group, stats, "output_dist")
    own = sizes[rank]

    def finish() -> KeyedTensor:
        flat = exchange.wait()
        replica = None
        if routing.replica_dim:
            offset = local.sample_offset(rank)
            replica = pooled[offset : offset + own, width:]
        return KeyedTensor(routing.feature_names, routing.feature_dims, placement.place(flat, own, replica))

    return Awaitable([], finish)
