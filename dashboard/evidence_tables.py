"""A finding's evidence as small tables a person can read (not a collapsed ``{...}``).

Pure: the finding dict in, ``{caption: DataFrame}`` out. Replica votes list
each digest with the replicas holding it, hang findings who waits for whom
and what each culprit last did, GPU findings each cause with its readings.
Anything else is the evidence's plain values as one name / value table.
"""

from __future__ import annotations

import pandas as pd

__all__ = ["evidence_tables"]

_SKIP = {"peers", "actions", "detectors", "signals", "votes", "waiting", "ranks", "reasons",
         "causes", "gpu", "job", "hosts"}  # fmt: skip


def evidence_tables(f: dict) -> dict[str, pd.DataFrame]:
    ev = f.get("evidence") or {}
    out: dict[str, pd.DataFrame] = {}
    if ev.get("votes"):
        peers = ev.get("peers") or []
        out["Replica vote: each value and the replicas that hold it"] = pd.DataFrame([
            {"value": str(v[0]), "replicas": int(v[1]),
             "ranks": " ".join(str(i) for i, p in enumerate(peers) if p == v[0])}
            for v in ev["votes"] if isinstance(v, list | tuple) and len(v) == 2
        ])  # fmt: skip
    if isinstance(ev.get("waiting"), dict):
        out["Who waits for whom"] = pd.DataFrame([
            {"waiting rank": str(r), "waits for ranks": " ".join(map(str, ws or []))}
            for r, ws in ev["waiting"].items()
        ])  # fmt: skip
    if isinstance(ev.get("ranks"), dict):
        reasons = ev.get("reasons") or {}
        out["What each culprit last did"] = pd.DataFrame([
            {"rank": str(r), "why blamed": str(reasons.get(r, "")),
             **{k: _text(v) for k, v in (d or {}).items()}}
            for r, d in ev["ranks"].items()
        ])  # fmt: skip
    if isinstance(ev.get("causes"), list):
        out["GPU causes"] = pd.DataFrame([
            {"cause": str(c.get("cause")),
             "detail": ", ".join(f"{k}={_text(v)}" for k, v in c.items() if k != "cause")}
            for c in ev["causes"] if isinstance(c, dict)
        ])  # fmt: skip
    if isinstance(ev.get("gpu"), dict):
        out["GPU readings at detection"] = pd.DataFrame(
            [{"reading": k, "value": _text(v)} for k, v in ev["gpu"].items()])
    rest = [{"name": k, "value": _text(v)} for k, v in ev.items() if k not in _SKIP]
    if rest:
        out["Values"] = pd.DataFrame(rest)
    if isinstance(ev.get("actions"), dict):
        out["Decisions"] = pd.DataFrame([
            {"action": str(a), "at step": _text((d or {}).get("step"))}
            for a, d in ev["actions"].items()
        ])  # fmt: skip
    return out


def _text(v) -> str:
    if isinstance(v, list):
        return ", ".join(_text(x) for x in v)
    if isinstance(v, float):
        return f"{v:.6g}"
    return "" if v is None else str(v)
