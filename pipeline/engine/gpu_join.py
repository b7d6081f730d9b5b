"""Join the latest ``gpu`` sample of each rank's GPU onto an assembled step.

GPU samples come on their own clock (about once a second per GPU), not per
step, so the engine keeps the latest reading per rank in arrays indexed by
rank and copies the rows of a step when it is built: ``frame.gpu`` holds, per
column, a float array over the frame's rows (NaN where no sample exists).

Columns (contract item 4, read by the GPU-health detectors):

- NVML readings, same names and units as the record: ``util_pct``,
  ``mem_used_mb``, ``temp_c``, ``power_w``, ``sm_clock_mhz``, ``ecc_sbe``,
  ``ecc_dbe``, ``pcie_replay``, ``nvlink_errors``; ``remap_pending`` and
  ``remap_failed`` as 0/1; ``gpu`` (device index) and ``gpu_t`` (sample time,
  so a detector can tell a stale reading). Any other numeric field a sample
  carries (the format allows added fields, e.g. ``temp_slowdown_c``) becomes
  a column of the same name.
- ``clock_events``: an object array, per row the list of active clock-event
  (throttle) reason names exactly as the collector wrote them (lossless: no
  name-to-bit table to keep in step), ``None`` where no sample exists;
  ``rankscope.detectors.gpu.readings.clock_events`` reads it.
- ``xid``: an object array, per row the list of XID events reported since
  the previous step was built (samples between two steps are accumulated, so
  an XID is never lost to a later sample), ``None`` where there were none.

A sample without ``rank`` is mapped through its host: GPU index ``i`` of a
host belongs to the host's ``i``-th lowest rank (the usual one-process-per-GPU
layout), once a step has shown which ranks run on that host.
"""

from __future__ import annotations

from collections import deque

import numpy as np

__all__ = ["GpuJoin", "GPU_NUMERIC"]

GPU_NUMERIC = (
    "util_pct",
    "mem_used_mb",
    "temp_c",
    "power_w",
    "sm_clock_mhz",
    "ecc_sbe",
    "ecc_dbe",
    "pcie_replay",
    "nvlink_errors",
    "remap_pending",
    "remap_failed",
    "gpu",
)
MAX_QUEUED = 1 << 16  # samples held for steps not yet built
_NOT_READINGS = frozenset({"v", "type", "job", "host", "t", "rank", "clock_events", "xid"})


class GpuJoin:
    """Latest GPU reading per rank of one job, as rank-indexed arrays.

    A sample replaces the rank's previous one as a whole (a reading absent
    from the newer sample is absent, not carried over); only XIDs accumulate.
    """

    __slots__ = ("_cols", "_events", "_xid", "_unmapped", "_host_ranks", "_queue", "samples")

    def __init__(self) -> None:
        self._queue: deque = deque()
        self._cols: dict[str, np.ndarray] = {}
        self._events = np.full(0, None, dtype=object)
        self._xid: dict[int, list[int]] = {}
        self._unmapped: dict[tuple[str, int], dict] = {}
        self._host_ranks: dict[str, list[int]] = {}
        self.samples = 0

    def _column(self, name: str, size: int) -> np.ndarray:
        col = self._cols.get(name)
        if col is None:
            col = np.full(max(size, 1), np.nan)
            self._cols[name] = col
        elif col.size < size:
            grown = np.full(max(size, 2 * col.size), np.nan)
            grown[: col.size] = col
            col = self._cols[name] = grown
        return col

    def observe(self, rec: dict) -> None:
        """Take one validated ``gpu`` record; it counts from the first step ending after it."""
        self.samples += 1
        self._queue.append(rec)
        if len(self._queue) > MAX_QUEUED:  # steps stopped coming: keep memory bounded
            self._apply(self._queue.popleft())

    def advance(self, until_t: float) -> None:
        """Apply the queued samples taken up to ``until_t`` (the end of the step being built).

        Samples are held back until then because a batch of records can hold
        many steps: joining whatever sample is newest when a step is built
        would give early steps readings from their future.
        """
        if not self._queue:
            return
        later: deque = deque()
        for rec in self._queue:
            if rec["t"] <= until_t:
                self._apply(rec)
            else:
                later.append(rec)
        self._queue = later

    def _apply(self, rec: dict) -> None:
        rank = rec.get("rank")
        if rank is None:
            ranks = self._host_ranks.get(rec["host"])
            if ranks is None or rec["gpu"] >= len(ranks):
                self._unmapped[(rec["host"], int(rec["gpu"]))] = rec
                return
            rank = ranks[int(rec["gpu"])]
        self._put(int(rank), rec)

    def _put(self, rank: int, rec: dict) -> None:
        if rank < 0:
            return
        size = rank + 1
        self._column("gpu_t", size)[rank] = rec["t"]
        for name in GPU_NUMERIC:
            value = rec.get(name)
            self._column(name, size)[rank] = np.nan if value is None else float(value)
        for name, value in rec.items():  # added numeric fields travel too (e.g. temp_slowdown_c)
            if name in _NOT_READINGS or name in GPU_NUMERIC:
                continue
            if isinstance(value, bool | int | float):
                self._column(name, size)[rank] = float(value)
        for name in list(self._cols):  # a reading this sample lacks is absent now
            if name not in GPU_NUMERIC and name != "gpu_t" and name not in rec:
                self._column(name, size)[rank] = np.nan
        events = rec.get("clock_events")
        if events is not None or self._events.size > rank:
            if self._events.size < size:
                grown = np.full(max(size, 2 * self._events.size), None, dtype=object)
                grown[: self._events.size] = self._events
                self._events = grown
            self._events[rank] = [str(e) for e in events] if events is not None else None
        if rec.get("xid"):
            self._xid.setdefault(rank, []).extend(int(x) for x in rec["xid"])

    def learn_hosts(self, rank: np.ndarray, host: np.ndarray) -> None:
        """Remember which ranks run on each host (for samples that carry no rank)."""
        if not self._unmapped and self._host_ranks:
            return
        by_host: dict[str, list[int]] = {}
        for r, h in zip(rank.tolist(), host.tolist(), strict=True):
            by_host.setdefault(h, []).append(r)
        self._host_ranks = {h: sorted(rs) for h, rs in by_host.items()}
        pending, self._unmapped = self._unmapped, {}
        for rec in pending.values():
            self._apply(rec)

    def columns(self, rank: np.ndarray) -> dict[str, np.ndarray]:
        """GPU columns over a frame's rows; empty when the job has no GPU samples."""
        if not self._cols:
            return {}
        out: dict[str, np.ndarray] = {}
        top = int(rank.max()) + 1 if rank.size else 0
        for name, col in self._cols.items():
            if col.size < top:
                col = self._column(name, top)
            out[name] = col[rank]
        xid = np.full(rank.size, None, dtype=object)
        if self._xid:
            pos = {r: i for i, r in enumerate(rank.tolist())}
            for r, events in self._xid.items():
                if r in pos:
                    xid[pos[r]] = events
            self._xid = {r: e for r, e in self._xid.items() if r not in pos}
        out["xid"] = xid
        if self._events.size:
            events = np.full(rank.size, None, dtype=object)
            inside = rank < self._events.size
            events[inside] = self._events[rank[inside]]
            out["clock_events"] = events
        return out
