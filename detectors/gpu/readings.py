"""Read a step's GPU columns (``StepFrame.gpu``) the same way in every GPU detector.

Design notes: docs/detectors.md, "detectors/gpu/readings.py".
"""

from __future__ import annotations

import numpy as np
from rankscope.detectors.frame import StepFrame

__all__ = [
    "CLOCK_EVENT_BITS",
    "THERMAL_EVENTS",
    "POWER_EVENTS",
    "column",
    "has_gpu",
    "clock_events",
    "any_event",
    "throttled",
    "xid_lists",
    "gpu_context",
]

# NVML clock-event reason bits, by the names the collector writes.
CLOCK_EVENT_BITS = {
    "gpu_idle": 0x1,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal": 0x20,
    "hw_thermal": 0x40,
    "hw_power_brake": 0x80,
    "display_clock_setting": 0x100,
    "board_limit": 0x200,
    "reliability": 0x400,
}
# Reasons that mean heat is holding the clock down (hw_slowdown is raised for
# thermal and power-brake slowdowns alike; NVML reports the cause beside it).
THERMAL_EVENTS = ("sw_thermal", "hw_thermal", "hw_slowdown")
POWER_EVENTS = ("sw_power_cap", "hw_power_brake")


def has_gpu(frame: StepFrame) -> bool:
    """True when the step carries any GPU reading."""
    return bool(frame.gpu) and frame.n > 0


def column(frame: StepFrame, name: str) -> np.ndarray:
    """Float column ``name`` over rows; NaN where absent (booleans as 0/1)."""
    col = frame.gpu.get(name)
    if col is None:
        return np.full(frame.n, np.nan)
    arr = np.asarray(col)
    if arr.dtype == object:
        out = np.full(frame.n, np.nan)
        for i, v in enumerate(arr):
            if isinstance(v, bool | int | float | np.number):
                out[i] = float(v)
        return out
    return arr.astype(np.float64, copy=False)


def clock_events(frame: StepFrame) -> list[frozenset[str] | None]:
    """Per row the active clock-event reasons (None where the rank has no reading)."""
    n = frame.n
    col = frame.gpu.get("clock_events")
    if col is not None:
        arr = np.asarray(col)
        if arr.dtype == object:
            return [frozenset(v) if isinstance(v, list | tuple | set | frozenset) else None
                    for v in arr]
        out: list[frozenset[str] | None] = []
        for v in arr.astype(np.float64):
            if not np.isfinite(v):
                out.append(None)
                continue
            mask = int(v)
            out.append(frozenset(k for k, bit in CLOCK_EVENT_BITS.items() if mask & bit))
        return out
    rows: list[set[str] | None] = [None] * n
    for name in CLOCK_EVENT_BITS:
        for key in (f"clock_{name}",):
            flag = frame.gpu.get(key)
            if flag is None:
                continue
            vals = np.asarray(flag, dtype=np.float64)
            for i in range(n):
                if np.isfinite(vals[i]):
                    if rows[i] is None:
                        rows[i] = set()
                    if vals[i] > 0:
                        rows[i].add(name)
    return [frozenset(r) if r is not None else None for r in rows]


def any_event(events: list[frozenset[str] | None], names: tuple[str, ...]) -> np.ndarray:
    """Bool per row: any of ``names`` active."""
    return np.array([bool(e and not e.isdisjoint(names)) for e in events], dtype=bool)


def throttled(frame: StepFrame) -> np.ndarray:
    """Bool per row: its GPU reports a thermal or power clock event this step (a slow
    rank then is the GPU detector's finding, not a straggler's); all False without GPU."""
    if not has_gpu(frame):
        return np.zeros(frame.n, dtype=bool)
    return any_event(clock_events(frame), THERMAL_EVENTS + POWER_EVENTS)


def xid_lists(frame: StepFrame) -> list[list[int]]:
    """Per row the XIDs of the reading (empty list where none)."""
    col = frame.gpu.get("xid")
    if col is None:
        return [[] for _ in range(frame.n)]
    out = []
    for v in np.asarray(col, dtype=object):
        if isinstance(v, list | tuple | np.ndarray):
            out.append([int(x) for x in v if x is not None])
        elif isinstance(v, int | np.integer) and not isinstance(v, bool):
            out.append([int(v)])
        else:
            out.append([])
    return out


_CONTEXT = ("sm_clock_mhz", "power_w", "temp_c", "util_pct")


def gpu_context(frame: StepFrame, row: int) -> dict:
    """A rank's GPU reading as evidence for another detector's finding ({} when none).

    A straggler whose GPU is throttling should say so: the straggler detector
    (or the engine) can attach this to its compute-time evidence, as the GPU
    throttle detector attaches compute time to its own.
    """
    if not has_gpu(frame):
        return {}
    out = {}
    for name in _CONTEXT:
        v = column(frame, name)[row]
        if np.isfinite(v):
            out[name] = round(float(v), 3)
    events = clock_events(frame)[row]
    if events is not None:
        out["clock_events"] = sorted(events)
    return out
