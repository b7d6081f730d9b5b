"""The sentence an on-call person reads first: who is bad, since when, what to do.

Pure functions over a finding as the store keeps it (a dict with ``kind``,
``ranks``, ``hosts``, steps, ``detected_t``, ``action`` and the detector's
``evidence``), so tests call them without Streamlit. Each kind of finding
gets one line of evidence in plain words, built from the fields its detector
stores (detectors/*: ``metric_evidence``, the vote, hang and GPU evidence).
A field that is missing leaves its clause out; nothing here raises on odd
evidence, since the evidence came from telemetry.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

__all__ = ["ACTION_ORDER", "Banner", "banner", "evidence_line", "what_to_do", "when"]

# Worst first: the order a job's findings are listed in and a job's color.
ACTION_ORDER = {"evict": 0, "recover": 1, "observe": 2}
LEVEL = {"evict": "error", "recover": "warning", "observe": "info"}

_WHAT_TO_DO = {
    "evict": "drain host {host} and restart the job from its last checkpoint without it",
    "recover": "roll back to the last good checkpoint (or redo the step); the host may be fine",
    "observe": "nothing yet: watch it; it becomes an eviction if it persists",
}
_WHAT_TO_DO_KIND = {  # what to do differs by kind where the kind says more than the action
    ("hang", "evict"): "kill the job, drain host {host} and restart from the last checkpoint",
    ("crash", "evict"): "check rank {rank}'s log on {host} for why it died, drain the host and "
                        "restart from the last checkpoint",
    ("gpu", "evict"): "drain host {host}, have {gpu} checked (nvidia-smi -q), restart from the "
                      "last checkpoint",
    ("sdc", "evict"): "drain host {host}, restart from a checkpoint taken before step {first}, "
                      "and run the GPU memory/compute diagnostics on it",
    ("sdc", "recover"): "roll back to a checkpoint from before step {first}; evict host {host} "
                        "if it happens again",
    ("nonfinite", "recover"): "roll back to a checkpoint before step {first} (or skip the batch); "
                              "check the data and learning rate if it recurs",
}  # fmt: skip


@dataclass(slots=True, frozen=True)
class Banner:
    """One job's headline: its color level (error, warning, info, ok) and the text."""

    level: str
    headline: str
    evidence: str
    todo: str


def when(t) -> str:
    """Unix seconds as ``HH:MM`` UTC on today's date, ``YYYY-MM-DD HH:MM`` UTC otherwise."""
    t = _f(t)
    if t is None:
        return "an unknown time"
    fmt = "%H:%M UTC" if time.gmtime(t)[:3] == time.gmtime()[:3] else "%Y-%m-%d %H:%M UTC"
    return time.strftime(fmt, time.gmtime(t))


def what_to_do(f: dict) -> str:
    """The next step for this finding's action (and kind), with its host and rank filled in."""
    action = str(f.get("action") or "observe")
    kind = str(f.get("kind") or "")
    if f.get("unattributed"):
        return "nothing to evict: no healthy majority to blame; check the job as a whole"
    tpl = _WHAT_TO_DO_KIND.get((kind, action)) or _WHAT_TO_DO.get(action) or _WHAT_TO_DO["observe"]
    ev = f.get("evidence") or {}
    return tpl.format(host=_hosts(f), rank=_ranks(f), first=f.get("first_step"),
                      gpu=_gpu_name(ev))  # fmt: skip


def banner(f: dict | None) -> Banner:
    """The headline of a job's worst open finding (``None``: the job is healthy)."""
    if f is None:
        return Banner("ok", "healthy: no open findings", "", "nothing to do")
    action = str(f.get("action") or "observe")
    head = (f"{_who(f)}: {f.get('kind')} since step {f.get('first_step')} "
            f"(detected {when(f.get('detected_t'))}), {action.upper()}")  # fmt: skip
    return Banner(LEVEL.get(action, "info"), head, evidence_line(f), what_to_do(f))


def evidence_line(f: dict) -> str:
    """One line of evidence in plain words for the finding's kind."""
    ev = f.get("evidence") or {}
    kind = f.get("kind")
    try:
        if kind == "hang" or kind == "crash":
            return _hang(f, ev)
        if kind == "gpu":
            return _gpu(f, ev)
        if kind == "sdc" and ev.get("votes"):
            return _vote(f, ev)
        if kind == "nonfinite":
            return _nonfinite(f, ev)
        if kind == "network":
            return _network(f, ev)
        return _metric(f, ev)
    except (TypeError, ValueError, AttributeError, KeyError, IndexError):
        return f"{kind} reported by {f.get('detector')}; see the finding's evidence"


