"""Verdicts that need no stall deadline (a crash) or must not blame anyone (a silent job).

A crash is named as soon as the evidence is unambiguous: the rank sent no beat
for its crash limit while its peers beat on past its last beat and, still
beating, wait in collectives; the job made no progress meanwhile. A job whose
ranks all fell silent together says nothing about any one rank (a job killed
whole, or its records no longer reaching rankscope, looks the same at any
instant of healthy training): it is a stall of the whole job, never a culprit.
Design notes: docs/hangs.md, "Faster live verdicts".
"""

from __future__ import annotations

import statistics

from rankscope.detectors.hang.clock import silent_s
from rankscope.detectors.hang.state import Job, Rank, is_closed
from rankscope.detectors.hang.wait_graph import Localization

__all__ = ["crash_limit", "crashed_early", "job_quiet", "silent_job"]


def crash_limit(cfg, rs: Rank) -> float:
    """The beat silence that names a crash: ``crash_s - crash_margin_s``, and at least
    ``crash_beat_factor`` of the rank's own median beat gaps."""
    gap = statistics.median(rs.gaps) if rs.gaps else 0.0
    return max(cfg.crash_s - cfg.crash_margin_s, cfg.crash_beat_factor * gap)


def _in_collective(rs: Rank) -> bool:
    return rs.group is not None and not rs.done and rs.phase == "collective"


def crashed_early(cfg, j: Job, now_c: float, offsets: dict[int, float], stalled: float
                  ) -> list[int]:  # fmt: skip
    """Ranks crashed beyond doubt before any stall deadline (see the module docstring).

    Each names a rank silent for its ``crash_limit`` while every peer still beating
    (within its own limit) waits in a collective, one of them beat half that limit or
    more after the rank's last beat, and the job made no progress for as long.
    """
    open_ranks = [rs for rs in j.ranks.values() if not is_closed(rs)]
    limits = {rs.rank: crash_limit(cfg, rs) for rs in open_ranks}
    silence = {rs.rank: silent_s(rs, now_c, offsets) for rs in open_ranks}
    beating = [rs for rs in open_ranks if silence[rs.rank] < limits[rs.rank]]
    if not beating or not all(_in_collective(rs) for rs in beating):
        return []
    newest = max(rs.last_arrival - offsets.get(rs.rank, 0.0) for rs in beating)
    out = []
    for rs in open_ranks:
        lim = limits[rs.rank]
        last = rs.last_arrival - offsets.get(rs.rank, 0.0)
        if silence[rs.rank] >= lim and min(stalled, newest - last) >= lim / 2:
            out.append(rs.rank)
    return sorted(out)


def job_quiet(cfg, j: Job, now_c: float, offsets: dict[int, float]) -> bool:
    """Every rank that has not closed is silent for its crash limit (and one has not)."""
    open_ranks = [rs for rs in j.ranks.values() if not is_closed(rs)]
    return bool(open_ranks) and all(
        silent_s(rs, now_c, offsets) >= crash_limit(cfg, rs) for rs in open_ranks
    )


def silent_job(j: Job, seen: Localization, now_c: float, offsets: dict[int, float]
               ) -> Localization:  # fmt: skip
    """The verdict on a job fallen wholly silent: every rank unattributed, with who
    waited for whom at the last beats (``seen``) kept as evidence, never as blame."""
    quiet = min(silent_s(rs, now_c, offsets) for rs in j.ranks.values())
    out = Localization(waiting=seen.waiting, unattributed=sorted(j.ranks))
    why = (f"no beat from any rank for {quiet:.1f} s: the whole job went silent (killed "
           "whole, or its records no longer reach rankscope); no one rank is to blame")
    out.reasons = dict.fromkeys(out.unattributed, why)
    return out
