"""Argument types shared by the benchmark scripts (they import each other by their bare names)."""

from __future__ import annotations

import argparse


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
