"""The sharding planner: topology, cost model, enumeration, partitioner, simulator.

    from neorec.planner import PlanSettings, TableSpec, get_topology, plan_tables
    result = plan_tables(tables, get_topology("zionex"), PlanSettings(batch_size=512))
    result.plan           # a neorec.sharding.ShardingPlan

Command line: ``python -m neorec plan --help``.
"""

from neorec.planner.cost_model import PlanSettings, TableSpec
from neorec.planner.enumerate import InfeasiblePlanError
from neorec.planner.planner import PlanResult, plan_tables
from neorec.planner.topology import Topology, get_topology

__all__ = ["InfeasiblePlanError", "PlanResult", "PlanSettings", "TableSpec", "Topology", "get_topology",
           "plan_tables"]
