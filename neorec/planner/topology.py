"""``Topology``: the cluster a plan is made for (ranks, memory tiers, links, compute), as plain data.

    topo = get_topology("zionex")                   # 16 nodes x 8 A100-40GB (Neo's ZionEX)
    topo = get_topology("zionex", num_nodes=4)      # the same machines, 4 nodes
    topo = get_topology("local-cpu")                # this machine, from `neorec plan --calibrate`
    topo = Topology.load("my_cluster.json")

All bandwidths are bytes per second in ONE direction for ONE rank; capacities are bytes. Host DRAM
and SSD are per node and shared by the node's ranks. Constants of the presets come from vendor
datasheets (cited next to each number) or from calibration (``neorec/planner/calibrate.py``);
none is fitted to any paper's results.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Mapping, Optional

GB = 1e9
TB = 1e12


@dataclass(frozen=True)
class Topology:
    """A cluster of ``num_nodes`` nodes with ``ranks_per_node`` ranks (devices) each.

    device_memory_bytes / device_bandwidth: per rank (HBM; host memory for a CPU rank).
    host_dram_bytes: per node; host_dram_bandwidth: per rank, what one device reads from host memory
        (PCIe for a GPU).
    ssd_bytes / ssd_bandwidth: per node.
    intra_node_bandwidth / inter_node_bandwidth: per rank, one direction (NVLink / one NIC).
    compute_flops: dense math rate per rank (FLOP/s).
    collective_latency: fixed seconds per collective call (launch + handshake).
    lookup_call_seconds: fixed seconds per step of a rank's fused lookup (forward + backward
        call overheads); seconds_per_id: per looked-up id (id checks, sort, dedup). Both come from
        calibration (``local-cpu``); 0 for the GPU presets (not modelled there).
    unified_memory: 1 when a rank's device memory IS host memory (a CPU rank): the host DRAM tiers
        ("dram", a cached_dram store) then draw on ``device_memory_bytes`` too, and
        ``host_dram_bytes`` is not used (counted apart, the same memory was counted twice); 0 else.
    """

    name: str
    num_nodes: int
    ranks_per_node: int
    device_memory_bytes: float
    device_bandwidth: float
    host_dram_bytes: float
    host_dram_bandwidth: float
    ssd_bytes: float
    ssd_bandwidth: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    compute_flops: float
    collective_latency: float = 20e-6
    lookup_call_seconds: float = 0.0
    seconds_per_id: float = 0.0
    unified_memory: int = 0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "name":
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise TypeError(f"topology {self.name!r}: {f.name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"topology {self.name!r}: {f.name} must be a finite number, got {value}")
            positive = f.name not in ("ssd_bytes", "ssd_bandwidth", "host_dram_bytes", "collective_latency",
                                      "lookup_call_seconds", "seconds_per_id", "unified_memory")
            if value < 0 or (positive and value == 0):
                raise ValueError(f"topology {self.name!r}: {f.name} must be {'> 0' if positive else '>= 0'}, "
                                 f"got {value}")
        if self.unified_memory not in (0, 1):
            raise ValueError(f"topology {self.name!r}: unified_memory must be 0 or 1, got {self.unified_memory}")
        if int(self.num_nodes) != self.num_nodes or int(self.ranks_per_node) != self.ranks_per_node:
            raise ValueError(f"topology {self.name!r}: num_nodes and ranks_per_node must be integers")

    @property
    def world_size(self) -> int:
        return int(self.num_nodes) * int(self.ranks_per_node)

    def node_of(self, rank: int) -> int:
        return rank // int(self.ranks_per_node)

    def with_nodes(self, num_nodes: int) -> "Topology":
        if int(num_nodes) < 1:
            raise ValueError(f"topology {self.name!r}: the number of nodes must be >= 1, got {num_nodes}")
        return dataclasses.replace(self, num_nodes=int(num_nodes))

    def with_world(self, world_size: int, ranks_per_node: Optional[int] = None) -> "Topology":
        """The same machines, ``world_size`` ranks (``ranks_per_node`` per node, default: as many
        as fit in one node of this topology, at most world_size)."""
        per_node = int(ranks_per_node or min(world_size, self.ranks_per_node))
        if world_size < 1 or world_size % per_node:
            raise ValueError(f"topology {self.name!r}: world size {world_size} is not a multiple of "
                             f"{per_node} ranks per node")
        return dataclasses.replace(self, num_nodes=world_size // per_node, ranks_per_node=per_node)

    # ------------------------------------------------------------------------------ JSON
    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "topology") -> "Topology":
        names = [f.name for f in dataclasses.fields(cls)]
        required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
        if not isinstance(data, Mapping):
            raise ValueError(f"{where}: expected an object with keys {names}")
        missing = [k for k in required if k not in data]
        extra = sorted(set(data) - set(names))
        if missing or extra:
            raise ValueError(f"{where}: missing keys {missing}, unknown keys {extra}; allowed: {names}")
        try:
            return cls(**dict(data))
        except (TypeError, ValueError) as exc:  # a value out of range: say which file holds it
            if where == "topology":
                raise
            raise type(exc)(f"{where}: {exc}") from None

    def save(self, path: str | Path) -> None:
        from neorec.files import write_atomic

        write_atomic(Path(path), json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Topology":
        from neorec.files import read_json_file

        return cls.from_dict(read_json_file(path, "topology file"), f"topology file {path}")


# ---------------------------------------------------------------------------------- presets
def zionex(num_nodes: int = 16) -> Topology:
    """Neo's ZionEX: 8 A100-40GB per node, NVLink3, one 200 Gbps RoCE NIC per GPU."""
    return Topology(
        name="zionex", num_nodes=num_nodes, ranks_per_node=8,
        device_memory_bytes=40 * GB,        # A100 40GB SXM datasheet: 40 GB HBM2
        device_bandwidth=1555 * GB,         # A100 40GB datasheet: 1,555 GB/s
        host_dram_bytes=1.5 * TB,           # assumption: 4 sockets x 6 DDR4 channels x 64 GB (not a datasheet)
        host_dram_bandwidth=31.5 * GB,      # PCIe 4.0 x16: 16 GT/s x 16 lanes x 128/130 = 31.5 GB/s
        ssd_bytes=8 * 3.84 * TB,            # 8 x 3.84 TB NVMe (assumption, typical)
        ssd_bandwidth=8 * 3.2 * GB,         # NVMe PCIe 3.0 x4 drive, 3.2 GB/s sequential read (datasheet class)
        intra_node_bandwidth=300 * GB,      # NVLink3: 600 GB/s bidirectional per GPU
        inter_node_bandwidth=25 * GB,       # 200 Gbps RoCE per GPU = 25 GB/s
        compute_flops=156e12,               # A100 TF32 tensor core dense: 156 TFLOPS
    )


