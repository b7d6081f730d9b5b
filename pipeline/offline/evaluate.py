"""Score findings against ground truth (``labels.jsonl``): precision, recall, F1, latency.

A finding matches a label when:

- the kinds agree (any ``sdc*`` subtype counts as ``sdc``);
- its ranks are exactly the label's ranks, and its hosts exactly the label's
  hosts when the label names hosts ("found on exactly the right ranks and
  host");
- its steps overlap the label's window ``[step, until]`` (``until`` null:
  to the end), widened by ``slack_steps`` on both sides because an onset
  read back from a streak can sit a step early and an incident can outlast
  the fault by its merge gap.

Per kind: recall = labels matched / labels; precision = findings that match
some label / findings (attributed findings only: an unattributed finding
explicitly blames nobody, so it is listed but neither true nor false);
latency = detected_step - label step of the earliest matching finding.
A trace with a ``labels.jsonl`` (even empty: a clean run) is labeled; the
findings of traces without one are listed apart, uncounted.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from rankscope.pipeline.engine.findings import Finding
from rankscope.pipeline.offline.replay import replay_trace
from rankscope.pipeline.traces.files import ReadReport, read_labels

__all__ = ["Evaluation", "KindScore", "evaluate", "canonical_kind", "matches"]


def canonical_kind(kind: str) -> str:
    k = str(kind).lower()
    return "sdc" if k.startswith("sdc") else k


def matches(f: Finding, label: dict, slack_steps: int = 3) -> bool:
    """Does finding ``f`` find the fault ``label`` (kinds, ranks, hosts, steps)?"""
    if canonical_kind(f.kind) != canonical_kind(label["kind"]):
        return False
    if set(f.ranks) != set(int(r) for r in label["ranks"]):
        return False
    hosts = label.get("hosts") or []
    if hosts and set(f.hosts) != set(hosts):
        return False
    until = label.get("until")
    hi = float("inf") if until is None else until + slack_steps
    return f.last_step >= label["step"] - slack_steps and f.first_step <= hi


@dataclass(slots=True)
class KindScore:
    kind: str
    labels: int = 0
    found: int = 0
    findings: int = 0
    true_findings: int = 0
    unattributed: int = 0
    latencies: list[int] = field(default_factory=list)

    @property
    def precision(self) -> float | None:
        return self.true_findings / self.findings if self.findings else None

    @property
    def recall(self) -> float | None:
        return self.found / self.labels if self.labels else None

    @property
    def f1(self) -> float | None:
        p, r = self.precision, self.recall
        if p is None or r is None or p + r == 0:
            return None if p is None or r is None else 0.0
        return 2 * p * r / (p + r)

    @property
    def latency_median(self) -> float | None:
        return float(statistics.median(self.latencies)) if self.latencies else None

    @property
    def latency_max(self) -> int | None:
        return max(self.latencies) if self.latencies else None


@dataclass(slots=True)
class Evaluation:
    """Scores per kind plus the details a person needs to see what went wrong."""

    kinds: dict[str, KindScore] = field(default_factory=dict)
    missed: list[tuple[str, dict]] = field(default_factory=list)  # (trace, label)
    false: list[tuple[str, Finding]] = field(default_factory=list)  # (trace, finding)
    unattributed: list[tuple[str, Finding]] = field(default_factory=list)
    unlabeled: list[tuple[str, Finding]] = field(default_factory=list)
    traces: int = 0
    labeled_traces: int = 0
    report: ReadReport = field(default_factory=ReadReport)

    def kind(self, name: str) -> KindScore:
        if name not in self.kinds:
            self.kinds[name] = KindScore(name)
        return self.kinds[name]

    def total(self) -> KindScore:
        out = KindScore("all")
        for k in self.kinds.values():
            out.labels += k.labels
            out.found += k.found
            out.findings += k.findings
            out.true_findings += k.true_findings
            out.unattributed += k.unattributed
            out.latencies.extend(k.latencies)
        return out


def _labeled(path: Path) -> bool:
    return ((path if path.is_dir() else path.parent) / "labels.jsonl").is_file()


def evaluate(paths, *, slack_steps: int = 3, progress=None, findings_of=None) -> Evaluation:
    """Replay each trace and score its findings against its labels.

    ``findings_of(path)``: the findings to score instead of replaying (e.g. those
    a live ``serve`` stored for the trace's jobs)."""
    ev = Evaluation()
    for p in paths:
        path = Path(p)
        ev.traces += 1
        if findings_of is None:
            findings = replay_trace(path, report=ev.report, progress=progress).findings
        else:
            findings = findings_of(path)
        name = os.fspath(path)
        if not _labeled(path):
            ev.unlabeled.extend((name, f) for f in findings)
            continue
        ev.labeled_traces += 1
        labels = read_labels(path, ev.report)
        _score_trace(ev, name, labels, findings, slack_steps)
    return ev


def _score_trace(ev: Evaluation, name: str, labels, findings, slack_steps: int) -> None:
    for lab in labels:
        ks = ev.kind(canonical_kind(lab["kind"]))
        ks.labels += 1
        hits = [f for f in findings if not f.unattributed and matches(f, lab, slack_steps)]
        if hits:
            ks.found += 1
            first = min(f.detected_step for f in hits)
            ks.latencies.append(max(0, first - int(lab["step"])))
        else:
            ev.missed.append((name, lab))
    for f in findings:
        ks = ev.kind(canonical_kind(f.kind))
        if f.unattributed:
            ks.unattributed += 1
            ev.unattributed.append((name, f))
            continue
        ks.findings += 1
        if any(matches(f, lab, slack_steps) for lab in labels):
            ks.true_findings += 1
        else:
            ev.false.append((name, f))
