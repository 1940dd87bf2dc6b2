"""4D-parallel embedding sharding over torch.distributed: plans, collectives, the sharded collection."""

from neorec.sharding.comm import Awaitable, CommStats
from neorec.sharding.plan import Shard, ShardingPlan, ShardingType, TablePlan
from neorec.sharding.planning import column_wise, data_parallel, default_plan, row_wise, table_wise
from neorec.sharding.sharded_collection import ShardedEmbeddingBagCollection
from neorec.sharding.sharder import shard, shard_collection

__all__ = [
    "Awaitable",
    "CommStats",
    "Shard",
    "ShardedEmbeddingBagCollection",
    "ShardingPlan",
    "ShardingType",
    "TablePlan",
    "column_wise",
    "data_parallel",
    "default_plan",
    "row_wise",
    "shard",
    "shard_collection",
    "table_wise",
]
