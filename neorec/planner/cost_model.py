"""The cost model: seconds per iteration and bytes held by one piece of one sharding option.

    settings = PlanSettings(batch_size=512, optimizer="rowwise_adagrad")
    cost, memory = piece_cost(table, ShardingType.ROW_WISE, num_pieces=8, tier="device",
                              precision="fp16", topology=topo, settings=settings)
    cost.total          # seconds per iteration on the rank holding that piece
    memory.device       # bytes on that rank's device (weights, optimizer state, cache, buffers)

Model (per iteration, W ranks, R per node, B samples per rank, G = W * B global samples, a table
of pooling factor L ids per sample, a piece of d columns stored in e bytes per element):

- lookups: a table-wise or column-wise piece sees all G * L ids, a row-wise piece G * L / k (ids
  spread evenly over rows), a replica B * L. Forward reads ids * max(d * e, 32) bytes (32 B is
  the HBM access sector); backward reads the pooled gradient and reads + writes the row and its
  optimizer state. Time = bytes / bandwidth of the tier (device, host over PCIe, SSD), a cached
  tier mixing device and backing bandwidth by ``cache_hit_rate``.
- communication: the piece's owner receives its ids (8 bytes each, plus lengths) and sends
  G * d pooled values forward and receives as many gradient values backward (row-wise pieces send
  full-width partial sums: that is row-wise's price). Bytes to other ranks split into the share
  inside the node (NVLink) and outside it (NIC), the slower of the two sets the time. Node-local
  row-wise (TWRW) reduces the partial sums inside the node first (reduce-scatter over NVLink),
  so only 1/R of them cross nodes, as in Neo's hierarchical collectives.
- latency: a piece's communication costs are bandwidth terms; the fixed latency of each collective
  is paid once per step by every rank, however many tables it carries (``collective_latencies``,
  added by ``PlanResult.ranks()`` and to the plan's makespan).
- replicas (DATA_PARALLEL): a dense gradient of the whole table (fp32, plus a look-up count per
  row) is all-reduced (hierarchical: ring inside the node, then the R NICs of a node in parallel),
  the optimizer updates the rows some rank looked up (at most G * L) and the buffer is zeroed;
  every rank keeps that gradient buffer besides the table.
- memory: rows x (d x e + optimizer state) on the device or host tier; a cached tier's store holds
  records as training lays them out (d x e rounded up to 4 bytes, an int8 row's 8 bytes of scale
  and bias, the state, an LFU count), and its cache ``cache_fraction`` of the rows (or
  ``cache_rows`` per piece; rounded up to whole sets of ``cache_ways``) in fp32 (+ state) with
  ``CACHE_SLOT_BYTES`` of metadata per slot on the device. int8 is a store precision only (a
  cached tier's). Model-parallel pieces hold
  double-buffered (pipelined) id and pooled-output buffers on the device.

Approximations: ids are spread evenly (no hot rows per piece), unique-row savings in backward are
ignored, and the receiving side of the all-to-all (uniform over ranks) is left to the simulator.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields
from typing import Iterable, Optional, Tuple

from neorec.planner.topology import Topology
from neorec.sharding.plan import ShardingType

PRECISION_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1}
STORE_ONLY_PRECISIONS = ("int8",)  # rows of a cached tier's store only, never of a fused module
CACHE_SLOT_BYTES = 33  # a cache slot's metadata on the device: row, last use, count, pin (int64), dirty
from neorec.planner.names import OPTIMIZERS, TIERS  # noqa: E402  (re-exported)
ID_BYTES = 8          # int64 ids and lengths, as neorec's input_dist sends them
SECTOR_BYTES = 32     # smallest HBM/DRAM access


MAX_ROWS = 2 ** 63 - 1   # ids are int64
MAX_DIM = 2 ** 16
MAX_POOLING = 1e6        # ids per sample; a million already makes a table's lookups ~1e9 per batch


@dataclass(frozen=True)
class TableSpec:
    """One embedding table as the planner sees it.

    pooling: average ids per sample summed over the table's features.
    sharding_types / tiers / precisions: per-table constraints (None = the planner's settings).
    """

    name: str
    num_rows: int
    dim: int
    pooling: float = 1.0
    sharding_types: Optional[Tuple[str, ...]] = None
    tiers: Optional[Tuple[str, ...]] = None
    precisions: Optional[Tuple[str, ...]] = None

    def __post_init__(self) -> None:
        for key, most in (("num_rows", MAX_ROWS), ("dim", MAX_DIM)):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= most:
                raise ValueError(f"table {self.name!r}: {key} must be an integer in [1, {most:,}], got {value!r}")
        if (not isinstance(self.pooling, numbers.Real) or isinstance(self.pooling, bool)
                or not 0 < self.pooling <= MAX_POOLING):  # (beyond: costs overflowed to inf and NaN)
            raise ValueError(f"table {self.name!r}: pooling must be a number in (0, {MAX_POOLING:,.0f}] ids per "
                             f"sample, got {self.pooling!r}")
        object.__setattr__(self, "pooling", float(self.pooling))
        for key, allowed in (("sharding_types", [t.value for t in ShardingType]), ("tiers", TIERS),
                             ("precisions", tuple(PRECISION_BYTES))):
            value = getattr(self, key)
            if isinstance(value, str):
                raise ValueError(f"table {self.name!r}: {key} must be a list of names, got the string {value!r}")
            if value is not None:
                bad = [v for v in value if v not in allowed]
                if bad or not value:
                    raise ValueError(f"table {self.name!r}: {key} {list(value)} must be a non-empty subset of "
                                     f"{list(allowed)}")

    @property
    def num_parameters(self) -> int:
        return self.num_rows * self.dim


@dataclass(frozen=True)
class PlanSettings:
    """What the planner may choose and what it assumes.

    batch_size: samples per rank per iteration.
    optimizer: the sparse optimizer (sets the optimizer state per row).
    precisions / tiers: allowed, in order of preference (the planner relaxes left to right only
        when the plan does not fit otherwise).
    sharding_types: allowed sharding types.
    comm_bytes: bytes per pooled value on the wire (4 = fp32, 2 = fp16, 1 = int8 quantized
        communication, whose rows also carry 8 bytes of min and step).
    cache_fraction / cache_hit_rate: device cache size of a cached tier (fraction of the rows)
        and the hit rate assumed for it; cache_rows (> 0): the cache of every cached piece holds
        that many rows instead (as ``embedding.location.cache_rows`` in training); cache_ways and
        cache_policy: its sets (slots are whole sets) and replacement ("lfu" stores a count per row).
    device_reserve_fraction: device memory kept for dense parameters and activations.
    max_column_pieces: the most pieces a column-wise option may have.
    """

    batch_size: int = 512
    optimizer: str = "rowwise_adagrad"
    precisions: Tuple[str, ...] = ("fp32",)
    tiers: Tuple[str, ...] = ("device",)
    sharding_types: Tuple[str, ...] = tuple(t.value for t in ShardingType)
    comm_bytes: int = 4
    cache_fraction: float = 0.1
    cache_rows: int = 0
    cache_ways: int = 32
    cache_policy: str = "lru"
    cache_hit_rate: float = 0.9
    device_reserve_fraction: float = 0.15
    max_column_pieces: int = 8

    def __post_init__(self) -> None:
        if not isinstance(self.batch_size, int) or isinstance(self.batch_size, bool) or self.batch_size < 1:
            raise ValueError(f"plan settings: batch_size must be a positive integer, got {self.batch_size!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"plan settings: optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        for key, allowed in (("precisions", tuple(PRECISION_BYTES)), ("tiers", TIERS),
                             ("sharding_types", tuple(t.value for t in ShardingType))):
            value = tuple(getattr(self, key))
            object.__setattr__(self, key, value)
            bad = [v for v in value if v not in allowed]
            if bad or not value:
                raise ValueError(f"plan settings: {key} {list(value)} must be a non-empty subset of {list(allowed)}")
        if self.comm_bytes not in (1, 2, 4):
            raise ValueError(f"plan settings: comm_bytes must be 1, 2 or 4, got {self.comm_bytes!r}")
        for key in ("cache_fraction", "cache_hit_rate", "device_reserve_fraction"):
            if not 0 <= getattr(self, key) <= 1:
                raise ValueError(f"plan settings: {key} must be in [0, 1], got {getattr(self, key)!r}")
        if not isinstance(self.cache_rows, int) or isinstance(self.cache_rows, bool) or self.cache_rows < 0:
            raise ValueError(f"plan settings: cache_rows must be an integer >= 0, got {self.cache_rows!r}")
        if not isinstance(self.cache_ways, int) or isinstance(self.cache_ways, bool) or self.cache_ways < 1:
            raise ValueError(f"plan settings: cache_ways must be a positive integer, got {self.cache_ways!r}")
        if self.cache_policy not in ("lru", "lfu"):
            raise ValueError(f"plan settings: cache_policy must be 'lru' or 'lfu', got {self.cache_policy!r}")


@dataclass
class Cost:
    """Seconds per iteration, by kind."""

    lookup_forward: float = 0.0
    lookup_backward: float = 0.0
    optimizer: float = 0.0
    input_comm: float = 0.0
    output_comm: float = 0.0
    gradient_comm: float = 0.0
    allreduce: float = 0.0

    @property
    def compute(self) -> float:
        return self.lookup_forward + self.lookup_backward + self.optimizer

    @property
    def comm(self) -> float:
        return self.input_comm + self.output_comm + self.gradient_comm + self.allreduce

    @property
    def total(self) -> float:
        return self.compute + self.comm

    def add(self, other: "Cost", scale: float = 1.0) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + scale * getattr(other, f.name))

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class Memory:
    """Bytes held on one rank, by tier (host and SSD are that rank's share of its node's).
    ``step_buffers``: the part of ``device`` that is a step's ids and pooled outputs (double
    buffered), which grows with the batch per rank and the number of ranks, not with the rows."""

    device: float = 0.0
    host: float = 0.0
    ssd: float = 0.0
    step_buffers: float = 0.0

    def add(self, other: "Memory", scale: float = 1.0) -> None:
        self.device += scale * other.device
        self.host += scale * other.host
        self.ssd += scale * other.ssd
        self.step_buffers += scale * other.step_buffers


def store_record_bytes(precision: str, cols: int, optimizer: str, counts: bool) -> int:
    """Bytes of one row's record in a cached tier's store: the store's own layout (``RowFormat``:
    values padded to 4 bytes, an int8 row's scale and bias, the optimizer state, an LFU count)."""
    from neorec.embedding.optimizers import STATE_LAYOUT
    from neorec.embedding.storage import row_format

    state = {name: 1 if per == "row" else cols for name, per in STATE_LAYOUT[optimizer]}
    return row_format(cols, precision, state, counts).record_bytes


