"""Findings: what rankscope tells people and trainers, one incident each.

A ``Finding`` has exactly the fields of the trace format's findings shape
(docs/trace-format.md, "Findings") plus ``finding_id``: a hash of what
identifies the incident (job, kind, the ranks it started on, first step,
detector). The id is computed once, when the incident opens, so an incident
that grows (more steps, a later escalation of its action) keeps its id, and
replaying the same trace twice produces the same ids: that is what makes the
DuckDB writes idempotent.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

__all__ = ["Finding", "finding_id", "plain", "FINDING_FIELDS"]

# The trace format's findings shape, in its documented order.
FINDING_FIELDS = (
    "job",
    "kind",
    "ranks",
    "hosts",
    "first_step",
    "last_step",
    "detected_step",
    "detected_t",
    "score",
    "detector",
    "action",
    "evidence",
)


def finding_id(job: str, kind: str, ranks, first_step: int, detector: str) -> str:
    """Stable id of an incident: 16 hex digits of a SHA-256 over its identity."""
    ident = orjson.dumps([job, kind, sorted(int(r) for r in ranks), int(first_step), detector])
    return hashlib.sha256(ident).hexdigest()[:16]


def plain(value: Any) -> Any:
    """Turn detector evidence into plain JSON values (numpy -> Python, NaN/Inf -> None).

    Evidence is written to JSON lines and to DuckDB; both must agree, and a
    NaN reading (a rank that reported nothing) must not become invalid JSON.
    """
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value) if isinstance(value, (set, frozenset)) else value
        return [plain(v) for v in items]
    if isinstance(value, np.ndarray):
        return [plain(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return str(value)


@dataclass(slots=True, kw_only=True)
class Finding:
    """One incident: consecutive steps of one fault kind on the same ranks.

    ``first_step`` is the onset (the first step that showed the deviation),
    ``detected_step``/``detected_t`` when rankscope first reported it, and
    ``last_step`` the latest step that still showed it. ``action`` is the
    policy's current verdict (it can escalate while the incident lasts).
    ``unattributed`` findings name ranks that disagree without a healthy
    majority to say which side is faulty: reported, never blamed.
    """

    job: str
    kind: str
    ranks: list[int]
    hosts: list[str]
    first_step: int
    last_step: int
    detected_step: int
    detected_t: float
    score: float
    detector: str
    action: str
    evidence: dict = field(default_factory=dict)
    finding_id: str = ""
    unattributed: bool = False

    def __post_init__(self) -> None:
        if not self.finding_id:
            self.finding_id = finding_id(
                self.job, self.kind, self.ranks, self.first_step, self.detector
            )

    def to_dict(self) -> dict:
        """The trace format's findings shape plus ``finding_id`` (an added field)."""
        out = {name: getattr(self, name) for name in FINDING_FIELDS}
        out["ranks"] = [int(r) for r in self.ranks]
        out["hosts"] = [str(h) for h in self.hosts]
        out["score"] = plain(float(self.score))
        out["detected_t"] = plain(float(self.detected_t))
        out["evidence"] = plain(self.evidence)
        out["finding_id"] = self.finding_id
        if self.unattributed:
            out["unattributed"] = True
        return out

    def to_json(self) -> bytes:
        """One JSON line (without the newline)."""
        return orjson.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, d: dict) -> Finding:
        """Rebuild a finding from its JSON shape (e.g. a stored row or a JSON line)."""
        return cls(
            job=d["job"],
            kind=d["kind"],
            ranks=[int(r) for r in d.get("ranks") or []],
            hosts=[str(h) for h in d.get("hosts") or []],
            first_step=int(d["first_step"]),
            last_step=int(d["last_step"]),
            detected_step=int(d["detected_step"]),
            detected_t=float(d["detected_t"]) if d.get("detected_t") is not None else math.nan,
            score=float(d["score"]) if d.get("score") is not None else math.nan,
            detector=d["detector"],
            action=d["action"],
            evidence=d.get("evidence") or {},
            finding_id=d.get("finding_id") or "",
            unattributed=bool(d.get("unattributed", False)),
        )