def _gpu_name(ev: dict) -> str:
    gpu = ev.get("gpu")
    return f"GPU {gpu}" if isinstance(gpu, int | str) and not isinstance(gpu, bool) else "its GPU"


def _f(v) -> float | None:
    if v is None or isinstance(v, bool | str):
        return None
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _g(v, digits: int = 3) -> str:
    x = _f(v)
    if x is None:
        return "?"
    return f"{x:.0f}" if 1000 <= abs(x) < 1e6 else f"{x:.{digits}g}"


def _ranks(f: dict) -> str:
    ranks = list(f.get("ranks") or [])
    if not ranks:
        return "unknown"
    head = ", ".join(str(r) for r in ranks[:4])
    return head + (f" and {len(ranks) - 4} more" if len(ranks) > 4 else "")


def _hosts(f: dict) -> str:
    hosts = [str(h) for h in f.get("hosts") or []]
    if not hosts:
        return "unknown"
    return ", ".join(hosts[:3]) + (f" and {len(hosts) - 3} more" if len(hosts) > 3 else "")


def _who(f: dict) -> str:
    ranks = list(f.get("ranks") or [])
    noun = "rank" if len(ranks) == 1 else "ranks"
    hosts = list(f.get("hosts") or [])
    where = "host" if len(hosts) == 1 else "hosts"
    return f"{noun} {_ranks(f)} on {where} {_hosts(f)}"


def _steps(f: dict) -> int | None:
    a, b = _f(f.get("first_step")), _f(f.get("last_step"))
    return None if a is None or b is None else int(b - a + 1)


_METRIC_WORDS = {
    "compute_s": "compute time", "comm_s": "communication time", "data_s": "data loading time",
    "step_s": "step time", "grad_norm": "gradient norm", "loss": "loss",
    "grad_norm_reduced": "reduced gradient norm", "sm_clock_mhz": "SM clock",
    "power_w": "GPU power", "temp_c": "GPU temperature",
}  # fmt: skip
_UNITS = {"sm_clock_mhz": " MHz", "power_w": " W", "temp_c": " °C", "compute_s": " s",
          "comm_s": " s", "data_s": " s", "step_s": " s"}  # fmt: skip


def _metric(f: dict, ev: dict) -> str:
    """Straggler, outlier, throttle: the rank's value as a multiple of its peers' median."""
    metric = str(ev.get("metric") or "value")
    words = _METRIC_WORDS.get(metric, metric)
    ratio = _f(ev.get("ratio"))
    value, med = _f(ev.get("value")), _f(ev.get("peer_median"))
    if ratio is None and value is not None and med:
        ratio = value / med
    n = _steps(f)
    over = f" for {n} steps" if n and n > 1 else " at one step"
    unit = _UNITS.get(metric, "")
    if unit.strip() in ("MHz", "W", "°C"):  # a GPU reading reads best in its own unit
        ratio = None
    if ratio is not None and 0.01 <= ratio <= 1000:
        body = f"{ratio:.1f}x its peers' {words}{over}"
    elif ratio is not None and ratio > 1000:
        body = f"{words} {_g(value)} against a peer median of {_g(med)}{over} ({ratio:.2g}x)"
    else:
        body = f"{words} {_g(value)}{unit} against a peer median of {_g(med)}{unit}{over}"
    extra = []
    if ev.get("clock_events") or ev.get("temp_c") is not None:
        extra.append(_throttle(ev))
    gpu = ev.get("gpu")
    if isinstance(gpu, dict) and gpu.get("clock_events"):
        extra.append(_throttle(gpu))
    return "; ".join([body, *[e for e in extra if e]])


def _throttle(ev: dict) -> str:
    """GPU readings in their units: "GPU throttled (sw_thermal) at 85 °C, 431 W, 1335 MHz"."""
    events = [str(e) for e in ev.get("clock_events") or []]
    units = [f"{x:.{d}g} {u}" for k, u, d in (("temp_c", "°C", 3), ("power_w", "W", 3),
                                               ("sm_clock_mhz", "MHz", 4))
             if (x := _f(ev.get(k))) is not None]  # fmt: skip
    if not events and not units:
        return ""
    head = f"GPU throttled ({', '.join(events)})" if events else "GPU"
    return head + (" at " + ", ".join(units) if units else "")