def state_bytes_per_row(optimizer: str, dim: int) -> int:
    return {"sgd": 0, "rowwise_adagrad": 4, "adagrad": 4 * dim, "adam": 8 * dim}[optimizer]


def alltoall_seconds(num_bytes: float, topo: Topology, latency: bool = True) -> float:
    """One rank sends ``num_bytes`` spread evenly over all ranks (its own share stays local);
    ``latency``: plus the collective's fixed latency (False for one table's share of a collective
    that all tables use together, see ``collective_latencies``)."""
    world, per_node = topo.world_size, int(topo.ranks_per_node)
    if world == 1 or num_bytes <= 0:
        return 0.0
    intra = num_bytes * (per_node - 1) / world / topo.intra_node_bandwidth
    inter = num_bytes * (world - per_node) / world / topo.inter_node_bandwidth
    return max(intra, inter) + (topo.collective_latency if latency else 0.0)


def allreduce_seconds(num_bytes: float, topo: Topology, latency: bool = True) -> float:
    """Hierarchical all-reduce of ``num_bytes`` per rank: ring inside the node over NVLink, then
    the node's R NICs in parallel across nodes; ``latency`` as in ``alltoall_seconds``."""
    per_node, nodes = int(topo.ranks_per_node), int(topo.num_nodes)
    if topo.world_size == 1 or num_bytes <= 0:
        return 0.0
    intra = 2 * (per_node - 1) / per_node * num_bytes / topo.intra_node_bandwidth
    inter = 2 * (nodes - 1) / nodes * num_bytes / (per_node * topo.inter_node_bandwidth) if nodes > 1 else 0.0
    return intra + inter + (topo.collective_latency if latency else 0.0)


