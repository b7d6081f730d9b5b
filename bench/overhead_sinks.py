"""Sinks for the overhead benches: one that discards, one that stalls (a hung broker)."""

from __future__ import annotations

import time


class NullSink:
    """Accepts and discards: measures the collector, not a disk."""

    def send(self, records):
        pass

    def flush(self):
        pass

    def close(self):
        pass


class StallingSink(NullSink):
    """Blocks in its first send for ``stall_s`` seconds (a hung broker)."""

    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s
        self.stalled_until: float | None = None
        self.received = 0

    def send(self, records):
        if self.stalled_until is None:
            self.stalled_until = time.monotonic() + self.stall_s
            time.sleep(self.stall_s)
        self.received += len(records)
