"""What ``neorec train --help`` and ``neorec config --help`` say of every config key: its type,
default and description. Descriptions come from the config dataclasses' docstrings, whose lines
``name: text`` (or ``a / b: text``, ``a, b: text``, continued on deeper-indented lines) describe
their fields: one place for the code's readers and the command's users."""

from __future__ import annotations

import dataclasses
import inspect
import re
import textwrap
from typing import Dict

from neorec.config import Config, iter_config_keys
from neorec.embedding.locations import LocationConfig, TableLocation

# sections whose fields are described (also) by another class: the cache and store options of
# [embedding.location] are TableLocation's, applied to every cached table
_DESCRIBED_BY = {LocationConfig: (LocationConfig, TableLocation)}


def _field_docs(cls: type) -> Dict[str, str]:
    """{field of ``cls``: its description} from the docstrings of ``cls`` (and ``_DESCRIBED_BY``)."""
    fields = {f.name for f in dataclasses.fields(cls)}
    docs: Dict[str, str] = {}
    for source in _DESCRIBED_BY.get(cls, (cls,)):
        current: list = []
        for line in inspect.cleandoc(source.__doc__ or "").splitlines():
            head, colon, text = line.partition(": ")
            names = [name.strip() for name in re.split(r"[,/]", head)]
            if colon and not line.startswith(" ") and all(name in fields for name in names):
                current = [name for name in names if name not in docs]  # (the class's own text first)
                for name in current:
                    docs[name] = text.strip()
            elif current and line.startswith(" ") and line.strip():
                for name in current:
                    docs[name] += " " + line.strip()
            else:
                current = []
    return docs


def config_key_docs() -> Dict[str, str]:
    """{dotted config key: its description} for every leaf key (missing ones: "")."""
    docs: Dict[str, str] = {}

    def walk(cls: type, prefix: str) -> None:
        described, instance = _field_docs(cls), cls()
        for f in dataclasses.fields(cls):
            key = f"{prefix}.{f.name}" if prefix else f.name
            if dataclasses.is_dataclass(getattr(instance, f.name)):
                walk(type(getattr(instance, f.name)), key)
            else:
                docs[key] = described.get(f.name, "")

    walk(Config, "")
    return docs


def config_keys_help(width: int = 100) -> str:
    """Every config key with its type and default, and its description below it."""
    keys, docs = list(iter_config_keys()), config_key_docs()
    key_width = max(len(key) for key, _, _ in keys)
    type_width = max(len(type_name) for _, type_name, _ in keys)
    lines = ["config keys (TOML tables / --set section.key=value), with defaults:"]
    for key, type_name, default in keys:
        lines.append(f"  {key:<{key_width}}  {type_name:<{type_width}}  {default!r}")
        lines += textwrap.wrap(docs[key], width, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines)
