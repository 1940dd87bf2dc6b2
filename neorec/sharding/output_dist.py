"""Output distribution: pooled rows go back to the ranks that own the samples, which put them into
the ``EmbeddingBagCollection`` layout.

A rank's fused lookup gives [all ranks' samples, its shard-feature columns + replica columns]. The
shard-feature columns of rank s's samples (rows of s's block) are sent to s in one all-to-all
(a differentiable one: backward returns the gradient the reverse way, scaled by ``grad_scale``).
The owner concatenates what it got from ranks 0..W-1 and its own replica columns, then places
every column: column pieces side by side in column order, row-wise partial sums ADDED (index_add),
table-wise columns copied.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from neorec.sharding.comm import Awaitable, CommStats, differentiable_all_to_all
from neorec.sharding.input_dist import LocalBatch
from neorec.sharding.qcomm import CommConfig, quantized_all_to_all
from neorec.sharding.routing import Routing
from neorec.sparse.keyed import KeyedTensor


class OutputPlacement:
    """Static column placement of one rank's output (same on every rank)."""

    def __init__(self, routing: Routing, device: torch.device) -> None:
        self.routing = routing
        self.columns = torch.tensor(routing.columns, dtype=torch.int64, device=device)
        self.runs: Optional[List[Tuple[int, int, int]]] = None
        if not routing.additive:  # a permutation of column blocks: copy the blocks
            self.runs = column_runs(routing.columns)

    def place(self, received: torch.Tensor) -> torch.Tensor:
        """[B, len(columns)] in (rank 0..W-1, replicas) column order -> [B, total_dim]."""
        if self.runs is not None:
            return _PermuteColumnBlocks.apply(received, self.runs)
        out = received.new_zeros(received.shape[0], self.routing.total_dim)
        return out.index_add(1, self.columns, received)


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


class _PermuteColumnBlocks(torch.autograd.Function):
    """out[:, t : t + w] = received[:, s : s + w] for every run (s, t, w); the gradient goes back
    the same way. One strided block copy per run (a table's columns move together), where a
    per-column index_select and its scatter-add backward touch every element through an index."""

    @staticmethod
    def forward(ctx, received, runs):  # type: ignore[override]
        ctx.runs = runs
        out = received.new_empty(received.shape[0], sum(w for _, _, w in runs))
        for source, target, width in runs:
            out[:, target : target + width].copy_(received[:, source : source + width])
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        grad = grad_out.new_empty(grad_out.shape[0], sum(w for _, _, w in ctx.runs))
        for source, target, width in ctx.runs:
            grad[:, source : source + width].copy_(grad_out[:, target : target + width])
        return grad, None


def output_dist(routing: Routing, placement: OutputPlacement, local: LocalBatch, pooled: torch.Tensor,
                group: Optional[dist.ProcessGroup], stats: Optional[CommStats] = None,
                grad_scale: float = 1.0, comm: Optional[CommConfig] = None) -> Awaitable[KeyedTensor]:
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
                                        group, comm, stats, "output_dist", grad_scale=grad_scale)
    else:
        exchange = differentiable_all_to_all(model_parallel.reshape(-1), send, recv, group, stats, "output_dist",
                                             grad_scale=grad_scale)
    own = sizes[rank]

    def finish() -> KeyedTensor:
        flat = exchange.wait()
        blocks = list(flat.split(recv))
        parts = [block.view(own, routing.dims_on[r]) for r, block in enumerate(blocks) if routing.dims_on[r]]
        if routing.replica_dim:
            offset = local.sample_offset(rank)
            parts.append(pooled[offset : offset + own, width:])
        received = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
        return KeyedTensor(routing.feature_names, routing.feature_dims, placement.place(received))

    return Awaitable([], finish)
