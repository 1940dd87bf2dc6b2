"""``ShardingPlan``: where every piece of every embedding table lives, as plain data (JSON).

    plan = ShardingPlan({
        "t_user": TablePlan(ShardingType.TABLE_WISE, [Shard(rank=1, row_start=0, row_end=1000,
                                                              col_start=0, col_end=16)]),
        "t_item": TablePlan(ShardingType.ROW_WISE, [Shard(0, 0, 2500, 0, 16), Shard(1, 2500, 5000, 0, 16)]),
        "t_age": TablePlan(ShardingType.DATA_PARALLEL, []),
    }, world_size=2)
    plan.validate(tables, world_size=2)        # ValueError naming the table and the problem
    ShardingPlan.from_json(plan.to_json()) == plan

A shard is a block [row_start, row_end) x [col_start, col_end) of one table, held by one rank.
What a sharding type allows:

- TABLE_WISE: one shard, the whole table.
- ROW_WISE: full-width shards whose row ranges tile the rows (no gap, no overlap).
- COLUMN_WISE: full-height shards whose column ranges tile the columns.
- TABLE_ROW_WISE / TABLE_COLUMN_WISE: ROW_WISE / COLUMN_WISE with every shard on one node
  (node of a rank = rank // ranks_per_node).
- DATA_PARALLEL: a replica on every rank: no shards listed (or one full shard per rank).

``precision`` (optional, per table) is kept for the planner; a sharded collection today stores all
tables of a rank in one fused module and so one precision (see ``sharded_collection.py``), except
tables on a cached tier, whose precision is their stores' (``plan_locations``, ``neorec/train/build.py``).
``tier`` (optional, per table, default "device") is the planner's storage tier ("device",
"cached_dram", "dram", "cached_ssd"), the location kinds of ``neorec/embedding/locations.py``:
sharded training places a table with another tier than "device" there (the trainer takes the
cache and store settings from ``[embedding.location]``); data-parallel tables stay on the device
(``check_replicas_on_device``). ``validate`` refuses the tiers the caller cannot place (``tiers=``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

from neorec.embedding.config import TableConfig
from neorec.planner.names import TIERS

DEVICE_TIER = "device"
CACHED_TIERS = ("cached_dram", "cached_ssd")  # a table's plan precision is its store's there


def _element_bytes(precision: str) -> int:
    """Bytes of one stored value at ``precision`` (a name no fused module stores: 4)."""
    from neorec.embedding.precision import STORAGE_DTYPES

    dtype = STORAGE_DTYPES.get(precision)
    return dtype.itemsize if dtype is not None else 4


class ShardingType(str, Enum):
    TABLE_WISE = "table_wise"
    ROW_WISE = "row_wise"
    COLUMN_WISE = "column_wise"
    DATA_PARALLEL = "data_parallel"
    TABLE_ROW_WISE = "table_row_wise"
    TABLE_COLUMN_WISE = "table_column_wise"

    @classmethod
    def parse(cls, value: Any, where: str = "") -> "ShardingType":
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            allowed = [t.value for t in cls]
            raise ValueError(f"sharding plan{where}: unknown sharding type {value!r}; allowed: {allowed}") from None

    @property
    def splits_rows(self) -> bool:
        """Shards hold row ranges whose pooled partial sums add up (RW, TWRW)."""
        return self in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE)

    @property
    def splits_columns(self) -> bool:
        return self in (ShardingType.COLUMN_WISE, ShardingType.TABLE_COLUMN_WISE)


@dataclass(frozen=True)
class Shard:
    """Rows [row_start, row_end) and columns [col_start, col_end) of a table, held by ``rank``."""

    rank: int
    row_start: int
    row_end: int
    col_start: int
    col_end: int

    @property
    def num_rows(self) -> int:
        return self.row_end - self.row_start

    @property
    def num_cols(self) -> int:
        return self.col_end - self.col_start

    def to_dict(self) -> Dict[str, int]:
        return {"rank": self.rank, "row_start": self.row_start, "row_end": self.row_end,
                "col_start": self.col_start, "col_end": self.col_end}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "") -> "Shard":
        keys = ("rank", "row_start", "row_end", "col_start", "col_end")
        if not isinstance(data, Mapping) or set(data) != set(keys):
            raise ValueError(f"sharding plan{where}: a shard must be an object with exactly the keys {list(keys)}, "
                             f"got {data!r}")
        bad = [k for k in keys if not isinstance(data[k], int) or isinstance(data[k], bool)]
        if bad:
            raise ValueError(f"sharding plan{where}: shard fields {bad} must be integers, got {dict(data)}")
        return cls(**{k: int(data[k]) for k in keys})


@dataclass
class TablePlan:
    """How one table is sharded: its type, its shards (empty for DATA_PARALLEL), an optional
    storage precision ("fp32", "fp16", "bf16"; on a cached tier its store's, "int8" too; None = the
    collection's) and the storage tier the planner chose (written to JSON only when it is not
    "device")."""

    sharding_type: ShardingType
    shards: List[Shard] = field(default_factory=list)
    precision: Optional[str] = None
    tier: str = DEVICE_TIER

    def __post_init__(self) -> None:
        self.sharding_type = ShardingType.parse(self.sharding_type)
        self.shards = list(self.shards)

    def ranks(self, world_size: int) -> List[int]:
        """Ranks holding a piece (every rank for DATA_PARALLEL)."""
        if self.sharding_type == ShardingType.DATA_PARALLEL:
            return list(range(world_size))
        return sorted({s.rank for s in self.shards})

    def to_dict(self) -> Dict[str, Any]:
        out = {"sharding_type": self.sharding_type.value, "shards": [s.to_dict() for s in self.shards],
               "precision": self.precision}
        if self.tier != DEVICE_TIER:
            out["tier"] = self.tier
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "") -> "TablePlan":
        if not isinstance(data, Mapping) or "sharding_type" not in data:
            raise ValueError(f"sharding plan{where}: a table entry must be an object with 'sharding_type', got {data!r}")
        extra = set(data) - {"sharding_type", "shards", "precision", "tier"}
        if extra:
            raise ValueError(f"sharding plan{where}: unknown keys {sorted(extra)}; allowed: sharding_type, shards, "
                             f"precision, tier")
        shards = data.get("shards", [])
        if not isinstance(shards, list):
            raise ValueError(f"sharding plan{where}: 'shards' must be a list, got {shards!r}")
        tier = data.get("tier", DEVICE_TIER)
        if tier not in TIERS:
            raise ValueError(f"sharding plan{where}: tier must be one of {list(TIERS)}, got {tier!r}")
        return cls(ShardingType.parse(data["sharding_type"], where), [Shard.from_dict(s, where) for s in shards],
                   data.get("precision"), tier)


@dataclass
class ShardingPlan:
    """Per-table plans for a world of ``world_size`` ranks, ``ranks_per_node`` per node (default:
    all ranks on one node)."""

    tables: Dict[str, TablePlan]
    world_size: int
    ranks_per_node: Optional[int] = None

    def __post_init__(self) -> None:
        self.tables = dict(self.tables)
        if self.ranks_per_node is None:
            self.ranks_per_node = self.world_size

    def node_of(self, rank: int) -> int:
        return rank // int(self.ranks_per_node)

    # ------------------------------------------------------------------------------ JSON
    def to_dict(self) -> Dict[str, Any]:
        return {"world_size": self.world_size, "ranks_per_node": self.ranks_per_node,
                "tables": {name: plan.to_dict() for name, plan in self.tables.items()}}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ShardingPlan":
        if not isinstance(data, Mapping) or "tables" not in data or "world_size" not in data:
            raise ValueError("sharding plan: expected an object with 'world_size' and 'tables' (and optionally "
                             "'ranks_per_node')")
        extra = set(data) - {"world_size", "ranks_per_node", "tables"}
        if extra:
            raise ValueError(f"sharding plan: unknown keys {sorted(extra)}; allowed: world_size, ranks_per_node, tables")
        for key in ("world_size", "ranks_per_node"):
            value = data.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"sharding plan: {key} must be an integer, got {value!r}")
        if not isinstance(data["tables"], Mapping):
            raise ValueError("sharding plan: 'tables' must map table names to table plans")
        tables = {str(name): TablePlan.from_dict(entry, f" (table {name!r})") for name, entry in data["tables"].items()}
        return cls(tables, int(data["world_size"]), data.get("ranks_per_node"))

    @classmethod
    def from_json(cls, text: str) -> "ShardingPlan":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"sharding plan: not valid JSON: {exc}") from None
        except RecursionError:
            raise ValueError("sharding plan: not a plan (JSON nested too deeply)") from None
        return cls.from_dict(data)

    def save(self, path: str | Path) -> None:
        """Write the JSON atomically (temp file, fsync, rename)."""
        from neorec.files import write_atomic

        write_atomic(Path(path), self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "ShardingPlan":
        p = Path(path)
        if p.is_dir():
            raise ValueError(f"sharding plan file {str(p)!r} is a directory; give the plan's JSON file")
        if not p.is_file():
            raise ValueError(f"sharding plan file {str(p)!r} not found")
        try:
            return cls.from_json(p.read_text())
        except ValueError as exc:
            raise ValueError(f"{exc} (in {p})") from None

    # ------------------------------------------------------------------------------ validation
    def validate(self, tables: Sequence[TableConfig], world_size: Optional[int] = None,
                 tiers: Sequence[str] = TIERS) -> "ShardingPlan":
        """Check the plan against ``tables`` and the world; raise ValueError naming the table and
        the problem. ``tiers``: the storage tiers the caller can place tables on (sharded
        training: all of them). Returns self."""
        from neorec.sharding.validation import validate_plan

        validate_plan(self, tables, self.world_size if world_size is None else world_size)
        return self.check_tiers(tiers)

    def check_tiers(self, tiers: Sequence[str] = (DEVICE_TIER,)) -> "ShardingPlan":
        """Every table on one of ``tiers``. Returns self."""
        elsewhere = [f"{name!r} ({entry.tier})" for name, entry in self.tables.items() if entry.tier not in tiers]
        if elsewhere:
            more = f" and {len(elsewhere) - 5} more" if len(elsewhere) > 5 else ""
            raise ValueError(f"sharding plan: tables {', '.join(elsewhere[:5])}{more} are planned on a storage tier "
                             f"other than {list(tiers)}, which this use cannot place: make the plan with "
                             f"`neorec plan --tiers {','.join(tiers)}`")
        return self

    def check_replicas_on_device(self) -> "ShardingPlan":
        """No data-parallel table is planned off the device (each rank would hold a whole replica in
        a store of its own). Returns self."""
        off = [f"{name!r} ({entry.tier})" for name, entry in self.tables.items()
               if entry.sharding_type == ShardingType.DATA_PARALLEL and entry.tier != DEVICE_TIER]
        if off:
            raise ValueError(f"sharding plan: data-parallel tables {', '.join(off)} are planned off the device; every "
                             f"rank would hold a whole replica in a store of its own: plan them on the device or "
                             f"shard them another way")
        return self

    def tiers_off_device(self) -> Dict[str, str]:
        """{table: tier} of the tables planned elsewhere than on the device."""
        return {name: entry.tier for name, entry in self.tables.items() if entry.tier != DEVICE_TIER}

    def device_precisions(self) -> Dict[str, List[str]]:
        """{precision: tables} of the tables that name one and are not on a cached tier (those
        whose rows sit in a rank's fused module)."""
        out: Dict[str, List[str]] = {}
        for name, entry in self.tables.items():
            if entry.tier not in CACHED_TIERS and entry.precision is not None:
                out.setdefault(entry.precision, []).append(name)
        return out

    def gpu_training_problem(self, kinds: Optional[Mapping[str, str]] = None) -> Optional[str]:
        """Why training refuses this plan on GPUs, or None: a rank whose every piece is in "dram"
        (host memory) and that holds no replica would have a fused module on its GPU with no table
        (each such rank failed after launch). ``kinds``: where each table goes in training (the
        plan's tier, or the config's location where the plan says "device"); default the tiers."""
        if any(e.sharding_type == ShardingType.DATA_PARALLEL for e in self.tables.values()):
            return None  # (every rank holds the replicas on its device)
        tiers: Dict[int, set] = {}
        for name, entry in self.tables.items():
            for shard in entry.shards:
                tiers.setdefault(shard.rank, set()).add(kinds[name] if kinds is not None else entry.tier)
        ranks = sorted(r for r, held in tiers.items() if held == {"dram"})
        if not ranks:
            return None
        shown = ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
        return (f"rank(s) {shown} hold only \"dram\" (host memory) pieces: their GPU would hold no table; "
                "keep a table on each rank's device (neorec plan --tiers device,dram; embedding.location.tables), "
                "or cache the tables (cached_dram)")

    def training_precision_problem(self) -> Optional[str]:
        """Why no ``embedding.storage.precision`` can train this plan (``check_precision``'s
        message for the likeliest one), or None when one can."""
        errors = []
        for precision in ("fp32", "fp16", "bf16"):
            try:
                self.check_precision(precision)
                return None
            except ValueError as exc:
                errors.append(str(exc))
        return errors[0]

    def check_precision(self, precision: str) -> "ShardingPlan":
        """No table asks for another storage precision than ``precision`` (one rank's fused module
        holds one precision), but those planned on a cached tier: their precision is their store's
        (the cache in front is fp32), and then the fused module holds their fp32 cache slots: the
        other tables must be fp32 too. Returns self."""
        mixed = self.device_precisions()
        cached = sorted(name for name, entry in self.tables.items() if entry.tier in CACHED_TIERS)
        low = sorted(kind for kind in mixed if kind != "fp32")
        if cached and (low or precision != "fp32"):  # (no setting could train it: each rank failed after launch)
            named = f"{cached[0]!r}" + (f" and {len(cached) - 1} more" if len(cached) > 1 else "")
            what = (f"its tables off the caches ask for {' and '.join(low)} ({mixed[low[0]][0]!r}"
                    + (f" and {len(mixed[low[0]]) - 1} more" if len(mixed[low[0]]) > 1 else "") + ")") if low \
                else f"embedding.storage.precision is {precision!r}"
            raise ValueError(
                f"sharding plan: {'table' if len(cached) == 1 else 'tables'} {named} {'is' if len(cached) == 1 else 'are'} "
                f"on a cached tier, whose fp32 cache slots sit in the fused module, "
                f"and {what}; one rank's fused module holds one precision, so a plan with cached tiers trains with "
                f"its other tables at fp32 (`neorec plan --precisions fp32`, or drop the tables' precisions from the "
                f"plan, and embedding.storage.precision = 'fp32'); a cached table's store keeps its own precision")
        if len(mixed) > 1:  # (no embedding.storage.precision would do: the old message said to set it)
            examples = ", ".join(f"{kind}: {tables[0]!r}" + (f" and {len(tables) - 1} more" if len(tables) > 1 else "")
                                 for kind, tables in sorted(mixed.items()))
            smallest = min(mixed, key=lambda kind: (_element_bytes(kind), kind))  # (what memory needed)
            raise ValueError(
                f"sharding plan: its tables off the caches ask for {len(mixed)} precisions ({examples}), but "
                f"neorec train stores them all at one (embedding.storage.precision): make the plan with one "
                f"(`neorec plan --precisions {smallest}`, and embedding.storage.precision = '{smallest}'), or drop "
                f"the tables' precisions from the plan")
        for name, entry in self.tables.items():
            if entry.tier in CACHED_TIERS:
                continue
            if entry.precision is not None and entry.precision != precision:
                raise ValueError(
                    f"sharding plan: table {name!r} asks for precision {entry.precision!r} but the embeddings are "
                    f"stored in {precision!r}; one rank's fused module holds one precision (set "
                    f"embedding.storage.precision, or drop the table's precision from the plan)")
        return self
