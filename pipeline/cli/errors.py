"""The one exception a command raises to fail with a message instead of a traceback."""

from __future__ import annotations

__all__ = ["CliError"]


class CliError(Exception):
    """A user-facing failure: printed as ``rankscope: <message>``, exit 1."""
