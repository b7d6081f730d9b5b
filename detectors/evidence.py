"""Evidence attached to a signal: what a person needs to judge it.

Every signal carries the rank's own value, the peer median, a capped list of
the peers' values and (when there is one) the rank's history median, so a
finding can be checked without going back to the trace. Values are plain
Python floats with non-finite readings written as strings ("nan", "inf") so
the evidence survives a JSON round trip unchanged.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["num", "nums", "metric_evidence", "PEERS_CAP"]

PEERS_CAP = 16  # peers' values listed in evidence; enough to judge, small to store


def num(x) -> float | str | None:
    """A JSON-safe number: finite floats as floats, NaN/inf as strings, None stays None."""
    if x is None:
        return None
    x = float(x)
    if math.isfinite(x):
        return round(x, 9)
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def nums(values, cap: int = PEERS_CAP) -> list:
    """At most ``cap`` JSON-safe numbers."""
    arr = np.asarray(values, dtype=np.float64).reshape(-1)[:cap]
    return [num(v) for v in arr]


def metric_evidence(
    metric: str,
    value,
    peer_median,
    peer_values,
    history_median=None,
    z=None,
    **extra,
) -> dict:
    """The standard evidence dict of one rank on one metric."""
    ev = {
        "metric": metric,
        "value": num(value),
        "peer_median": num(peer_median),
        "peers": nums(peer_values),
        "history_median": num(history_median),
    }
    if z is not None:
        ev["z"] = num(z)
    ev.update(extra)
    return ev