def _vote(f: dict, ev: dict) -> str:
    """A replica vote: how many replicas agree against this one, since when."""
    votes = ev.get("votes") or []
    voters = int(_f(ev.get("voters")) or sum(int(v[1]) for v in votes))
    majority = int(votes[0][1]) if votes else voters - 1
    what = "parameters" if ev.get("metric") == "param_digest" else "reduced gradients"
    others = voters - 1
    agree = f" ({majority} of {voters} agree)" if majority != others else ""
    since = f.get("first_step")
    return f"{what} differ from the {others} other replicas since step {since}{agree}"


def _hang(f: dict, ev: dict) -> str:
    """Who waits in which collective, and what the culprit did instead."""
    n_wait = int(_f(ev.get("n_waiting")) or len(ev.get("waiting") or {}))
    ranks = ev.get("ranks") or {}
    culprit, desc = next(iter(ranks.items()), (None, {}))
    desc = desc if isinstance(desc, dict) else {}
    op, seq, group = desc.get("op"), desc.get("seq"), desc.get("group")
    where = " in a collective"
    if op:
        nxt = int(seq) + 1 if desc.get("done") and _f(seq) is not None else seq
        where = f" in {op} #{nxt}" + (f" of {group}" if group else "")
    stalled = _f(ev.get("stalled_s"))
    stall = f" for {stalled:.0f} s" if stalled is not None and stalled >= 1 else ""
    reason = str((ev.get("reasons") or {}).get(str(culprit)) or "")
    if f.get("kind") == "crash" or "stopped" in reason:
        silent = _f(desc.get("silent_s"))
        tail = f"rank {culprit} stopped reporting" + (f" {silent:.1f} s ago" if silent else "")
    else:
        tail = f"rank {culprit} never entered it"
        if desc.get("busy_phase"):
            tail += f" (last seen in {desc.get('busy_phase')} of step {desc.get('step')})"
    return f"{n_wait} ranks wait{where}{stall}, {tail}"


_CAUSE_WORDS = {
    "ecc_dbe_growth": "double-bit ECC errors", "nvlink_errors_growth": "NVLink errors",
    "remap_failed": "row remapping failed", "temp_at_slowdown": "at slowdown temperature",
    "temp_at_shutdown": "at shutdown temperature",
}  # fmt: skip


def _gpu(f: dict, ev: dict) -> str:
    """GPU health (XIDs, ECC, temperature) or throttling evidence in the GPU's own units."""
    causes = ev.get("causes")
    if not causes:
        return _metric(f, ev)
    seen: dict[str, str] = {}
    for c in causes:
        c = c if isinstance(c, dict) else {}
        name = str(c.get("cause"))
        if name == "xid":
            text = f"XID {c.get('xid')}" + (f" ({c.get('reason')})" if c.get("reason") else "")
            seen.setdefault(f"xid{c.get('xid')}", text)
        elif name.startswith("temp_at_"):
            seen[name] = f"{_g(c.get('temp_c'))} °C, {_CAUSE_WORDS.get(name, name)} " \
                         f"({_g(c.get('threshold_c'))} °C)"  # the latest reading wins
        else:
            seen.setdefault(name, _CAUSE_WORDS.get(name, name))
    gpu = f"GPU {ev['gpu']}: " if ev.get("gpu") is not None else ""
    return f"{gpu}{'; '.join(seen.values())} at {when(f.get('detected_t'))}"


def _nonfinite(f: dict, ev: dict) -> str:
    basis = ev.get("basis")
    first = f.get("first_step")
    if basis == "reduced_only":
        return f"the reduced gradient went non-finite at step {first}; no rank's own gradient did"
    return (f"its own gradient went non-finite at step {first} before the all-reduce spread "
            f"it to {ev.get('ranks_with_nonfinite_reduced', '?')} of "
            f"{ev.get('ranks_reporting', '?')} ranks")  # fmt: skip


def _network(f: dict, ev: dict) -> str:
    awaited = _f(ev.get("awaited_s"))
    n = _steps(f)
    over = f" for {n} steps" if n and n > 1 else ""
    if awaited is not None:
        return (f"its peers waited {awaited * 1000:.0f} ms for it in each collective{over} "
                f"while it waited {(_f(ev.get('own_wait_s')) or 0) * 1000:.0f} ms")  # fmt: skip
    return _metric(f, ev)
