"""Argument types for the commands' numeric options: parse, check the bounds, and say
what is wrong (argparse prints it with the usage and exits 2)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

__all__ = ["number"]


def number(kind: type = float, *, above: float | None = None, lo: float | None = None,
           hi: float | None = None, name: str = "") -> Callable[[str], float | int]:  # fmt: skip
    """An argparse ``type=``: ``kind(text)`` that is ``> above``, or within ``lo..hi``."""
    prefix = f"{name} " if name else ""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{prefix}must be {what}, got {text!r}") from None
        if above is not None and not value > above:
            raise argparse.ArgumentTypeError(f"{prefix}must be > {above:g}, got {text}")
        if hi is not None and not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{prefix}must be {lo}..{hi}, got {value}")
        if lo is not None and value < lo:
            raise argparse.ArgumentTypeError(f"{prefix}should be >= {lo}, got {value}")
        return value

    return parse
