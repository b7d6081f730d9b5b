"""Per-step signals -> incidents -> findings.

Detectors speak once per step; people want one line per fault. An incident
collects consecutive signals of one kind on the same ranks: a signal joins
an open incident of its kind with exactly its ranks, else one whose ranks
overlap (a fault flickering between "ranks 3 and 5" and "rank 3" is still one
incident), else it opens a new one. An incident closes when
``merge_gap_steps`` steps pass without a signal; a later signal then opens a
new incident (and a new finding), except a slowness signal on the same ranks
whose onset is within ``reopen_gap_steps`` of its end: that reopens it
(hysteresis through a mild fault's quiet steps). A ``degraded`` slowness incident (too mild
to act on, ``policy.degraded``) is kept after it goes quiet: a later mild
signal on the same ranks reopens it while the incident was signalled on at
least ``DORMANT_SHARE`` of its steps, so a rank persistently a little slow is
ONE observe finding, not a string of them, and a chance episode long before a
fault is not the fault's onset.

Onset: detectors that need persistence report on the confirming step and
say how long the streak is (``evidence["streak_steps"]``) or name the onset
(``evidence["onset_step"]``); ``first_step`` is that onset, ``detected_step``
the step at which rankscope first reported the incident.

Only incidents worth telling become findings (``report_gate.py``): ones with a
confirmed signal (severity other than ``transient``; a mild straggler once it
has lasted) and unattributed ones (reported, never blamed; a slowness one of
transient signals from its second signal).
Unconfirmed transient deviations stay in the score heatmap unless
``report_transient`` is set. The action comes from ``rankscope.pipeline.engine.policy``; when
an incident's action first becomes ``recover`` or ``evict`` the step and time
are kept in ``evidence["actions"]`` (the store's ``actions`` table).
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable, Iterable

from rankscope.detectors.signal import Signal
from rankscope.pipeline.engine.findings import Finding, finding_id, plain
from rankscope.pipeline.engine.pace import JobPace
from rankscope.pipeline.engine.policy import (
    PAIR_RULES,
    SEVERITY_RANK,
    SLOWNESS_KINDS,
    PolicyConfig,
    decide_action,
    degraded,
)
from rankscope.pipeline.engine.report_gate import LONE_WAIT_RULES, paid
from rankscope.pipeline.engine.report_gate import reportable as reportable_now
from rankscope.pipeline.engine.signal_reads import cost_after, onset_of, slowdown_of, step_ratio_of

__all__ = ["IncidentTracker"]

SLOWDOWN_SIGNALS = 16  # an incident's sustained slowdown: median over its latest signals
CURRENT_STEPS = 4  # a straggler's current slowdown: median over its latest steps


class _Incident:
    __slots__ = (
        "kind", "ranks", "first_ranks", "first_step", "last_step", "detected_step",
        "detected_t", "score", "detector", "severity", "evidence", "unattributed",
        "signals", "detectors", "reported", "fid", "actions", "slowdowns", "rules",
        "current", "noise", "cost_s", "cost_step", "cleared",
    )  # fmt: skip

    def __init__(self, job: str, sig: Signal, step: int) -> None:
        self.kind = sig.kind
        self.ranks = set(int(r) for r in sig.ranks)
        self.first_ranks = sorted(self.ranks)
        self.first_step = onset_of(sig, step)
        self.last_step = step
        self.detected_step = step
        self.detected_t = float("nan")
        self.score = float("-inf")
        self.detector = sig.detector
        self.severity = "transient"
        self.evidence: dict = {}
        self.unattributed = bool(sig.unattributed)
        self.signals = 0
        self.detectors: set[str] = set()
        self.reported = False
        self.actions: dict[str, dict] = {}  # action -> {"step", "t"} when first decided
        self.slowdowns: list[float] = []  # per signal: how much slower than its peers
        self.rules: set[str] = set()
        self.current: dict[int, float] = {}  # step -> compute over its reference that step
        self.noise: float | None = None  # its group's learnt per-step sigma (log ratio)
        self.cost_s, self.cost_step = 0.0, -1  # seconds slow so far, last step counted
        self.cleared = False  # the report gate passed it; held until it has cost enough
        self.fid = finding_id(job, self.kind, self.first_ranks, self.first_step, self.detector)


DORMANT_SHARE = 0.125
"""A quiet degraded incident is reopened by a later mild signal while its signals
number at least this share of the steps since its onset: a rank persistently a
little slow is named often; two chance episodes far apart are two findings."""

CLOSED_KEPT_STEPS = 64
"""A closed incident is kept this many steps: a later signal whose onset (streak or
window) falls inside it reopens it instead of opening a second finding."""


class IncidentTracker:
    """Open and closed incidents of one job; ``update`` returns the findings it changed."""

    def __init__(
        self,
        job: str,
        policy: PolicyConfig,
        *,
        merge_gap_steps: int = 2,
        reopen_gap_steps: int = 16,
        report_transient: bool = False,
        job_hosts: Callable[[], Iterable[str]] | None = None,
    ) -> None:
        self.job = job
        self.policy = policy
        self.merge_gap_steps = merge_gap_steps
        self.reopen_gap_steps = max(reopen_gap_steps, merge_gap_steps)
        self.report_transient = report_transient
        self.job_hosts = job_hosts  # every host of the job (the one-host evict note)
        self._open: list[_Incident] = []
        self._degraded: dict[tuple, _Incident] = {}  # (kind, ranks) -> quiet degraded incident
        self._closed: dict[tuple, _Incident] = {}  # (kind, ranks) -> last closed reported one
        self.pace = JobPace()
        self.findings: dict[str, Finding] = {}
        self.host_sdc: Counter = Counter()

    def _match(self, sig: Signal, step: int) -> _Incident | None:
        ranks = set(int(r) for r in sig.ranks)
        overlap = None
        for inc in self._open:
            if inc.kind != sig.kind or inc.unattributed != bool(sig.unattributed):
                continue
            if inc.ranks == ranks:
                return inc
            if overlap is None and inc.ranks & ranks:
                overlap = inc
        if overlap is None and not sig.unattributed:
            slow = slowdown_of(sig)
            gap = self.reopen_gap_steps if sig.kind in SLOWNESS_KINDS else self.merge_gap_steps
            dormant = self._degraded.get((sig.kind, tuple(sorted(ranks))))
            # the same mild slowness again, if it was seen often enough to be one (a
            # persistently mild rank is signalled a good share of its steps; a chance
            # episode 150 steps before a fault is not its onset), or any slowness whose
            # onset says the mild one never ended (a 1.25x fault reads 1.2x, then 1.4x)
            if dormant is not None and (
                ((slow is None or degraded(self.policy, sig.kind, slow))
                 and dormant.signals >= DORMANT_SHARE * (step - dormant.first_step + 1))
                or onset_of(sig, step) <= dormant.last_step + gap
            ):  # fmt: skip
                del self._degraded[(sig.kind, tuple(sorted(ranks)))]
                self._open.append(dormant)
                return dormant
            closed = self._closed.get((sig.kind, tuple(sorted(ranks))))
            if closed is not None and onset_of(sig, step) <= closed.last_step + gap:
                del self._closed[(sig.kind, tuple(sorted(ranks)))]  # its onset says it never
                self._open.append(closed)  # ended: one incident, one finding
                return closed
        return overlap

    def update(
        self,
        step: int,
        t: float,
        signals: Iterable[Signal],
        hosts_of: Callable[[list[int]], list[str]],
        step_s: float | None = None,
    ) -> list[Finding]:
        """Fold one step's signals in; close incidents that went quiet; return changed findings.

        ``step_s``: the job's step time of this step (``JobPace``), when it is a step.
        """
        touched: dict[int, _Incident] = {}
        ordered = sorted(signals, key=lambda s: (s.kind, sorted(s.ranks), s.detector))
        for sig in ordered:
            if not sig.ranks:
                continue
            named = self._names_slower(sig)
            if named is not None:  # its step, without the peer the pair could not clear
                named.last_step = max(named.last_step, step)
                touched[id(named)] = named
                continue
            inc = self._match(sig, step)
            if inc is None:
                inc = _Incident(self.job, sig, step)
                self._open.append(inc)
            self._absorb(inc, sig, step, t)
            touched[id(inc)] = inc
        live = [i for i in self._open if i.reported and not i.unattributed]
        self.pace.observe(step_s, not live, [i.fid for i in live if i.kind in SLOWNESS_KINDS])
        out = []
        for inc in touched.values():
            f = self._finding(inc, hosts_of, step, t)
            if f is not None:
                out.append(f)
        still = []
        for inc in self._open:
            if step - inc.last_step <= self.merge_gap_steps:
                still.append(inc)
            elif self._is_degraded(inc) and (inc.reported or _held_back(inc)):
                self._degraded[(inc.kind, tuple(sorted(inc.ranks)))] = inc
            elif (inc.reported or inc.cleared) and not inc.unattributed:
                old = self._closed.pop((inc.kind, tuple(sorted(inc.ranks))), None)
                if old is not None:
                    self.pace.forget(old.fid)
                self._closed[(inc.kind, tuple(sorted(inc.ranks)))] = inc
            else:
                self.pace.forget(inc.fid)
        for key, inc in list(self._closed.items()):  # a later signal can only reopen
            if step - inc.last_step > CLOSED_KEPT_STEPS:  # what closed recently
                self.pace.forget(self._closed.pop(key).fid)
        self._open = still
        return out

    def _names_slower(self, sig: Signal) -> _Incident | None:
        """The open, reported incident that names an unattributed pair signal's slower
        member alone. A pipeline hides part of a stage straggler's lag in its bubbles,
        so some of its steps miss the pair rule's wait test and come out unattributed;
        those steps are the named incident's, not a second finding on the pair."""
        slower = (sig.evidence or {}).get("slower_rank") if sig.unattributed else None
        if slower is None or int(slower) not in sig.ranks:
            return None
        return next((i for i in self._open if i.kind == sig.kind and i.reported
                     and not i.unattributed and i.ranks == {int(slower)}), None)  # fmt: skip

    def _rival(self, inc: _Incident) -> _Incident | None:
        """An open slowness incident of the other kind on other ranks, reported beside ``inc``.

        A slow link makes its peers wait and can shift a neighbour's time into what
        its collector counts as compute (a healthy rank 0 came out a straggler beside
        a slow link on rank 2, bench_false_alarms); the job's slowdown then backs
        either. Neither evicts on it while both are open: two real faults of
        different kinds at once are rare, an eviction of the wrong rank is worse
        than a late one. Of two stragglers (or two slow links), the weaker one's is
        contested: a pp replica that ran 1.3x its sped-up partner for a few steps
        beside a real 1.5x straggler was evicted on that straggler's job slowdown.
        """
        if inc.kind not in SLOWNESS_KINDS or inc.unattributed:
            return None
        mine = self._sustained(inc)
        for other in self._open:
            if (other is inc or not other.reported or other.unattributed
                    or other.kind not in SLOWNESS_KINDS or other.ranks & inc.ranks):  # fmt: skip
                continue
            if other.kind != inc.kind:
                return other
            theirs = self._sustained(other)
            if (mine is not None and theirs is not None and theirs > mine
                    and not degraded(self.policy, other.kind, theirs)):  # fmt: skip
                return other
        return None

    def _beside_link(self, inc: _Incident) -> bool:
        """A mild (degraded) straggler while a slow link on other ranks is reported and
        open: the link's late returns shift its peers' waits into what their collectors
        count as compute (bystanders read 1.1-1.2x on the bench's 600-step slow-link
        runs), so it is held until the link's incident ends or it grows past mild."""
        if inc.kind != "straggler" or inc.unattributed or not self._is_degraded(inc):
            return False
        return any(o.kind == "network" and o.reported and not o.unattributed
                   and not o.ranks & inc.ranks for o in self._open)  # fmt: skip

    def _waits_least(self, inc: _Incident) -> bool:
        """A network incident of shorter waits only, on ranks a reported straggler incident
        still open names: a straggler waits least because it arrives last, which is the
        straggler's finding, not a link (2-step observes beside 1.25x and 1.5x stragglers
        of the bench's 600-step tp and tutorial runs)."""
        if inc.kind != "network" or not inc.rules or not inc.rules <= LONE_WAIT_RULES:
            return False
        return any(o.kind == "straggler" and o.reported and not o.unattributed
                   and inc.ranks <= o.ranks for o in self._open)  # fmt: skip

    def _sustained(self, inc: _Incident) -> float | None:
        tail = inc.slowdowns[-SLOWDOWN_SIGNALS:]
        return float(statistics.median(tail)) if tail else None

    def _is_degraded(self, inc: _Incident) -> bool:
        return not inc.unattributed and degraded(self.policy, inc.kind, self._sustained(inc))

    def _absorb(self, inc: _Incident, sig: Signal, step: int, t: float) -> None:
        inc.ranks.update(int(r) for r in sig.ranks)
        inc.last_step = max(inc.last_step, step)
        inc.signals += 1
        inc.detectors.add(sig.detector)
        slow = slowdown_of(sig)
        if slow is not None:
            inc.slowdowns.append(slow)
            del inc.slowdowns[:-SLOWDOWN_SIGNALS]
        inc.cost_s, inc.cost_step = cost_after(inc.cost_s, inc.cost_step, inc.first_step, sig, step)
        now = step_ratio_of(sig)
        if now is not None:  # the strongest rule's reading of the step
            inc.current[step] = max(now, inc.current.get(step, now))
            for old in sorted(inc.current)[:-CURRENT_STEPS]:
                del inc.current[old]
        noise = (sig.evidence or {}).get("noise")
        if isinstance(noise, (int, float)) and noise > 0:
            inc.noise = float(noise)
        rule = (sig.evidence or {}).get("rule")
        if rule:
            inc.rules.add(str(rule))
        score = float(sig.score) if sig.score == sig.score else float("-inf")
        if score > inc.score:
            inc.score = score
        worse = SEVERITY_RANK.get(sig.severity, 0) > SEVERITY_RANK[inc.severity]
        if worse:
            inc.severity = sig.severity
        reportable = not inc.reported and (inc.cleared or reportable_now(
            inc, self.policy, step, self._sustained(inc), self.report_transient))
        if reportable:
            inc.cleared = True
            reportable = paid(inc, self.policy, self.report_transient)
        if reportable and (self._beside_link(inc) or self._waits_least(inc)):
            reportable = False  # an echo of a fault already named, while that one is open
        if reportable:
            inc.reported = True
            inc.detected_step = step
            inc.detected_t = float(t)
            inc.evidence = plain(sig.evidence or {})
        elif not inc.evidence or (worse and not inc.reported):
            inc.evidence = plain(sig.evidence or {})
        else:
            _merge_causes(inc.evidence, sig.evidence)

    def _finding(self, inc: _Incident, hosts_of, step: int, t: float) -> Finding | None:
        if not inc.reported:
            return None
        ranks = sorted(inc.ranks)
        hosts = sorted(set(hosts_of(ranks)))
        if inc.kind == "sdc" and inc.fid not in self.findings and not inc.unattributed:
            self.host_sdc.update(hosts)
        slowdown = self._sustained(inc)
        current = statistics.median(inc.current.values()) if inc.current else None
        corroborated = inc.kind != "network" or bool(inc.rules - LONE_WAIT_RULES) or (
            len(inc.rules) >= 2 or len(inc.detectors) >= 2
        )
        rival = self._rival(inc)
        corroborated = corroborated and rival is None
        action = decide_action(
            self.policy,
            kind=inc.kind,
            severity=inc.severity,
            duration_steps=inc.last_step - inc.first_step + 1,
            host_sdc_incidents=max((self.host_sdc[h] for h in hosts), default=0),
            unattributed=inc.unattributed,
            slowdown=slowdown,
            corroborated=corroborated,
            job_slowdown_z=self.pace.shift_z(inc.fid),
            current_slowdown=current,
            two_peers=inc.kind == "straggler" and bool(inc.rules) and inc.rules <= PAIR_RULES,
        )
        if action != "observe" and action not in inc.actions:
            inc.actions[action] = {"step": step, "t": plain(float(t))}
        evidence = dict(inc.evidence)
        if inc.actions:
            evidence["actions"] = {a: dict(v) for a, v in inc.actions.items()}
        evidence["severity"] = inc.severity
        evidence["signals"] = inc.signals
        evidence["detectors"] = sorted(inc.detectors)
        job_slow = self.pace.slowdown(inc.fid)
        if job_slow is not None and inc.kind in SLOWNESS_KINDS:
            evidence["job_slowdown"] = round(job_slow, 4)
            evidence["job_slowdown_z"] = round(self.pace.shift_z(inc.fid) or 0.0, 2)
        if slowdown is not None:
            evidence["slowdown"] = round(slowdown, 4)
            if degraded(self.policy, inc.kind, slowdown):
                evidence["degraded"] = True
        if current is not None:
            evidence["current_slowdown"] = round(current, 4)
        if rival is not None:
            evidence["contested"] = (
                f"a {rival.kind} incident on rank(s) {sorted(rival.ranks)} is open as well: "
                "the job's slowdown may be its, not this one's"
            )
        elif inc.kind == "network" and not corroborated:
            evidence["uncorroborated"] = "only shorter waits: other work fits as well as a link"
        if action == "evict":
            _one_host_note(evidence, hosts, self.job_hosts)
        f = Finding(
            job=self.job,
            kind=inc.kind,
            ranks=ranks,
            hosts=hosts,
            first_step=inc.first_step,
            last_step=inc.last_step,
            detected_step=inc.detected_step,
            detected_t=inc.detected_t,
            score=inc.score if inc.score != float("-inf") else 0.0,
            detector=inc.detector,
            action=action,
            evidence=evidence,
            finding_id=inc.fid,
            unattributed=inc.unattributed,
        )
        self.findings[inc.fid] = f
        return f

    def open_count(self) -> int:
        return len(self._open)

    def state_dict(self) -> dict:
        """Open, kept degraded and recently closed incidents, host SDC counts (findings
        live in the store)."""
        return {
            "host_sdc": dict(self.host_sdc),
            "open": [_inc_dict(i) for i in self._open],
            "degraded": [_inc_dict(i) for i in self._degraded.values()],
            "closed": [_inc_dict(i) for i in self._closed.values()],
            "pace": self.pace.state_dict(),
        }

    def load_state_dict(self, d: dict) -> None:
        self.host_sdc = Counter(d.get("host_sdc", {}))
        self._open = [_inc_load(self.job, s) for s in d.get("open", [])]
        kept = [_inc_load(self.job, s) for s in d.get("degraded", [])]
        self._degraded = {(i.kind, tuple(sorted(i.ranks))): i for i in kept}
        closed = [_inc_load(self.job, s) for s in d.get("closed", [])]
        self._closed = {(i.kind, tuple(sorted(i.ranks))): i for i in closed}
        self.pace = JobPace()
        self.pace.load_state_dict(d.get("pace", {}))