def collective_latencies(kinds: Iterable[ShardingType], topo: Topology) -> Cost:
    """The fixed latency of the collectives a step of a plan with these sharding types makes, paid
    once per step by every rank however many tables share them: the input, output and gradient
    all-to-alls when any table is model-parallel (node-local row-wise on several nodes: one more
    stage each way), one all-reduce of the replicas' gradients when any table is data-parallel."""
    kinds = set(kinds)
    cost = Cost()
    if topo.world_size == 1:
        return cost
    latency = topo.collective_latency
    if kinds - {ShardingType.DATA_PARALLEL}:
        stages = 2 if ShardingType.TABLE_ROW_WISE in kinds and topo.num_nodes > 1 else 1
        cost.input_comm, cost.output_comm, cost.gradient_comm = latency, stages * latency, stages * latency
    if ShardingType.DATA_PARALLEL in kinds:
        cost.allreduce = latency
    return cost


def _tier_seconds(num_bytes: float, tier: str, topo: Topology, settings: PlanSettings) -> float:
    device = num_bytes / topo.device_bandwidth
    if tier == "device":
        return device
    host_bw = topo.host_dram_bandwidth
    if tier == "dram":
        return num_bytes / host_bw
    if tier == "cached_dram":
        backing = num_bytes / host_bw
    else:  # cached_ssd: the node's SSD bandwidth shared by its ranks
        backing = num_bytes / max(topo.ssd_bandwidth / topo.ranks_per_node, 1.0)
    hit = settings.cache_hit_rate
    return hit * device + (1 - hit) * backing


