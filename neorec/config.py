"""Run configuration: dataclasses, TOML loading, ``--set section.key=value`` overrides, validation.

    cfg = load_config("configs/default.toml", overrides=["train.max_steps=100"])

Every TOML table maps to a dataclass below; an unknown key or a value of the wrong type is a
``ValueError`` that names the key and what is allowed.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import math
import os
import re
import shlex
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from neorec.data.config import DataConfig
from neorec.embedding.config import POOLINGS, SparseOptimizerConfig, StorageConfig, TableConfig
from neorec.embedding.locations import CACHED_LOCATIONS, LocationConfig
from neorec.sharding.qcomm import CommConfig
from neorec.train.checkpoint_config import CheckpointConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

INTERACTIONS = ("dot", "dcn")
DENSE_OPTIMIZERS = ("sgd", "adagrad", "adam")
DEVICES = ("cpu", "cuda", "auto")


@dataclass
class ModelConfig:
    """DLRM shape.

    embedding_dim: width of every embedding table (and of the bottom MLP's output for "dot").
    dense_layers: bottom MLP layer sizes over the dense features.
    over_layers: top MLP hidden sizes; a final layer to one logit is added.
    interaction: "dot" (pairwise dot products) or "dcn" (DCN-v2 cross network).
    dcn_num_layers: cross layers of "dcn" (>= 0).
    dcn_low_rank: rank of each cross layer's weight for "dcn" (0 = full rank).
    self_interaction: include each vector's dot product with itself ("dot" only).
    pooling: "sum" or "mean" over each bag of ids.
    """

    embedding_dim: int = 16
    dense_layers: List[int] = field(default_factory=lambda: [64, 16])
    over_layers: List[int] = field(default_factory=lambda: [64, 32])
    interaction: str = "dot"
    dcn_num_layers: int = 2
    dcn_low_rank: int = 0
    self_interaction: bool = False
    pooling: str = "sum"

    def __post_init__(self) -> None:
        if self.interaction not in INTERACTIONS:
            raise ValueError(f"model.interaction must be one of {INTERACTIONS}, got {self.interaction!r}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"model.pooling must be one of {POOLINGS}, got {self.pooling!r}")
        for name in ("dcn_num_layers", "dcn_low_rank"):
            if getattr(self, name) < 0:
                raise ValueError(f"model.{name} must be >= 0, got {getattr(self, name)}")
        if self.self_interaction and self.interaction != "dot":
            raise ValueError(
                f"model.self_interaction applies only to model.interaction = 'dot', got interaction "
                f"{self.interaction!r}; set model.self_interaction = false"
            )
        if self.embedding_dim <= 0:
            raise ValueError(f"model.embedding_dim must be > 0, got {self.embedding_dim}")
        if not self.dense_layers or any(n <= 0 for n in self.dense_layers):
            raise ValueError(f"model.dense_layers must be a non-empty list of positive sizes, got {self.dense_layers}")
        if any(n <= 0 for n in self.over_layers):
            raise ValueError(f"model.over_layers must hold positive sizes, got {self.over_layers}")
        if self.interaction == "dot" and self.dense_layers[-1] != self.embedding_dim:
            raise ValueError(
                f"model.dense_layers must end in model.embedding_dim ({self.embedding_dim}) for the dot "
                f"interaction, got {self.dense_layers}"
            )


@dataclass
class EmbeddingConfig:
    """Sparse side: the optimizer fused into the embedding backward, the weight storage of the
    fused module, and where each table lives ([embedding.location]: device, DRAM, or a cache over
    a DRAM or SSD row store; ``neorec/embedding/locations.py``), and the codecs of the sharded
    pooled-embedding exchange ([embedding.comm]: forward / backward, ``neorec/sharding/qcomm.py``)."""

    optimizer: SparseOptimizerConfig = field(default_factory=SparseOptimizerConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    location: LocationConfig = field(default_factory=LocationConfig)
    comm: CommConfig = field(default_factory=CommConfig)


@dataclass
class DenseOptimizerConfig:
    """Optimizer of the MLPs (torch.optim).

    kind: "sgd", "adagrad" or "adam".
    learning_rate: step size.
    eps: added to the AdaGrad and Adam denominators.
    weight_decay: L2 penalty (torch.optim's weight_decay).
    """

    kind: str = "adagrad"
    learning_rate: float = 0.01
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in DENSE_OPTIMIZERS:
            raise ValueError(f"dense_optimizer.kind must be one of {DENSE_OPTIMIZERS}, got {self.kind!r}")
        if not 0 < self.learning_rate < math.inf:
            raise ValueError(f"dense_optimizer.learning_rate must be finite and > 0, got {self.learning_rate}")
        for name in ("eps", "weight_decay"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"dense_optimizer.{name} must be finite and >= 0, got {getattr(self, name)}")
        if self.kind != "sgd" and self.eps == 0:
            raise ValueError(f"dense_optimizer.eps must be > 0 for {self.kind}: a weight whose gradient is 0 (a "
                             f"unit that never fires) would be updated by 0 / 0 = NaN")


@dataclass
class TrainConfig:
    """The training loop.

    epochs: passes over the training data (0 = no limit: train.max_steps ends the run).
    max_steps: stop at this step, counted from the run's start (a resumed run included; 0 = no limit).
    eval_every_steps: evaluate every N steps (0 = only at the end of each epoch).
    eval_max_batches: cap on eval batches per evaluation (0 = the whole eval set).
    log_every_steps: write a train record to the metrics log every N steps.
    output_dir: where metrics.jsonl and the resolved config are written ("" = neither is written).
    seed: seeds the model init and the dense RNG (the data has its own seed).
    device: "cpu", "cuda" or "auto".
    num_threads: torch intra-op threads (0 = torch's default in one process; in a rank of
        several, OMP_NUM_THREADS when set, else an even share of the usable CPUs per local rank).
    progress: show a progress bar.
    pipeline: overlap the next batch's loading, input all-to-all and cache prefetch with the
        current step (``neorec/train/pipeline.py``; same results bit for bit); false = plain loop.
    profile: time the phases of every step; print the table and write timeline.json.
    reuse_freed_memory: keep freed memory in the process so that each step's buffers do not
        page-fault anew (glibc malloc thresholds, process-wide; ``neorec/train/allocator.py``).
    """

    epochs: int = 1
    max_steps: int = 0
    eval_every_steps: int = 0
    eval_max_batches: int = 0
    log_every_steps: int = 50
    output_dir: str = "runs/latest"
    seed: int = 0
    device: str = "cpu"
    num_threads: int = 0
    progress: bool = True
    pipeline: bool = True
    profile: bool = False
    reuse_freed_memory: bool = True

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"train.device must be one of {DEVICES}, got {self.device!r}")
        for name in ("epochs", "max_steps", "eval_every_steps", "eval_max_batches", "num_threads"):
            if getattr(self, name) < 0:
                raise ValueError(f"train.{name} must be >= 0, got {getattr(self, name)}")
        if self.epochs == 0 and self.max_steps == 0:
            raise ValueError("train.epochs and train.max_steps are both 0: nothing to train")
        if self.log_every_steps <= 0:
            raise ValueError(f"train.log_every_steps must be > 0, got {self.log_every_steps}")


@dataclass
class Config:
    """The whole run; TOML tables [model], [embedding.optimizer], [embedding.storage],
    [embedding.location] (``neorec/embedding/locations.py``), [embedding.comm]
    (``neorec/sharding/qcomm.py``), [dense_optimizer], [data], [data.synthetic], [data.criteo],
    [data.movielens], [train], [checkpoint] (``neorec/train/checkpoint_config.py``)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    embedding: EmbeddingConfig = field(default_factory=EmbeddingConfig)
    dense_optimizer: DenseOptimizerConfig = field(default_factory=DenseOptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


# --------------------------------------------------------------------------------- building


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is not None:
        return str(tp).replace("typing.", "").replace("List", "list")
    return getattr(tp, "__name__", None) or str(tp)


class _NotToml(str):
    """A ``--set`` value that TOML cannot read, kept as its text: fine for a string key
    (``--set data.source=movielens``), an error naming the TOML error for any other key."""

    toml_error = ""


class _NotAString(ValueError):
    """A non-string value for a string key (``--set train.output_dir=2024-01-01`` is a TOML date)."""

    def __init__(self, message: str, where: str) -> None:
        super().__init__(message)
        self.where = where


def _takes_text(tp: Any) -> bool:
    """Whether a key of type ``tp`` accepts a bare string (str, Optional[str], List[str])."""
    if tp is str:
        return True
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        return any(_takes_text(a) for a in typing.get_args(tp) if a is not type(None))
    if origin in (list, List, Sequence):
        return all(_takes_text(a) for a in typing.get_args(tp) or (str,))
    return False


def _expected(tp: Any, where: str) -> str:
    """What a key of type ``tp`` takes, as the errors below say it."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return f"a table ([{where}])"
    if origin in (list, List, Sequence):
        return f"a list of {_type_name((typing.get_args(tp) or (Any,))[0])}"
    if origin is typing.Union:
        return _expected([a for a in typing.get_args(tp) if a is not type(None)][0], where)
    if origin in (dict, Dict):
        return "a table"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, _type_name(tp))


# keys holding a file or folder: a leading ~ is the home folder (a folder named "~" was made)
PATH_KEYS = frozenset({"output_dir", "dir", "ssd_dir", "train_path", "eval_path", "processed_dir", "path"})


def _convert(value: Any, tp: Any, where: str) -> Any:
    """Check/convert one TOML value against a dataclass field type."""
    if isinstance(value, _NotToml):
        if not _takes_text(tp):
            raise ValueError(f"config key {where!r} must be {_expected(tp, where)}, got {str(value)!r}, which is "
                             f"not valid TOML ({value.toml_error})")
        value = str(value)
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ValueError(f"config key {where!r} is a table ([{where}]), got {value!r}")
        return _build(tp, value, where)
    if origin in (list, List, Sequence):
        (item_tp,) = typing.get_args(tp) or (Any,)
        if not isinstance(value, list):
            if isinstance(value, (int, float, str)) and not isinstance(value, bool):
                value = [value]  # a scalar where a list is expected means a one-element list
            else:
                raise ValueError(f"config key {where!r} must be a list of {_type_name(item_tp)}, got {value!r}")
        return [_convert(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is typing.Union:  # Optional[X]
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _convert(value, args[0], where)
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"config key {where!r} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"config key {where!r} must be an integer, got {value!r}")
        if not -(2**63) <= value < 2**63:  # torch and numpy take 64-bit integers
            raise ValueError(f"config key {where!r} must fit in 64 bits (|value| < 2**63), got {value}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"config key {where!r} must be a number, got {value!r}")
        try:
            return float(value)
        except OverflowError:
            raise ValueError(f"config key {where!r} must be a number within the float range, got an "
                             f"integer of {len(str(abs(value)))} digits") from None
    if tp is str:
        if not isinstance(value, str):
            raise _NotAString(f"config key {where!r} must be a string, got {value!r}", where)
        if where.rsplit(".", 1)[-1] in PATH_KEYS and value.startswith("~"):
            value = os.path.expanduser(value)  # (no shell expands it inside --set key=~/x or TOML)
        return value
    if origin in (dict, Dict) and isinstance(value, dict):  # a table of names, checked by its section
        return {k: str(v) if isinstance(v, _NotToml) else v for k, v in value.items()}
    return value


def _build(cls: type, values: Dict[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        where = f"{prefix}.{key}" if prefix else key
        if key not in names:
            raise ValueError(
                f"unknown config key {where!r}; allowed under {prefix or 'the top level'}: {', '.join(names)}"
                + _did_you_mean(where)
            )
        kwargs[key] = _convert(value, hints[key], where)
    try:
        return cls(**kwargs)
    except ValueError as exc:
        if prefix and not str(exc).startswith(prefix):  # a class also used outside the config: name the section
            raise ValueError(f"{prefix}: {exc}") from None
        raise
    except TypeError as exc:  # pragma: no cover - defensive, _convert checks types first
        raise ValueError(f"config section {prefix or 'top level'}: {exc}") from exc


_ALIASES = {"lr": "learning_rate", "wd": "weight_decay", "dim": "embedding_dim", "batch": "batch_size",
            "steps": "max_steps"}  # names other tools use


def _did_you_mean(where: str) -> str:
    """``"; did you mean 'X'?"`` for an unknown key: the keys of its section with that word in their
    name (``data.criteo.path`` -> ``data.criteo.train_path``), then the keys or sections of that
    name elsewhere (``train.checkpoint`` -> ``checkpoint``), else the closest spelling
    (``train.max_step``)."""
    keys = [key for key, _, _ in iter_config_keys()]
    known = sorted(set(keys) | {".".join(k.split(".")[:i]) for k in keys for i in range(1, k.count(".") + 1)})
    name = where.rsplit(".", 1)[-1]
    known = [k for k in known if not where.startswith(k + ".")]  # not its own sections
    section = where[: -len(name)]
    siblings = [k[len(section):] for k in known if k.startswith(section) and "." not in k[len(section):]]
    alias = _ALIASES.get(name)
    with_word = [sibling for sibling in siblings if name in sibling.split("_") or sibling == alias]
    closest = sorted(with_word, key=lambda sibling: -difflib.SequenceMatcher(None, name, sibling).ratio())
    guesses = [section + sibling for sibling in closest[:3]]
    guesses += [k for k in known if k.rsplit(".", 1)[-1] == name]
    if not guesses:  # a misspelt name in the same section
        guesses = [section + close for close in difflib.get_close_matches(name, siblings, 2, 0.8)]
    return f"; did you mean {' or '.join(repr(g) for g in guesses)}?" if guesses else ""


def parse_override(text: str) -> Tuple[List[str], Any]:
    """``"train.max_steps=100"`` -> (["train", "max_steps"], 100). The value is read as TOML
    (numbers, booleans, quoted strings, [lists], {tables}); anything TOML can't read is taken as
    a string, which a key that is not a string refuses with the TOML error."""
    if "=" not in text:
        raise ValueError(f"--set expects section.key=value, got {text!r}")
    key, raw = text.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise ValueError(f"--set expects section.key=value, got {text!r}")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError as exc:
        value = _NotToml(raw.strip())
        value.toml_error = _value_toml_error(str(exc))
    return path, value


def _value_toml_error(message: str) -> str:
    """tomllib's message about ``v = VALUE``, its position counted in VALUE."""
    match = re.search(r" \(at line 1, column (\d+)\)$", message)
    if match:
        column = max(1, int(match.group(1)) - len("v = "))
        return f"{message[:match.start()]} at character {column}"
    return message.replace("(at end of document)", "at its end")


def _apply_override(tree: Dict[str, Any], path: List[str], value: Any) -> None:
    for depth in range(1, len(path)):  # train.max_steps.x: max_steps holds a value, it has no keys
        if not _is_section(path[:depth]) and not _holds_table(path[:depth]):
            raise ValueError(f"--set {'.'.join(path)}: {'.'.join(path[:depth])!r} is a value, not a section")
    node = tree
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"--set {'.'.join(path)}: {part!r} is a value, not a section")
        node = child
    if isinstance(value, dict) and isinstance(node.get(path[-1]), dict) and _is_section(path):
        _merge(node[path[-1]], value, path)  # --set train={max_steps=5}: the section's other keys stay
    else:  # a value, or a key that holds a table (embedding.location.tables={}): replaced
        node[path[-1]] = value


_UNKNOWN = object()


def _type_at(path: List[str]) -> Any:
    """The type of the config key or section ``path`` names; ``_UNKNOWN`` for a name the config
    does not have (``_build`` refuses it, with a suggestion)."""
    tp: Any = Config
    for part in path:
        hints = typing.get_type_hints(tp) if dataclasses.is_dataclass(tp) else {}
        if part not in hints:
            return _UNKNOWN
        tp = hints[part]
    return tp


def _holds_table(path: List[str]) -> bool:
    """Whether ``path`` names a key whose value is a table (``embedding.location.tables``)."""
    return typing.get_origin(_type_at(path)) in (dict, Dict)


def _is_section(path: List[str]) -> bool:
    """Whether ``path`` names a config section (a dataclass; an unknown name is taken as one, to be
    refused by ``_build``), not a key such as ``embedding.location.tables``, whose value is a table."""
    tp = _type_at(path)
    return tp is _UNKNOWN or dataclasses.is_dataclass(tp)


def _merge(into: Dict[str, Any], values: Dict[str, Any], path: List[str]) -> None:
    """Deep-merge ``values`` into the section ``path`` (``into``): sections key by key, any other
    value replaced, a key that holds a table (``embedding.location.tables``) included."""
    for key, value in values.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict) and _is_section([*path, key]):
            _merge(into[key], value, [*path, key])
        else:
            into[key] = value


def config_from_dict(values: Dict[str, Any], overrides: Sequence[str] = (), check_data: bool = False) -> Config:
    """The config of ``values`` (TOML tables) with ``overrides`` applied; ``check_data``: also
    check the data keys that must agree (see ``check_data_keys``)."""
    tree = copy.deepcopy(values)
    for text in overrides:
        path, value = parse_override(text)
        _apply_override(tree, path, value)
    cfg = _build(Config, tree)
    if check_data:
        check_data_keys(cfg)
    return cfg


def check_data_keys(cfg: Config) -> None:
    """The data source's keys that must agree, which no section can check alone since ``--set``
    may change them one at a time: ``data.synthetic.num_embeddings`` holds one value or
    ``num_tables`` values; a Criteo source has a ``train_path``; ``embedding.location.tables``
    names tables the source makes; cached tables come with fp32 ``embedding.storage``. ``neorec
    train`` and ``neorec config`` check them at load time
    (``load_config(..., check_data=True)``), so that the error names the ``--set`` or the file;
    otherwise the data source and the model check them when they are built."""
    data = cfg.data
    if data.source == "synthetic":
        data.synthetic.table_sizes()  # num_embeddings: one value or num_tables values
    elif data.source == "criteo" and not data.criteo.train_path:
        raise ValueError("data.source is 'criteo' but data.criteo.train_path is empty: set it to a raw "
                         "Criteo TSV file (e.g. one written by `neorec data write-criteo`)")
    cfg.embedding.location.check_table_names(data.table_names())
    location, precision = cfg.embedding.location, cfg.embedding.storage.precision
    rows = data.known_table_rows()
    kinds = {name: location.known_kind(name) if name not in rows else
             location.kind_of(TableConfig(name, rows[name], 1)) for name in data.table_names()}
    cached = sorted(name for name, kind in kinds.items() if kind in CACHED_LOCATIONS)
    if precision != "fp32" and cached:  # (every cached table named where the source's sizes are known)
        what = f"tables {cached}" if None not in kinds.values() or set(cached) <= set(location.tables) else \
            f"embedding.location.default = {location.default!r}"
        raise ValueError(f"embedding.storage.precision = {precision!r} with cached tables ({what}): the cache "
                         f"slots live in the fused module, whose rows must then be fp32; set the stored rows' "
                         f"precision with embedding.location.precision (fp16/bf16/int8) instead")


def load_config(path: Optional[str | Path] = None, overrides: Sequence[str] = (), check_data: bool = False) -> Config:
    """Defaults, then the config file (if any), then ``--set`` overrides, in that order. The file
    is TOML, or JSON when its name ends in ``.json`` (a run folder's ``config.json``: the run's
    whole config). ``check_data``: also check the data keys that must agree (``check_data_keys``)."""
    values: Dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if p.is_dir():
            raise ValueError(f"config file {str(p)!r} is a directory; give a .toml file (e.g. configs/tiny.toml)")
        if not p.is_file():
            raise ValueError(f"config file {str(p)!r} not found")
        try:  # (a byte-order mark, as some Windows editors write, is not TOML's: dropped)
            text = p.read_bytes().decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise ValueError(f"config file {str(p)!r} is not UTF-8 text: {exc}") from None
        if p.suffix.lower() == ".json":
            try:
                values = json.loads(text)
            except ValueError as exc:
                raise ValueError(f"config file {str(p)!r} is not valid JSON: {exc}") from None
            if not isinstance(values, dict):
                raise ValueError(f"config file {str(p)!r}: expected a JSON object of sections, got "
                                 f"{type(values).__name__}")
            if {"world_size", "tables"} <= set(values):  # (its first key was said unknown)
                raise ValueError(f"config file {str(p)!r} is a sharding plan (from `neorec plan --out`), not a "
                                 f"config: give it as --plan {shlex.quote(str(p))}")
        else:
            try:
                values = tomllib.loads(text)
            except tomllib.TOMLDecodeError as exc:
                raise ValueError(f"config file {str(p)!r} is not valid TOML: {exc}") from exc
    try:
        return config_from_dict(values, overrides, check_data)
    except ValueError as exc:
        blame = _blame(values, overrides, path, check_data, str(exc))
        raise ValueError(f"{exc}{blame}{_quote_hint(exc, overrides)}") from None


def _quote_hint(exc: ValueError, overrides: Sequence[str]) -> str:
    """For a string key that a ``--set`` gave a number, date or boolean: how to quote it."""
    if not isinstance(exc, _NotAString):
        return ""
    for text in reversed(overrides):  # the last --set of a key is the one that counts
        key, _, raw = text.partition("=")
        if ".".join(p for p in key.strip().split(".") if p) == exc.where:
            quoted = shlex.quote(toml_string(raw.strip()))
            return f"; to give it as a string, quote it: --set {exc.where}={quoted}"
    return ""


def toml_string(text: str) -> str:
    """``text`` as a TOML basic string: what ``--set key=...`` reads as that string, whatever it holds."""
    escaped = []
    for char in text:
        if char in '"\\':
            escaped.append("\\" + char)
        elif ord(char) < 0x20 or ord(char) == 0x7F:  # control characters, newline and tab included
            escaped.append(f"\\u{ord(char):04X}")
        else:
            escaped.append(char)
    return '"' + "".join(escaped) + '"'


def _blame(values: Dict[str, Any], overrides: Sequence[str], path: Optional[str | Path],
           check_data: bool = False, message: Optional[str] = None) -> str:
    """Where the config error ``message`` comes from: the file, when the file alone fails with it;
    with a valid file, the ``--set`` overrides that fail on their own; with a file that fails
    otherwise, the ``--set`` of the key the message names (such an error was blamed on the file)."""

    def error(chosen: Sequence[str]) -> Optional[str]:
        try:
            config_from_dict(values, chosen, check_data)
        except ValueError as exc:
            return str(exc)
        return None

    of_file = error(())
    if overrides and of_file is None:
        culprits = [text for text in overrides if error([text]) is not None]
    elif overrides and message is not None and of_file != message:  # the file fails otherwise: the --set of
        culprits = [text for text in overrides if _names_key(message, text)]  # the key the message names
    else:
        return f" (in {path})" if path else ""
    return " (from " + (", ".join(f"--set {text}" for text in culprits) or "the --set overrides together") + ")"


def _names_key(message: str, override: str) -> bool:
    """Whether ``message`` names the key that ``override`` ("section.key=value") sets."""
    key = ".".join(part for part in override.partition("=")[0].strip().split(".") if part)
    return bool(key) and re.search(rf"(?<![\w.]){re.escape(key)}(?!\w)", message) is not None


def iter_config_keys(cls: type = Config, prefix: str = "") -> Iterator[Tuple[str, str, Any]]:
    """Every leaf key with its type and default, for ``--help``."""
    instance = cls()
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        value = getattr(instance, f.name)
        if dataclasses.is_dataclass(value):
            yield from iter_config_keys(type(value), key)
        else:
            yield key, _type_name(typing.get_type_hints(cls)[f.name]), value