def dgx_h100(num_nodes: int = 1) -> Topology:
    """NVIDIA DGX H100: 8 H100 SXM 80GB per node, NVLink4, one 400 Gbps NDR port per GPU."""
    return Topology(
        name="dgx-h100", num_nodes=num_nodes, ranks_per_node=8,
        device_memory_bytes=80 * GB,        # H100 SXM datasheet: 80 GB HBM3
        device_bandwidth=3350 * GB,         # H100 SXM datasheet: 3.35 TB/s
        host_dram_bytes=2 * TB,             # DGX H100 datasheet: 2 TB system memory
        host_dram_bandwidth=63 * GB,        # PCIe 5.0 x16: 63 GB/s
        ssd_bytes=8 * 3.84 * TB,            # DGX H100 datasheet: 8 x 3.84 TB NVMe U.2
        ssd_bandwidth=8 * 6.5 * GB,         # PCIe 4.0 NVMe U.2 class drive, ~6.5 GB/s read
        intra_node_bandwidth=450 * GB,      # NVLink4: 900 GB/s bidirectional per GPU
        inter_node_bandwidth=50 * GB,       # 400 Gbps NDR InfiniBand per GPU = 50 GB/s
        compute_flops=494.7e12,             # H100 SXM TF32 dense (989 TFLOPS is with sparsity)
    )


def default_calibration_path() -> Path:
    """Where ``neorec plan --calibrate`` stores the measured local-cpu topology:
    ``$NEOREC_CALIBRATION``, else ``$XDG_CACHE_HOME/neorec/topology-local-cpu.json`` (``~/.cache``
    when unset or empty)."""
    env = os.environ.get("NEOREC_CALIBRATION")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "neorec" / "topology-local-cpu.json"


def local_cpu(num_ranks: Optional[int] = None, path: Optional[str | Path] = None) -> Topology:
    """This machine as measured by the calibration (``neorec plan --calibrate``); one node of
    ``num_ranks`` ranks (default: as calibrated)."""
    p = Path(path) if path else default_calibration_path()
    if not p.is_file():
        raise ValueError(f"topology 'local-cpu' is not calibrated yet ({p} does not exist); run "
                         f"`python -m neorec plan --calibrate` first (takes under a minute)")
    topo = dataclasses.replace(Topology.load(p), unified_memory=1)  # (calibrations before the key have none)
    return topo.with_world(num_ranks) if num_ranks else topo


PRESETS = ("zionex", "dgx-h100", "local-cpu")


def get_topology(name: str, num_nodes: Optional[int] = None) -> Topology:
    """A preset by name, or a topology JSON file (a path ending in .json)."""
    if name.endswith(".json"):
        topo = Topology.load(name)
    elif name == "zionex":
        topo = zionex()
    elif name == "dgx-h100":
        topo = dgx_h100()
    elif name == "local-cpu":
        topo = local_cpu()
    else:
        raise ValueError(f"unknown topology {name!r}; allowed: {list(PRESETS)} or a FILE.json")
    return topo.with_nodes(num_nodes) if num_nodes is not None else topo
