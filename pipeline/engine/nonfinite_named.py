"""``nonfinite_fields`` into frame columns: a null the record names non-finite is evidence.

JSON writers without NaN (the rank collector's orjson) write a non-finite
``loss`` or norm as ``null`` and name it in ``nonfinite_fields``
(docs/trace-format.md). A plain null means "not reported", so the frame gets
the value back (``Infinity`` as inf; ``NaN`` stays NaN) and a bit mask column,
``nonfinite_named``, saying which columns of the row were named: the
nonfinite detector reads a named NaN as a non-finite reading, not a gap.
"""

from __future__ import annotations

import math

import numpy as np
from rankscope.detectors.frame import NAMED_BITS

__all__ = ["apply_named"]

_VALUES = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def apply_named(ch: dict[str, np.ndarray], named) -> None:
    """Fill ``ch["nonfinite_named"]`` from each row's ``nonfinite_fields`` (a dict, an
    Arrow map's pairs, or None; anything else is ignored) and put named values back
    into their columns."""
    n = len(named)
    mask = np.zeros(n)
    for i, fields in enumerate(named):
        if isinstance(fields, list):  # an Arrow map column: (key, value) pairs
            fields = dict(p for p in fields if isinstance(p, tuple) and len(p) == 2)
        if not isinstance(fields, dict):
            continue
        bits = 0
        for name, token in fields.items():
            bit, value = NAMED_BITS.get(name), _VALUES.get(token)
            col = ch.get(name)
            if bit is None or value is None or col is None or not math.isnan(col[i]):
                continue  # unknown field or token, or a value is there: the value wins
            col[i] = value
            bits |= bit
        mask[i] = bits
    ch["nonfinite_named"] = mask

