"""Where an embedding table's rows live: plain data that configs and planners produce.

Locations:
    device       all rows in the fused module on the training device (the default).
    dram         rows in host memory. On a GPU run the table is looked up and updated on the host
                 by a second fused module whose pooled output is copied to the GPU; on a CPU run
                 host memory IS the device, so it is the same as "device".
    cached_dram  rows in a host-memory row store; a set-associative fp32 cache of ``cache_rows``
                 slots in the fused module on the device.
    cached_ssd   the same over an SSD file (``path``, read with pread): tables larger than memory.

    [embedding.location]            # TOML, read into LocationConfig
    default = "cached_ssd"          # location of every table ...
    min_rows = 100000               # ... with at least this many rows (others stay on device)
    tables = { t_small = "device" } # per-table exceptions
    cache_fraction = 0.1            # slots per cached table, as a fraction of its rows
    policy = "lru"                  # or "lfu"
    precision = "fp16"              # rows in the store: fp32, fp16, bf16 or int8
    ssd_dir = "runs/ssd"            # "" = <train.output_dir>/embedding_ssd
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from neorec.embedding.cache import POLICIES
from neorec.embedding.config import TableConfig
from neorec.embedding.storage import ROW_PRECISIONS

LOCATIONS = ("device", "dram", "cached_dram", "cached_ssd")
CACHED_LOCATIONS = ("cached_dram", "cached_ssd")


def _check_common(key: Callable[[str], str], kind: str, cache_rows: int, cache_fraction: float, ways: int,
                  policy: str, precision: str, resident_budget_mb: int) -> None:
    """The checks a table's location and the config section share; ``key(name)`` names the key
    (``embedding.location.ways``), ``key("kind")`` the location itself."""
    if kind not in LOCATIONS:
        raise ValueError(f"{key('kind')} must be one of {LOCATIONS}, got {kind!r}")
    if cache_rows < 0:
        raise ValueError(f"{key('cache_rows')} must be >= 0 (0 = use cache_fraction), got {cache_rows}")
    if not 0.0 < cache_fraction <= 1.0:
        raise ValueError(f"{key('cache_fraction')} must be in (0, 1], got {cache_fraction}")
    if ways <= 0:
        raise ValueError(f"{key('ways')} must be > 0, got {ways}")
    if policy not in POLICIES:
        raise ValueError(f"{key('policy')} must be one of {POLICIES}, got {policy!r}")
    if precision not in ROW_PRECISIONS:
        raise ValueError(f"{key('precision')} must be one of {ROW_PRECISIONS}, got {precision!r}")
    if resident_budget_mb <= 0:
        raise ValueError(f"{key('resident_budget_mb')} must be > 0, got {resident_budget_mb}")


PREFETCH_NEEDS_PIPELINE = ("embedding.location.prefetch = true in a sharded run needs train.pipeline = true: a rank "
                           "learns which rows of its pieces the next batch needs from the pipeline's look-ahead id "
                           "exchange; drop --no-pipeline (or train.pipeline=false), or set "
                           "embedding.location.prefetch = false")


@dataclass
class TableLocation:
    """Where one table lives and, for cached tables, how its cache and store are built.

    kind: one of ``LOCATIONS``.
    cache_rows: cache slots (rounded up to a multiple of ``ways``); 0 = ``cache_fraction`` of the
        table's rows.
    ways: slots per set (fewer when the cache is smaller than one set).
    policy: "lru" or "lfu" (LFU keeps per-row access counts in the store).
    precision: row precision in the store ("fp32", "fp16", "bf16", "int8"); the cache is fp32.
    stochastic_rounding, seed: rounding of low-precision write-backs (each table's store seeds
        its generator from ``seed`` and the table's name).
    path: cached_ssd only: the store directory.
    open_existing: cached_ssd only: reopen the store at ``path`` (rows and optimizer state come
        from it) instead of creating and initialising it.
    overwrite: cached_ssd only: replace an existing store at ``path`` when creating.
    background_prefetch: move prefetched rows in a worker thread.
    resident_budget_mb: cached_ssd only: while a store is initialised through its mapping, its pages
        are released after about this much is written (rows are read and written with pread/pwrite).
    """

    kind: str = "device"
    cache_rows: int = 0
    cache_fraction: float = 0.1
    ways: int = 32
    policy: str = "lru"
    precision: str = "fp32"
    stochastic_rounding: bool = True
    seed: int = 0
    path: str = ""
    open_existing: bool = False
    overwrite: bool = False
    background_prefetch: bool = True
    resident_budget_mb: int = 256

    def __post_init__(self) -> None:
        _check_common(lambda name: f"table location: {'location' if name == 'kind' else name}", self.kind,
                      self.cache_rows, self.cache_fraction, self.ways, self.policy, self.precision,
                      self.resident_budget_mb)
        if self.kind == "cached_ssd" and not self.path:
            raise ValueError("table location 'cached_ssd' needs a path (the directory of its SSD row store)")

    @property
    def cached(self) -> bool:
        return self.kind in CACHED_LOCATIONS

    def cache_shape(self, num_rows: int) -> Tuple[int, int]:
        """(num_slots, ways) of the cache of a table with ``num_rows`` rows (``cache_shape``)."""
        return cache_shape(num_rows, self.cache_rows, self.cache_fraction, self.ways)


def cache_shape(num_rows: int, cache_rows: int, cache_fraction: float, ways: int) -> Tuple[int, int]:
    """(num_slots, ways) of the cache of a table with ``num_rows`` rows: ``cache_rows``, else the
    ``cache_fraction`` of the rows rounded up; at least one slot, at most the table, rounded up to
    whole sets of ``ways`` (the planner counts a cached tier's device memory with it)."""
    wanted = cache_rows or math.ceil(cache_fraction * num_rows)
    wanted = max(1, min(wanted, num_rows))
    ways = min(ways, wanted)
    return math.ceil(wanted / ways) * ways, ways


@dataclass
class LocationConfig:
    """The ``[embedding.location]`` config section: table locations for a whole model.

    default: location of every table with at least ``min_rows`` rows (smaller ones stay on the
        device); ``tables`` maps table names to a location and overrides both.
    min_rows: tables with fewer rows stay on the device whatever ``default`` says.
    tables: {table name: location} for the tables that go elsewhere than ``default`` says.
    cache_fraction: cache slots per cached table as a fraction of its rows (when cache_rows is 0).
    The cache and store options are those of ``TableLocation`` and apply to every cached table.
    ssd_dir: directory of the SSD stores (one sub-directory per table; per piece ``<table>@<index>``
        in a sharded run); "" = the trainer's ``<train.output_dir>/embedding_ssd``. Existing stores
        there are replaced.
    prefetch: the trainer names the next batch to the cached collection before each step, so its
        rows load during the step (in a worker thread with ``background_prefetch``); a sharded
        rank names it after each step's backward, from the pipeline's look-ahead exchange (so it
        needs ``train.pipeline``). Off by default: on a CPU run it did not pay for itself
        (benchmarks/RESULTS.md, "Embedding cache").
    """

    default: str = "device"
    tables: Dict[str, str] = field(default_factory=dict)
    min_rows: int = 0
    cache_rows: int = 0
    cache_fraction: float = 0.1
    ways: int = 32
    policy: str = "lru"
    precision: str = "fp32"
    stochastic_rounding: bool = True
    seed: int = 0
    ssd_dir: str = ""
    prefetch: bool = False
    background_prefetch: bool = True
    resident_budget_mb: int = 256

    def __post_init__(self) -> None:
        where = "embedding.location"
        _check_common(lambda name: f"{where}.{'default' if name == 'kind' else name}", self.default,
                      self.cache_rows, self.cache_fraction, self.ways, self.policy, self.precision,
                      self.resident_budget_mb)
        if not isinstance(self.tables, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                        for k, v in self.tables.items()):
            raise ValueError(f"{where}.tables must map table names to locations, e.g. "
                             f"{{ t_user = \"cached_ssd\" }}; got {self.tables!r}")
        for name, kind in self.tables.items():
            if kind not in LOCATIONS:
                raise ValueError(f"{where}.tables.{name}: location must be one of {LOCATIONS}, got {kind!r}")
        if self.min_rows < 0:
            raise ValueError(f"{where}.min_rows must be >= 0, got {self.min_rows}")

    def known_kind(self, name: str) -> Optional[str]:
        """Where the table ``name`` goes as far as the config alone says: its entry in ``tables``,
        else ``default`` when ``min_rows`` is 0; None when that depends on the table's rows."""
        if name in self.tables:
            return self.tables[name]
        return self.default if self.min_rows == 0 else None

    def kind_of(self, table: TableConfig) -> str:
        """Where ``table`` goes: its entry in ``tables``, else ``default`` when it has at least
        ``min_rows`` rows, else the device."""
        kind = self.known_kind(table.name)
        if kind is None:
            kind = self.default if table.num_embeddings >= self.min_rows else "device"
        return kind

    def any_off_device(self, tables: Sequence[TableConfig]) -> bool:
        """Whether any of ``tables`` goes elsewhere than the device (``min_rows`` may keep every
        table of a model on the device whatever ``default`` says)."""
        return any(self.kind_of(table) != "device" for table in tables)

    def check_table_names(self, names: Sequence[str]) -> None:
        """Every table this config names (``self.tables``) is one of ``names``; else ValueError."""
        unknown = sorted(set(self.tables) - set(names))
        if unknown:
            raise ValueError(f"embedding.location.tables names {unknown}, which are not tables of this model; "
                             f"tables are {list(names)}")

    def resolve(self, tables: Sequence[TableConfig], ssd_dir: Optional[str] = None) -> Dict[str, TableLocation]:
        """{table name: TableLocation} for ``tables``; ``ssd_dir`` is used when ``self.ssd_dir``
        is empty. Unknown names in ``tables`` are an error."""
        self.check_table_names([t.name for t in tables])
        directory = Path(self.ssd_dir or ssd_dir or "embedding_ssd")
        out: Dict[str, TableLocation] = {}
        for table in tables:
            kind = self.kind_of(table)
            out[table.name] = TableLocation(
                kind=kind, cache_rows=self.cache_rows, cache_fraction=self.cache_fraction, ways=self.ways,
                policy=self.policy, precision=self.precision, stochastic_rounding=self.stochastic_rounding,
                seed=self.seed, path=str(directory / table.name) if kind == "cached_ssd" else "",
                overwrite=True, background_prefetch=self.background_prefetch,
                resident_budget_mb=self.resident_budget_mb)
        return out


def off_device_tables(locations: Dict[str, TableLocation]) -> List[str]:
    return [name for name, location in locations.items() if location.kind != "device"]
