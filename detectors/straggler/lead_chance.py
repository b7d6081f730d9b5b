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
from rankscope.detectors.stats.persistence import StreakCounter

__all__ = ["LeadChance"]


class LeadChance:
    """Per rank, the steps of its current naming and since its last short one ended
    (two streak counters); per job, how many namings came to nothing."""

    __slots__ = ("named", "since", "count")

    def __init__(self) -> None:
        self.named = StreakCounter()  # steps named in the current episode
        self.since = StreakCounter()  # steps since a short episode ended (0: none)
        self.count = 0  # namings that came to nothing, this job

    def extra(self, cap: int) -> int:
        """Steps the rule's runs must add to their lengths now."""
        return min(self.count, max(int(cap), 0))

    def busy(self) -> bool:
        """A naming under way or a short one not yet quiet long enough."""
        return bool(self.named.count.any() or self.since.count.any())

    def update(self, ranks: np.ndarray, named: np.ndarray, quiet: int) -> None:
        """Advance by one step: ``named``, the rows the rule names this step."""
        if not (named.any() or self.busy()):
            return
        was = self.named.peek(ranks)
        self.named.update(ranks, named)
        short = ~named & (was > 0) & (was <= quiet)  # a short episode ended this step
        since = self.since.update(ranks, ~named & (short | (self.since.peek(ranks) > 0)))
        done = since >= quiet  # quiet as long as it was allowed to last: chance
        if done.any():
            self.count += int(np.count_nonzero(done))
            self.since.update(ranks[done], np.zeros(int(done.sum()), dtype=bool))

    def state_dict(self) -> dict:
        return {"count": self.count, "named": self.named.state_dict(),
                "since": self.since.state_dict()}  # fmt: skip

    def load_state_dict(self, d: dict) -> None:
        self.named.load_state_dict(d.get("named", {}))
        self.since.load_state_dict(d.get("since", {}))
        self.count = int(d.get("count", 0))
