"""Argument types and checks shared by the benchmark scripts (they import each other by their bare
names): whole numbers and lists of them, bounded real numbers, and ``check_out`` for ``--out``."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Optional


def at_least(minimum: int):
    """An argparse ``type``: a whole number >= ``minimum`` (a count of 0 steps or rounds gave a
    division by zero or "no median for empty data" after the work had run)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = f"whole number >= {minimum}"  # how argparse names the type in its errors
    return parse


def list_of(minimum: int):
    """An argparse ``type``: comma-separated whole numbers, each >= ``minimum`` (``--worlds 0``
    timed nothing, or failed with a traceback after the parsing)."""
    one = at_least(minimum)

    def parse(text: str):
        return [one(part.strip()) for part in text.split(",")]

    parse.__name__ = f"comma-separated whole numbers >= {minimum}"
    return parse


def number(low: float, high: float = math.inf, *, above: bool = False, finite: bool = True):
    """An argparse ``type``: a real number in [``low``, ``high``] (``above``: greater than ``low``);
    NaN refused, and infinity unless ``finite`` is false (a negative --skews, a --data-limit-gb 0 or
    a --timeout 0 were taken, and failed or gave wrong figures after the work had run)."""
    lower = f"> {low:g}" if above else f">= {low:g}"
    bounds = lower if high == math.inf else f"in {'(' if above else '['}{low:g}, {high:g}]"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if math.isnan(value) or (finite and math.isinf(value)) or value > high or value < low \
                or (above and value == low):
            raise argparse.ArgumentTypeError(f"must be {'a finite number ' if finite else ''}{bounds}, got {text}")
        return value

    parse.__name__ = f"number {bounds}"
    return parse


def out_problem(path: str, option: str = "--out") -> Optional[str]:
    """Why the output file ``path`` could not be written at the end of a run (None: it can): a
    directory named as the file, a file that exists read-only, or (for a new file) a folder above
    it that is a file or in which nothing can be made. Makes nothing: a run refused for another
    reason right after leaves no folder behind; the end of the run makes the missing folders."""
    if path.endswith(("/", os.sep)) or os.path.isdir(path):
        return f"{path!r} is a directory; give the file to write, e.g. {os.path.join(path, 'results.json')!r}"
    if os.path.exists(path):  # (written in place: its folder's own rights do not matter)
        return None if os.access(path, os.W_OK) else f"{path!r} exists and is not writable"
    folder = os.path.dirname(os.path.abspath(path))
    existing = next(p for p in (folder, *map(str, Path(folder).parents)) if os.path.lexists(p))
    if not os.path.isdir(existing):
        return f"the folder of {option} {path!r} cannot be made: {existing!r} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"the folder of {option} {path!r} cannot be {'written in' if existing == folder else 'made'}: " \
               f"{existing!r} is not writable"
    return None


def check_out(parser: argparse.ArgumentParser, path: Optional[str], option: str = "--out") -> None:
    """A usage error (exit 2) before any work when ``--out`` cannot be written: the scripts made
    the folder and opened the file only at the end, so a bad --out lost the whole run."""
    problem = out_problem(path, option) if path else None
    if problem:
        parser.error(f"argument {option}: {problem}")
