"""Table-spec files for ``neorec plan --tables FILE.json``.

    {"batch_size": 512,                                   # optional (per rank)
     "dense_mflops_per_sample": 5.0, "dense_parameters": 1700000,   # optional, for the simulator
     "tables": [{"name": "user", "num_rows": 1000000, "dim": 64, "pooling": 1.0},
                {"name": "item", "num_rows": 50000, "dim": 64, "pooling": 20,
                 "sharding_types": ["table_wise", "row_wise"], "tiers": ["device"], "precisions": ["fp32"]}]}
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Tuple

from neorec.files import read_json_file
from neorec.planner.cost_model import TableSpec
from neorec.planner.presets import DenseModel, finite_non_negative

TABLE_KEYS = {"name", "num_rows", "dim", "pooling", "sharding_types", "tiers", "precisions"}
FILE_KEYS = {"batch_size", "dense_mflops_per_sample", "dense_parameters", "tables"}


def load_table_specs(path: str | Path) -> Tuple[List[TableSpec], DenseModel, Optional[int]]:
    """(tables, dense model, batch size or None) from a JSON file; ValueError naming the file,
    the table and the key on bad input."""
    p = Path(path)
    data = read_json_file(p, "table-spec file")
    if not isinstance(data, dict) or not isinstance(data.get("tables"), list) or not data["tables"]:
        raise ValueError(f"table-spec file {p}: expected an object with a non-empty 'tables' list")
    extra = sorted(set(data) - FILE_KEYS)
    if extra:
        raise ValueError(f"table-spec file {p}: unknown keys {extra}; allowed: {sorted(FILE_KEYS)}")
    tables = []
    for i, entry in enumerate(data["tables"]):
        where = f"table-spec file {p}, table #{i}"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected an object, got {entry!r}")
        missing = sorted({"name", "num_rows", "dim"} - set(entry))
        unknown = sorted(set(entry) - TABLE_KEYS)
        if missing or unknown:
            raise ValueError(f"{where}: missing keys {missing}, unknown keys {unknown}; allowed: {sorted(TABLE_KEYS)}")
        if not isinstance(entry["name"], str) or not entry["name"].strip():
            raise ValueError(f"{where}: name must be a non-empty string, got {entry['name']!r}")
        lists = [k for k in ("sharding_types", "tiers", "precisions") if k in entry and not isinstance(entry[k], list)]
        if lists:
            raise ValueError(f"{where}: {lists[0]} must be a list of names, got {entry[lists[0]]!r}")
        try:
            tables.append(TableSpec(
                entry["name"], entry["num_rows"], entry["dim"], entry.get("pooling", 1.0),
                *(tuple(entry[k]) if k in entry else None for k in ("sharding_types", "tiers", "precisions"))))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{where}: {exc}") from None
    batch = data.get("batch_size")
    if batch is not None and (not isinstance(batch, int) or isinstance(batch, bool) or batch < 1):
        raise ValueError(f"table-spec file {p}: batch_size must be a positive integer, got {batch!r}")
    for key in ("dense_mflops_per_sample", "dense_parameters"):
        value = data.get(key, 0)
        if not finite_non_negative(value):
            raise ValueError(f"table-spec file {p}: {key} must be a finite number >= 0, got {value!r}")
    dense = DenseModel(float(data.get("dense_mflops_per_sample", 0.0)), int(data.get("dense_parameters", 0)))
    return tables, dense, batch
