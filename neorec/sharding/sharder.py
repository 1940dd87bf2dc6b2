"""``shard(model, plan, process_group)``: swap a model's ``EmbeddingBagCollection`` for a sharded one.

    model = build_model(cfg, source, device)              # same seed on every rank
    shard(model, default_plan(tables, world_size), process_group)
    model.sparse_arch                                     # ShardedEmbeddingBagCollection

Every rank's pieces are copied from the unsharded collection's tables, so a sharded model and the
single-process model start equal. Only the weights are copied: shard a freshly built model (a
collection that has taken optimizer steps is refused, its optimizer state would be lost).
"""

from __future__ import annotations

from typing import Dict, Optional

import torch.distributed as dist
from torch import nn

from neorec.embedding.locations import TableLocation
from neorec.embedding.tables import EmbeddingBagCollection
from neorec.sharding.comm import CommStats
from neorec.sharding.plan import ShardingPlan
from neorec.sharding.qcomm import CommConfig
from neorec.sharding.sharded_collection import ShardedEmbeddingBagCollection


def shard_collection(collection: EmbeddingBagCollection, plan: ShardingPlan,
                     process_group: Optional[dist.ProcessGroup],
                     comm_stats: Optional[CommStats] = None,
                     comm: Optional[CommConfig] = None,
                     locations: Optional[Dict[str, TableLocation]] = None) -> ShardedEmbeddingBagCollection:
    """A ``ShardedEmbeddingBagCollection`` with ``collection``'s tables, optimizer, storage and
    weights; ``comm``: codecs of its pooled-embedding exchange (``qcomm.py``); ``locations``: tables
    off the device (each rank's pieces of them go to stores behind caches, initialised from
    ``collection``'s weights)."""
    if not isinstance(collection, EmbeddingBagCollection):
        raise TypeError(f"shard: expected an EmbeddingBagCollection, got {type(collection).__name__}")
    tbe = collection.tbe
    if tbe.step_count > 0:
        raise ValueError(f"shard: the collection has taken {tbe.step_count} optimizer steps; shard a freshly built "
                         f"model (optimizer state is not carried over)")
    sharded = ShardedEmbeddingBagCollection(
        collection.tables, plan, process_group, optimizer=tbe.optimizer, storage=tbe.storage,
        device=tbe.weights.device, comm_stats=comm_stats, comm=comm, locations=locations, init_seed=None,
    )  # every piece is set below
    for table in collection.tables:
        sharded.load_table_weight(table.name, tbe.get_table_weight(table.name))
    return sharded


def shard(model: nn.Module, plan: ShardingPlan, process_group: Optional[dist.ProcessGroup],
          comm_stats: Optional[CommStats] = None, comm: Optional[CommConfig] = None,
          locations: Optional[Dict[str, TableLocation]] = None) -> nn.Module:
    """Replace ``model.sparse_arch`` (an EmbeddingBagCollection) by its sharded version, in place;
    returns ``model``."""
    collection = getattr(model, "sparse_arch", None)
    if collection is None:
        raise ValueError(f"shard: {type(model).__name__} has no attribute 'sparse_arch'")
    model.sparse_arch = shard_collection(collection, plan, process_group, comm_stats, comm, locations)
    return model
