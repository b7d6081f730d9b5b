"""The fast rule's own chance record: namings of this job that came to nothing.

The fast rule (``lead.py``) names a rank after two or three leads, which a
crowded host gives a healthy rank now and then: on the bench, about two
namings per thousand steps of a 4-rank job, whatever the run's length. A
naming that came to nothing (named for at most ``lead_chance_quiet`` steps,
then not named again for as many) is the job showing that its noise makes
such runs; from then on the rule asks one step more of every run, and after a
second one two (``lead_chance_cap``). A real straggler keeps leading, so it
never counts against its own naming, and a quiet job keeps the two-step rule.
Design notes: docs/detectors.md, "detectors/straggler/lead_chance.py".
"""

from __future__ import annotations

import numpy as np
from rankscope.detectors.stats.persistence import usable_ranks

__all__ = ["LeadChance"]


class LeadChance:
    """Per rank, the steps of its current naming and since its last one ended; per job,
    how many namings came to nothing."""

    __slots__ = ("named", "since", "count")

    def __init__(self) -> None:
        self.named = np.zeros(0, dtype=np.int64)  # steps named in the current episode
        self.since = np.zeros(0, dtype=np.int64)  # steps since a short episode ended (0: none)
        self.count = 0  # namings that came to nothing, this job

    def extra(self, cap: int) -> int:
        """Steps the rule's runs must add to their lengths now."""
        return min(self.count, max(int(cap), 0))

    def busy(self) -> bool:
        return bool(self.named.any() or self.since.any())

    def update(self, ranks: np.ndarray, named: np.ndarray, quiet: int) -> None:
        """Advance by one step: ``named``, the rows the rule names this step."""
        ok = usable_ranks(ranks)
        if not ok.all():
            ranks, named = ranks[ok], named[ok]
        if ranks.size == 0 or not (named.any() or self.busy()):
            return
        top = int(ranks.max()) + 1
        if self.named.shape[0] < top:
            size = max(top, 2 * self.named.shape[0])
            self.named = np.pad(self.named, (0, size - self.named.shape[0]))
            self.since = np.pad(self.since, (0, size - self.since.shape[0]))
        was = self.named[ranks]
        ended = ~named & (was > 0)
        short = ended & (was <= quiet)
        self.named[ranks] = np.where(named, was + 1, 0)
        since = self.since[ranks]
        since = np.where(named, 0, np.where(short, 1, np.where(since > 0, since + 1, 0)))
        done = since >= quiet  # quiet as long as it was allowed to last: chance
        self.count += int(np.count_nonzero(done))
        self.since[ranks] = np.where(done, 0, since)

    def state_dict(self) -> dict:
        live = np.flatnonzero(self.named | self.since)
        return {"count": self.count, "ranks": live.tolist(),
                "named": self.named[live].tolist(), "since": self.since[live].tolist()}  # fmt: skip

    def load_state_dict(self, d: dict) -> None:
        ranks = np.asarray(d.get("ranks", []), dtype=np.int64)
        size = int(ranks.max()) + 1 if ranks.size else 0
        self.named = np.zeros(size, dtype=np.int64)
        self.since = np.zeros(size, dtype=np.int64)
        self.named[ranks] = np.asarray(d.get("named", []), dtype=np.int64)
        self.since[ranks] = np.asarray(d.get("since", []), dtype=np.int64)
        self.count = int(d.get("count", 0))
