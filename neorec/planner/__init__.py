"""The sharding planner: topology, cost model, enumeration, partitioner, simulator.

    from neorec.planner import PlanSettings, TableSpec, get_topology, plan_tables
    result = plan_tables(tables, get_topology("zionex"), PlanSettings(batch_size=512))
    result.plan           # a neorec.sharding.ShardingPlan

Command line: ``python -m neorec plan --help``. Names are imported lazily (the command-line
parser imports ``neorec.planner.cli`` without loading torch).
"""

from importlib import import_module

_EXPORTS = {
    "InfeasiblePlanError": "neorec.planner.enumerate", "PlanResult": "neorec.planner.planner",
    "PlanSettings": "neorec.planner.cost_model", "TableSpec": "neorec.planner.cost_model",
    "Topology": "neorec.planner.topology", "get_topology": "neorec.planner.topology",
    "plan_tables": "neorec.planner.planner", "evaluate_plan": "neorec.planner.planner",
    "simulate": "neorec.planner.simulate",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'neorec.planner' has no attribute {name!r}")