def training_cache_slots(rows: int, ids: float, slots: int, ways: int) -> int:
    """The slots a cache of ``slots`` slots over a piece of ``rows`` rows has in training when
    ``ids`` ids a step come in: ``slots``, or, when a step's distinct rows outnumber them, what
    ``CachedEmbeddingBagCollection._grow_cache`` grows it to (1.25 x those rows, at most the
    piece, whole sets of ``ways``). Distinct rows of ``ids`` uniform draws,
    rows x (1 - (1 - 1/rows)^ids): an upper estimate for the skewed ids of real data."""
    distinct = rows * -math.expm1(ids * math.log1p(-1.0 / rows)) if rows > 1 else min(1.0, ids)
    if distinct <= slots:
        return slots
    return max(slots, min(math.ceil(distinct * 1.25 / ways), math.ceil(rows / ways)) * ways)


def piece_cost(table: TableSpec, kind: ShardingType, num_pieces: int, tier: str, precision: str,
               topo: Topology, settings: PlanSettings) -> Tuple[Cost, Memory]:
    """Cost and memory of ONE piece of ``table`` sharded ``kind`` into ``num_pieces`` (even
    pieces), held in ``tier`` at ``precision``; see the module docstring."""
    world, per_node = topo.world_size, int(topo.ranks_per_node)
    local, glob = settings.batch_size, settings.batch_size * world
    elem = PRECISION_BYTES[precision]
    rows, dim = table.num_rows, table.dim
    if kind.splits_rows:
        piece_rows, piece_cols, ids = -(-rows // num_pieces), dim, glob * table.pooling / num_pieces
    elif kind.splits_columns:
        piece_rows, piece_cols, ids = rows, -(-dim // num_pieces), glob * table.pooling
    elif kind == ShardingType.DATA_PARALLEL:
        piece_rows, piece_cols, ids = rows, dim, local * table.pooling
    else:
        piece_rows, piece_cols, ids = rows, dim, glob * table.pooling
    state = state_bytes_per_row(settings.optimizer, piece_cols)
    row_bytes = max(piece_cols * elem, SECTOR_BYTES)
    state_io = 2 * state if state else 0
    cost = Cost()
    cost.lookup_forward = _tier_seconds(ids * row_bytes, tier, topo, settings)
    # backward: pooled gradient in (fp32), row read + write
    cost.lookup_backward = _tier_seconds(ids * (piece_cols * 4 + 2 * row_bytes), tier, topo, settings)
    cost.lookup_backward += ids * topo.seconds_per_id  # calibrated per-id work (checks, sort, dedup)
    if kind == ShardingType.DATA_PARALLEL:
        grad_bytes = piece_rows * (piece_cols + 1) * 4  # fp32 gradient + a look-up count per row
        cost.allreduce = allreduce_seconds(grad_bytes, topo, latency=False)
        # the rows some rank looked up (at most G * L) are updated: gradient, row and state read, row
        # and state written; the counts are scanned and the whole buffer zeroed for the next step
        touched = min(piece_rows, glob * table.pooling)
        cost.optimizer = _tier_seconds(touched * (piece_cols * 4 + 2 * row_bytes + state_io), tier, topo, settings)
        cost.optimizer += (grad_bytes + piece_rows * 4) / topo.device_bandwidth
    else:
        cost.optimizer = _tier_seconds(ids * state_io, tier, topo, settings) if state_io else 0.0
        cost.input_comm = alltoall_seconds(ids * ID_BYTES + glob * ID_BYTES, topo, latency=False)
        row_header = 8 if settings.comm_bytes == 1 else 0  # int8 rows carry their min and step (2 fp32)
        pooled = glob * (piece_cols * settings.comm_bytes + row_header)
        if kind == ShardingType.TABLE_ROW_WISE and topo.num_nodes > 1:
            # reduce-scatter inside the node, then 1/R of the partial sums cross nodes
            intra = pooled * (per_node - 1) / per_node / topo.intra_node_bandwidth
            inter = pooled / per_node * (world - per_node) / world / topo.inter_node_bandwidth
            cost.output_comm = intra + inter
        else:
            cost.output_comm = alltoall_seconds(pooled, topo, latency=False)
        cost.gradient_comm = cost.output_comm
    memory = Memory()
    stored = piece_rows * (piece_cols * elem + state)
    cached = 0
    if tier in ("cached_dram", "cached_ssd"):
        from neorec.embedding.locations import cache_shape

        lfu = settings.cache_policy == "lfu"
        stored = piece_rows * store_record_bytes(precision, piece_cols, settings.optimizer, lfu)
        slots, ways = cache_shape(piece_rows, settings.cache_rows, settings.cache_fraction, settings.cache_ways)
        slots = training_cache_slots(piece_rows, ids, slots, ways)
        cached = slots * (piece_cols * 4 + state + CACHE_SLOT_BYTES)
    if tier == "device":
        memory.device = stored
    elif tier == "dram":
        memory.host = stored
    elif tier == "cached_dram":
        memory.device, memory.host = cached, stored
    else:
        memory.device, memory.ssd = cached, stored
    if topo.unified_memory:  # a CPU rank: its "device" is the host memory the host tiers use
        memory.device, memory.host = memory.device + memory.host, 0.0
    if kind == ShardingType.DATA_PARALLEL:
        memory.device += grad_bytes  # the gradient buffer all-reduced every step, kept between steps
    else:
        memory.step_buffers = 2 * ((ids + glob) * ID_BYTES + glob * piece_cols * 4)  # double-buffered ids+lengths, outputs
        memory.device += memory.step_buffers
    return cost, memory
