"""Small topologies and generated tables for the planner tests."""

from __future__ import annotations

import random
from typing import List

from neorec.embedding.config import TableConfig
from neorec.planner.cost_model import TableSpec
from neorec.planner.topology import Topology

GB = 1e9


def toy_topology(num_nodes: int = 1, ranks_per_node: int = 4, device_gb: float = 1.0, host_gb: float = 0.0,
                 intra: float = 100e9, inter: float = 10e9) -> Topology:
    return Topology("toy", num_nodes, ranks_per_node, device_gb * GB, 1000e9, host_gb * GB, 20e9, 0.0, 0.0,
                    intra, inter, 100e12, 0.0)


def random_tables(seed: int, num_tables: int) -> List[TableSpec]:
    """Power-law sizes and pooling, dims 4-128."""
    rng = random.Random(seed)
    return [TableSpec(f"t{i}", max(8, int(10 ** rng.uniform(2, 6))), rng.choice([4, 8, 16, 32, 64, 128]),
                      round(min(100.0, rng.paretovariate(1.2)), 3)) for i in range(num_tables)]


def table_configs(tables: List[TableSpec]) -> List[TableConfig]:
    return [TableConfig(t.name, t.num_rows, t.dim) for t in tables]
