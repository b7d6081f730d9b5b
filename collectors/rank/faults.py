"""The collector's own failures: counted per part, said once at WARNING.

A failure inside the collector's bookkeeping must never stop the step
records nor raise into training; it must not be silent either. Each part
(``digest``, ``grad_norm``, ``collective``, ...) counts its failures and
logs the first one at WARNING with what failed; later ones only count
(``RankCollector.faults``). The field that part produces is left out of the
records it could not be computed for; every other field still goes out.
"""

from __future__ import annotations

import logging
import threading

__all__ = ["Faults"]

log = logging.getLogger("rankscope.collectors")


class Faults:
    """Failure counts by part; thread-safe enough for counters (GIL, one dict op)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def hit(self, part: str, exc: BaseException) -> None:
        """Count one failure of ``part``; the first one of each part is logged."""
        with self._lock:
            n = self.counts.get(part, 0) + 1
            self.counts[part] = n
        if n == 1:
            log.warning(
                "rankscope collector: %s failed (%s: %s); that field is left out while it "
                "fails, the other fields keep flowing (counted in rc.faults)",
                part,
                type(exc).__name__,
                exc,
            )

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)
