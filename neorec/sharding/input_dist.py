"""Input distribution: every rank sends the ids of its local samples to the ranks that hold the
pieces of their tables, and receives the ids that its own pieces must look up.

Per destination rank the payload is KeyedJaggedTensor-like: lengths per (shard feature, sample) for
all of this rank's samples, then the values, re-based to the piece's rows:

- TABLE_WISE: all ids of the feature;
- COLUMN_WISE / TABLE_COLUMN_WISE: all ids, to every column piece (replicated);
- ROW_WISE / TABLE_ROW_WISE: ids bucketized by row range (minus the range's start).

Exchange, in two stages: (1) a fixed-size header all-to-all (batch size, number of values,
weighted flag per pair), launched asynchronously; (2) once the header is in (``progress()`` on the
returned awaitable, or ``wait()``), one all-to-all of lengths + values (int64) and, when any rank
has weights (KJT weights or mean pooling turned into 1 / len(bag)), one of the weights, launched
asynchronously. ``wait()`` runs what is left and assembles the receiving rank's batch: its shard
features for ALL ranks' samples (source by source), then its replica features for its own samples
only. The pipeline launches stage 1 before a step's backward and stage 2 after it, so that neither
blocks on the other ranks (``neorec/train/pipeline.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from neorec.embedding.config import TableConfig
from neorec.embedding.path_common import check_lookup_input
from neorec.sharding.comm import Awaitable, CommStats, all_to_all
from neorec.sharding.routing import FeatureRoute, Routing
from neorec.sparse.jagged import JaggedTensor, KeyedJaggedTensor

Piece = Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]  # lengths [B], values, weights


@dataclass
class LocalBatch:
    """What one rank looks up.

    features: KJT over (its shard features, then the replica features), batch = the samples of
        all ranks back to back (rank 0's first); replica features have ids only in this rank's
        own block.
    batch_sizes: [world_size] samples that came from each rank.
    rank: this rank (its own samples start at ``sample_offset(rank)``).
    """

    features: KeyedJaggedTensor
    batch_sizes: List[int]
    rank: int

    def sample_offset(self, rank: int) -> int:
        return sum(self.batch_sizes[:rank])


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, 0).sub_(x)


def _check_ids(feature: str, table: TableConfig, values: torch.Tensor) -> None:
    """Before anything is sent: an id outside its table stops this rank while the ranks are in step
    (the pipeline launches a batch's exchange a step ahead, so this is where its ids are checked)."""
    if values.numel() == 0:
        return
    low, high = (int(v) for v in torch.aminmax(values))
    if low < 0 or high >= table.num_embeddings:
        bad = low if low < 0 else high
        raise ValueError(f"feature {feature!r} (table {table.name!r}): id {bad} is outside the "
                         f"table's rows [0, {table.num_embeddings})")


def _split_feature(route: FeatureRoute, jagged: JaggedTensor, weighted: bool) -> List[Piece]:
    """The feature's (lengths, values, weights) for each piece of its table, in route order."""
    lengths, values = jagged.lengths.to(torch.int64), jagged.values.to(torch.int64)
    _check_ids(route.feature, route.table, values)
    weights = None if jagged.weights is None else jagged.weights.to(torch.float32)
    if route.table.pooling == "mean":
        scale = torch.repeat_interleave(lengths.clamp(min=1).to(torch.float32).reciprocal(), lengths,
                                        output_size=values.numel())
        weights = scale if weights is None else weights * scale
    if weighted and weights is None:
        weights = torch.ones(values.numel(), dtype=torch.float32, device=values.device)
    if route.row_cuts is None or len(route.pieces) == 1:
        start = 0 if route.row_cuts is None else route.row_cuts[0]
        values = values - start if start else values
        return [(lengths, values, weights)] * len(route.pieces)
    num_pieces, batch_size = len(route.pieces), lengths.numel()
    cuts = torch.tensor(route.row_cuts, dtype=torch.int64, device=values.device)
    bucket = torch.bucketize(values, cuts[1:-1], right=True)
    sample = torch.repeat_interleave(torch.arange(batch_size, device=values.device), lengths,
                                     output_size=values.numel())
    counts = torch.bincount(bucket * batch_size + sample, minlength=num_pieces * batch_size).view(num_pieces, batch_size)
    order = torch.sort(bucket, stable=True).indices
    rebased = values.index_select(0, order) - cuts.index_select(0, bucket.index_select(0, order))
    totals = counts.sum(1).tolist()
    value_parts = rebased.split(totals)
    weight_parts = [None] * num_pieces if weights is None else weights.index_select(0, order).split(totals)
    return [(counts[i], value_parts[i], weight_parts[i]) for i in range(num_pieces)]


def input_dist(routing: Routing, rank: int, features: KeyedJaggedTensor, group: Optional[dist.ProcessGroup],
               stats: Optional[CommStats] = None) -> Awaitable[LocalBatch]:
    """Launch the exchange of ``features`` (this rank's samples, keys ⊇ the model-parallel and
    replica features); ``wait()`` gives this rank's ``LocalBatch``."""
    if not isinstance(features, KeyedJaggedTensor):
        raise TypeError(f"expected a KeyedJaggedTensor, got {type(features).__name__}")
    check_lookup_input(features)  # first (all-to-all detaches weights: their gradient stayed None)
    world, batch_size, device = routing.world_size, features.batch_size, features.values.device
    missing = [f for f in routing.feature_names if f not in set(features.keys())]
    if missing:
        raise ValueError(f"KeyedJaggedTensor lacks features {missing}; expected all of {routing.feature_names} "
                         f"(got keys {features.keys()})")
    jagged = features.to_dict()
    weighted = features.weights is not None or routing.has_mean
    for table in routing.replicas:  # looked up locally, but checked here too, with the others
        for feature in table.feature_names:
            _check_ids(feature, table, jagged[feature].values)
    pieces: Dict[str, Piece] = {}
    for route in routing.routes:
        position = route.table.feature_names.index(route.feature)
        for piece, part in zip(route.pieces, _split_feature(route, jagged[route.feature], weighted)):
            pieces[piece.keys[position]] = part

    ints: List[torch.Tensor] = []
    floats: List[torch.Tensor] = []
    send_ints, send_floats = [], []
    header = []
    for dest in range(world):
        keys = routing.keys_on[dest]
        parts = [pieces[k] for k in keys]
        lengths = [p[0] for p in parts]
        values = [p[1] for p in parts]
        num_values = sum(v.numel() for v in values)
        ints += lengths + values
        send_ints.append(len(keys) * batch_size + num_values)
        if weighted:
            floats += [p[2] for p in parts]
        send_floats.append(num_values)
        header += [batch_size, num_values, int(weighted)]
    header_exchange = all_to_all(torch.tensor(header, dtype=torch.int64, device=device), [3] * world, [3] * world,
                                 group, stats, "input_dist.header")
    launched: Dict[str, object] = {}

    def launch_payload() -> None:
        """Stage 2: wait for the header, launch the id (and weight) all-to-alls."""
        if launched:
            return
        received = header_exchange.wait().view(world, 3).tolist()
        num_keys = len(routing.keys_on[rank])
        recv_ints = [num_keys * b + n for b, n, _ in received]
        recv_floats = [n for _, n, _ in received]
        payload = torch.cat(ints) if ints else torch.zeros(0, dtype=torch.int64, device=device)
        launched.update(batch_sizes=[r[0] for r in received], recv_floats=recv_floats, floats=None,
                        ints=all_to_all(payload, send_ints, recv_ints, group, stats, "input_dist"))
        if any(r[2] for r in received):
            if weighted:
                weights = torch.cat(floats) if floats else torch.zeros(0, device=device)
            else:
                weights = torch.ones(sum(send_floats), dtype=torch.float32, device=device)
            launched["floats"] = all_to_all(weights, send_floats, recv_floats, group, stats, "input_dist.weights")

    def finish() -> LocalBatch:
        launch_payload()
        ints_in = launched["ints"].wait()
        floats_in = None if launched["floats"] is None else launched["floats"].wait()
        return _assemble(routing, rank, features, launched["batch_sizes"], launched["recv_floats"], ints_in, floats_in)

    return Awaitable([], finish, progress=launch_payload)


# Up to this many blocks, a CPU block permutation is one ``cat`` of slices (a copy at memory speed);
# beyond, or on an accelerator (no host sync), a gather by a computed index.
_MAX_SLICED_BLOCKS = 1024


def _permute_blocks(values: torch.Tensor, block_lengths: torch.Tensor) -> torch.Tensor:
    """``values`` in blocks ordered (source, key) [S, K] -> the same blocks ordered (key, source)."""
    num_sources, num_keys = block_lengths.shape
    if num_sources == 1 or num_keys <= 1 or values.numel() == 0:
        return values
    if values.device.type == "cpu" and num_sources * num_keys <= _MAX_SLICED_BLOCKS:
        blocks = values.split(block_lengths.reshape(-1).tolist())
        return torch.cat([blocks[s * num_keys + k] for k in range(num_keys) for s in range(num_sources)])
    source_starts = _exclusive_cumsum(block_lengths.reshape(-1)).view(num_sources, num_keys).t().reshape(-1)
    target_lengths = block_lengths.t().reshape(-1)
    target_starts = _exclusive_cumsum(target_lengths)
    index = torch.repeat_interleave(source_starts - target_starts, target_lengths, output_size=values.numel())
    index += torch.arange(values.numel(), device=values.device)
    return values.index_select(0, index)


def _assemble(routing: Routing, rank: int, features: KeyedJaggedTensor, batch_sizes: List[int],
              recv_floats: List[int], ints_in: torch.Tensor, floats_in: Optional[torch.Tensor]) -> LocalBatch:
    keys = routing.keys_on[rank]
    num_keys, total = len(keys), sum(batch_sizes)
    device = ints_in.device
    lengths_parts, value_parts = [], []
    start = 0
    for source, size in enumerate(batch_sizes):
        segment = ints_in[start : start + num_keys * size + recv_floats[source]]
        start += segment.numel()
        lengths_parts.append(segment[: num_keys * size].view(num_keys, size))
        value_parts.append(segment[num_keys * size :])
    lengths = torch.cat(lengths_parts, dim=1)
    block_lengths = torch.stack([p.sum(1) for p in lengths_parts]) if num_keys else None
    values = torch.cat(value_parts)
    weights = floats_in
    if block_lengths is not None:
        values = _permute_blocks(values, block_lengths)
        weights = None if weights is None else _permute_blocks(weights, block_lengths)

    if routing.replica_features:
        local = features.select_keys(routing.replica_features)
        replica_lengths = torch.zeros(len(routing.replica_features), total, dtype=torch.int64, device=device)
        offset = sum(batch_sizes[:rank])
        replica_lengths[:, offset : offset + features.batch_size] = local.lengths_2d()
        if weights is None and local.weights is not None:
            weights = torch.ones(values.numel(), dtype=torch.float32, device=device)
        if weights is not None:
            local_weights = local.weights if local.weights is not None else torch.ones(local.values.numel(), device=device)
            weights = torch.cat([weights, local_weights.to(torch.float32)])
        keys = keys + routing.replica_features
        lengths = torch.cat([lengths.reshape(-1), replica_lengths.reshape(-1)])
        values = torch.cat([values, local.values.to(torch.int64)])
    kjt = KeyedJaggedTensor(keys, values, lengths.reshape(-1), weights, batch_size=total, validate=False)
    return LocalBatch(kjt, batch_sizes, rank)