def _held_back(inc: _Incident) -> bool:
    """A confirmed mild straggler the report gate holds until it has lasted: kept while
    quiet like a reported one, so a rank slow in short bursts is still one finding."""
    return inc.kind == "straggler" and inc.severity != "transient" and not inc.unattributed


def _one_host_note(evidence: dict, hosts: list[str], job_hosts) -> None:
    """An evict on a job's only host names the ranks: the host cannot go without the job."""
    if job_hosts is None:
        return
    every = {h for h in job_hosts() if h and h != "?"}
    if every and every <= set(hosts):
        evidence["evict_scope"] = "ranks"
        evidence["host_note"] = (
            f"{', '.join(sorted(every))} is every host of this job: taking it out stops the "
            "job; evict the ranks (restart them elsewhere) instead"
        )


def _inc_dict(i: _Incident) -> dict:
    return {
        "kind": i.kind, "ranks": sorted(i.ranks), "first_ranks": i.first_ranks,
        "first_step": i.first_step, "last_step": i.last_step,
        "detected_step": i.detected_step, "detected_t": plain(i.detected_t),
        "score": plain(i.score), "detector": i.detector, "severity": i.severity,
        "evidence": i.evidence, "unattributed": i.unattributed,
        "signals": i.signals, "detectors": sorted(i.detectors),
        "reported": i.reported, "fid": i.fid, "actions": i.actions,
        "slowdowns": list(i.slowdowns), "rules": sorted(i.rules), "noise": i.noise,
        "current": [[k, v] for k, v in sorted(i.current.items())],
    }  # fmt: skip


