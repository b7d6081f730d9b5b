"""A fixed-bucket histogram the service fills and the metrics endpoint reads.

Kept apart from prometheus_client so that filling it is a bisect and two
additions (no registry, no label lookup) on whatever thread observes, and the
export (``rankscope.pipeline.serve.metrics``) happens only when scraped. A lock
keeps count, sum and buckets consistent between the observing thread and the
scrape; observations are per finding or per store write, never per record.
"""

from __future__ import annotations

import bisect
import math
import threading

__all__ = ["Buckets", "LATENCY_BUCKETS_S", "STEP_BUCKETS", "WRITE_BUCKETS_S"]

LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
STEP_BUCKETS = (0, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89)
WRITE_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class Buckets:
    """Counts of observations at or under each upper bound (``le``), plus +Inf."""

    __slots__ = ("bounds", "_counts", "_sum", "_lock")

    def __init__(self, bounds) -> None:
        bounds = tuple(float(b) for b in bounds)
        if not bounds or list(bounds) != sorted(set(bounds)):
            raise ValueError(f"histogram bounds must be increasing and distinct, got {bounds}")
        self.bounds = bounds
        self._counts = [0] * (len(bounds) + 1)  # the last one: above every bound
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        if not math.isfinite(value):
            return  # a NaN time (no record time) says nothing about latency
        i = bisect.bisect_left(self.bounds, value)
        with self._lock:
            self._counts[i] += 1
            self._sum += value

    def snapshot(self) -> tuple[list[tuple[float, int]], float, int]:
        """``([(le, cumulative count), ..., (inf, count)], sum, count)``."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        out, acc = [], 0
        for le, n in zip((*self.bounds, math.inf), counts, strict=True):
            acc += n
            out.append((le, acc))
        return out, total, acc
