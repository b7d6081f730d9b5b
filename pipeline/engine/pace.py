"""The job's own pace: is the whole job slower since an incident began?

A rank that is really slow (compute, link) makes the steps of a
synchronous job longer: everyone waits for it. A rank that merely looks
slow because the host moved CPU time around, or that waits less because it
has other work, does not. So a slowness finding evicts only when the job's
step time since its onset is significantly longer than before it
(``PolicyConfig.job_slowdown_z``): the time is accounted for. The baseline
is the job's step time (``step_reference_s``) over the latest quiet steps,
ones with no reportable incident open; the test is a shift of medians in
units of its standard error from the baseline's robust spread.
"""

from __future__ import annotations

import statistics

__all__ = ["JobPace"]

BASELINE_STEPS = 32
MIN_BASELINE = 5
SINCE_STEPS = 16


class JobPace:
    """Quiet-step baseline of the job's step time, and per-incident step times since."""

    __slots__ = ("quiet", "since")

    def __init__(self) -> None:
        self.quiet: list[float] = []  # step times of recent quiet steps
        self.since: dict[str, tuple[float | None, list[float]]] = {}  # fid -> (base, steps)

    def baseline(self) -> float | None:
        if len(self.quiet) < MIN_BASELINE:
            return None
        return float(statistics.median(self.quiet))

    def observe(self, step_s: float | None, quiet: bool, open_ids) -> None:
        """One step's job step time; ``quiet`` when no reportable incident is open."""
        if step_s is None or not step_s == step_s or step_s <= 0:
            return
        if quiet:
            self.quiet.append(float(step_s))
            del self.quiet[:-BASELINE_STEPS]
        for fid in open_ids:
            base, steps = self.since.setdefault(fid, (self.baseline(), []))
            steps.append(float(step_s))
            del steps[:-SINCE_STEPS]

    def slowdown(self, fid: str) -> float | None:
        """Median step since the incident's onset over the quiet baseline before it."""
        base, steps = self.since.get(fid, (None, []))
        if base is None or not steps:
            return None
        return float(statistics.median(steps)) / base

    def shift_z(self, fid: str) -> float | None:
        """How many standard errors the median step since onset exceeds the baseline's.

        The error of a median of n readings is about 1.2533 sigma / sqrt(n);
        sigma is the baseline's MAD x 1.4826 (at least 0.1 % of its median,
        so a perfectly even job does not make any shift infinitely sure).
        """
        base, steps = self.since.get(fid, (None, []))
        if base is None or not steps or len(self.quiet) < MIN_BASELINE:
            return None
        mad = statistics.median(abs(x - base) for x in self.quiet)
        sigma = max(1.4826 * mad, 1e-3 * base)
        se = 1.2533 * sigma * (1.0 / len(steps) + 1.0 / len(self.quiet)) ** 0.5
        return (float(statistics.median(steps)) - base) / se

    def forget(self, fid: str) -> None:
        self.since.pop(fid, None)

    def state_dict(self) -> dict:
        return {"quiet": list(self.quiet),
                "since": {k: [b, list(s)] for k, (b, s) in self.since.items()}}  # fmt: skip

    def load_state_dict(self, d: dict) -> None:
        self.quiet = [float(x) for x in d.get("quiet", [])]
        self.since = {str(k): (None if v[0] is None else float(v[0]), [float(x) for x in v[1]])
                      for k, v in d.get("since", {}).items()}  # fmt: skip
