"""What a hang verdict says: signals and per-rank evidence.

The engine files each signal as a finding; ``evidence`` carries ``job``,
``step`` (where the waiting ranks are: a dead rank's last beat may be old)
and ``t`` so it can, plus the stall, the deadline, who waits for whom, and
for each culprit its host, step, last phase (and last phase other than
``idle``), last group, sequence number and op, whether that finished, its
last beat time on its own clock, seconds silent and clock offset.
"""

from __future__ import annotations

from rankscope.detectors.hang.clock import silent_s
from rankscope.detectors.hang.state import Job, Rank
from rankscope.detectors.hang.wait_graph import Localization
from rankscope.detectors.signal import Signal

__all__ = ["DETECTOR", "build_signals", "describe_rank"]

DETECTOR = "hang"


def describe_rank(j: Job, r: int, now_c: float, offsets: dict[int, float]) -> dict:
    """A culprit's evidence: what it was last seen doing, on its own clock."""
    rs = j.ranks.get(r)
    if rs is None:
        return {"host": None, "reported": False}
    return {
        "host": rs.host,
        "step": rs.step,
        "phase": rs.phase,
        "busy_phase": rs.busy_phase,
        "group": rs.group,
        "seq": rs.seq,
        "op": rs.op,
        "done": rs.done,
        "peer": rs.peer,
        "last_beat_t": rs.last_t,
        "silent_s": round(silent_s(rs, now_c, offsets), 3),
        "clock_offset_s": round(offsets.get(r, 0.0), 3),
    }


def build_signals(
    name: str,
    j: Job,
    loc: Localization,
    now_c: float,
    offsets: dict[int, float],
    stalled: float,
    deadline: float,
    n: int,
) -> list[Signal]:
    """One signal per verdict class: alive culprits (``hang``), silent or unseen ones
    (``crash``), and the unattributed (transient, never blamed); at most ``n`` ranks
    are described one by one."""
    # The step in progress: where the waiting ranks are (a dead rank's last beat may be old).
    steps = [j.ranks[r].step for r in loc.waiting if r in j.ranks] or [
        rs.step for rs in j.ranks.values()
    ]
    steps = [x for x in steps if x is not None]
    step = max(steps) if steps else 0
    score = round(max(1.0, stalled / deadline), 3)  # a job that closed hung needs no wait
    base = {
        "job": name,
        "step": step,
        "t": now_c,
        "stalled_s": round(stalled, 3),
        "deadline_s": round(deadline, 3),
        "waiting": {str(r): ws[:n] for r, ws in list(loc.waiting.items())[:n]},
        "n_waiting": len(loc.waiting),
    }
    out = []
    for kind, ranks, severity in (
        ("hang", loc.hang, "fatal"),
        ("crash", loc.crash, "fatal"),
        ("hang", loc.unattributed, "transient"),
    ):
        if not ranks:
            continue
        unattributed = severity == "transient"
        ev = dict(base)
        ev["ranks"] = {str(r): describe_rank(j, r, now_c, offsets) for r in ranks[:n]}
        ev["hosts"] = sorted({h for r in ranks if (h := (j.ranks.get(r) or Rank(r)).host)})
        ev["reasons"] = {str(r): loc.reasons.get(r, "") for r in ranks[:n]}
        out.append(
            Signal(
                kind=kind,
                ranks=tuple(ranks),
                detector=DETECTOR,
                score=score,
                severity=severity,
                evidence=ev,
                unattributed=unattributed,
            )
        )
    return out
