"""Loading untrusted pickles that may only hold plain data.

A pickle is a small program: its ``GLOBAL``/``STACK_GLOBAL`` opcodes import
any callable by name and ``REDUCE`` calls it, which is how a crafted file runs
``os.system`` at load time. PyTorch Flight Recorder dumps hold nothing but
dicts, lists, tuples, strings, numbers, booleans and ``None``, none of which
needs a global to be rebuilt, so the unpickler here refuses every global:
``find_class`` raises before anything is imported or called. Persistent ids
(the other hook that reaches outside the data) are refused too.

Never use ``pickle.load`` on a file rankscope did not write itself; use
``safe_loads`` and report ``UnsafePickleError`` to the user.
"""

from __future__ import annotations

import io
import pickle

__all__ = ["UnsafePickleError", "PickleFormatError", "safe_loads", "MAX_PICKLE_BYTES"]

# A dump is a few MB at most; refuse absurd inputs before reading them into memory.
MAX_PICKLE_BYTES = 512 * 1024 * 1024


class UnsafePickleError(pickle.UnpicklingError):
    """The pickle asked for a global (code) or a persistent object: refused, nothing ran."""


class PickleFormatError(ValueError):
    """The bytes are not a complete pickle (truncated, empty, corrupt)."""


class _DataOnlyUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):  # noqa: D401 - pickle hook
        raise UnsafePickleError(
            f"refused global {module}.{name}: only plain data (dict, list, tuple, str, "
            "numbers) may appear in this file"
        )

    def persistent_load(self, pid):
        raise UnsafePickleError(f"refused persistent id {pid!r}")


def safe_loads(data: bytes):
    """Unpickle ``data`` allowing no globals at all.

    Raises ``UnsafePickleError`` when the pickle tries to import or call
    anything, ``PickleFormatError`` when it is truncated or not a pickle.
    """
    if not data:
        raise PickleFormatError("empty file")
    try:
        return _DataOnlyUnpickler(io.BytesIO(data)).load()
    except UnsafePickleError:
        raise
    except EOFError as exc:
        detail = exc or "ran out of input"
        raise PickleFormatError(f"truncated pickle ({len(data)} bytes): {detail}") from None
    except (
        pickle.UnpicklingError,
        ValueError,
        KeyError,
        IndexError,
        TypeError,
        AttributeError,
        OverflowError,
        MemoryError,
        UnicodeDecodeError,
        RecursionError,
    ) as exc:
        raise PickleFormatError(f"corrupt pickle: {type(exc).__name__}: {exc}") from None