def _inc_load(job: str, s: dict) -> _Incident:
    sig = Signal(kind=s["kind"], ranks=tuple(s["first_ranks"]), detector=s["detector"],
                 score=0.0, unattributed=s["unattributed"])  # fmt: skip
    inc = _Incident(job, sig, s["first_step"])
    inc.ranks = set(s["ranks"])
    inc.last_step = s["last_step"]
    inc.detected_step = s["detected_step"]
    dt = s.get("detected_t")
    inc.detected_t = float(dt) if dt is not None else float("nan")
    sc = s.get("score")
    inc.score = float(sc) if sc is not None else float("-inf")
    inc.severity = s["severity"]
    inc.evidence = s.get("evidence", {})
    inc.signals = s.get("signals", 0)
    inc.detectors = set(s.get("detectors", []))
    inc.reported = s.get("reported", False)
    inc.actions = dict(s.get("actions", {}))
    inc.fid = s["fid"]
    inc.slowdowns = [float(x) for x in s.get("slowdowns", [])]
    inc.rules = set(s.get("rules", []))
    inc.current = {int(k): float(v) for k, v in s.get("current", [])}
    inc.noise = s.get("noise")
    return inc


MAX_CAUSES = 20


def _merge_causes(into: dict, ev: dict | None) -> None:
    """Keep every distinct cause an incident showed (a throttling GPU that later
    reports an XID is one incident whose evidence names both), at most 20."""
    new = (ev or {}).get("causes")
    if not new:
        return
    have = into.setdefault("causes", [])
    seen = {repr(sorted(c.items())) for c in have if isinstance(c, dict)}
    for c in plain(new):
        key = repr(sorted(c.items())) if isinstance(c, dict) else repr(c)
        if key not in seen and len(have) < MAX_CAUSES:
            have.append(c)
            seen.add(key)

