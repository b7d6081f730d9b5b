"""Score a recorded corpus: replay every run through the engine, count what came out.

Clean runs (an empty ``labels.jsonl``): findings per 100 runs by action and
kind, and by style. A finding counts under the strongest action it ever issued
(``evidence.actions``), not the one it ended with: an evict sent at step 55 is
an eviction even if the incident was only worth watching by the end.
Fault runs, per fault and loop style (and over all styles): recall (a
finding of the right kind on exactly the labelled ranks and host,
``pipeline/offline/evaluate.matches``; the label names whom the style lets a
fault be blamed on, e.g. a tp group for a NaN under tensor parallel),
detection latency in steps, and the findings on any other rank (false ones).
"""

from __future__ import annotations

import json
import statistics
from collections import Counter, defaultdict
from pathlib import Path

from rankscope.detectors.frame import COORD_NAMES
from rankscope.pipeline.offline.evaluate import matches
from rankscope.pipeline.offline.replay import replay_trace
from rankscope.pipeline.traces.files import ReadReport

__all__ = ["score_corpus", "print_scores"]


def _runs(corpus: Path) -> list[Path]:
    return sorted(p for p in corpus.iterdir() if (p / "labels.jsonl").is_file())


_STRENGTH = {"observe": 0, "recover": 1, "evict": 2}


def issued(f) -> str:
    """The strongest action ``f`` issued while open (evidence ``actions``) or ends with."""
    sent = [a for a in (f.evidence.get("actions") or {}) if a in _STRENGTH]
    return max([f.action, *sent], key=lambda a: _STRENGTH.get(a, 0))


def _labels(run: Path) -> list[dict]:
    lines = (run / "labels.jsonl").read_text().splitlines()
    return [json.loads(s) for s in lines if s.strip()]


def _fault_name(run: Path, lab: dict) -> str:
    meta = json.loads((run / "meta.json").read_text())
    f = meta.get("fault") or {}
    mag = f.get("factor", f.get("delay_s"))
    held = " held" if f.get("hold") else ""
    return f"{f.get('kind', lab['kind'])}" + (f" {mag}" if mag is not None else "") + held


def _peer_key(r: dict) -> tuple:
    """The coordinates a rank shares with its symmetric peers: all but ``dp``."""
    return tuple(r.get(c, 0) for c in COORD_NAMES if c != "dp")


def _compute_ratio(run: Path, rank: int, start: int) -> float | None:
    """Median, over the faulty steps, of the rank's compute_s over its symmetric
    peers' median (the ranks of its pipeline stage or tp shard; every other rank
    under plain data parallelism): what an injected slowdown really came to."""
    rows: dict[int, dict[int, dict]] = defaultdict(dict)
    for path in run.glob("rank*.jsonl"):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if r.get("type") == "step" and r["step"] >= start and r.get("compute_s"):
                rows[r["step"]][r["rank"]] = r
    ratios = []
    for per in rows.values():
        if rank not in per:
            continue
        key = _peer_key(per[rank])
        peers = [v["compute_s"] for k, v in per.items() if k != rank and _peer_key(v) == key]
        if peers:
            ratios.append(per[rank]["compute_s"] / statistics.median(peers))
    return statistics.median(ratios) if ratios else None


def score_corpus(corpus: Path) -> dict:
    """Replay each run of ``corpus``; the counts ``print_scores`` prints."""
    clean = Counter()
    clean_runs = defaultdict(int)  # style -> runs
    clean_by_style = defaultdict(Counter)
    faults = defaultdict(
        lambda: {"runs": 0, "found": 0, "lat": [], "other": Counter(), "ratio": [],
                 "early": 0, "split": 0}
    )
    details: list[str] = []
    measured: list[tuple[float, int | None]] = []  # per straggler run: ratio, latency
    report = ReadReport()
    for run in _runs(corpus):
        style = json.loads((run / "meta.json").read_text()).get("style", "?")
        labels = _labels(run)
        res = replay_trace(run, report=report)
        if not labels:
            clean_runs[style] += 1
            for f in res.findings:
                act = issued(f)
                clean[(act, f.kind)] += 1
                clean_by_style[style][act] += 1
                details.append(f"  clean {run.name}: {f.kind} {act} ranks={f.ranks} "
                               f"steps {f.first_step}-{f.last_step} score={f.score:.2f} "
                               f"rule={f.evidence.get('rule', '')}")  # fmt: skip
            continue
        for lab in labels:
            name = _fault_name(run, lab)
            fs = faults[(name, style)]
            fs["runs"] += 1
            ratio = None
            if lab["kind"] == "straggler":
                ratio = _compute_ratio(run, lab["ranks"][0], lab["step"])
                if ratio is not None:
                    fs["ratio"].append(ratio)
            hits = [f for f in res.findings if not f.unattributed and matches(f, lab)]
            if ratio is not None:
                lat = min(f.detected_step for f in hits) - lab["step"] if hits else None
                measured.append((ratio, max(0, lat) if lat is not None else None))
            if hits:
                fs["found"] += 1
                early = [f.first_step for f in hits if f.first_step < lab["step"]]
                fs["early"] += bool(early)
                if early:
                    details.append(f"  fault {run.name}: onset at step {min(early)}, "
                                   f"before the fault (step {lab['step']})")
                fs["split"] += len(hits) > 1
                fs["lat"].append(max(0, min(f.detected_step for f in hits) - lab["step"]))
            for f in res.findings:
                if f not in hits:
                    fs["other"][(issued(f), f.kind)] += 1
                    details.append(
                        f"  fault {run.name}: extra {f.kind} {issued(f)} ranks={f.ranks} "
                        f"steps {f.first_step}-{f.last_step} rule={f.evidence.get('rule', '')}"
                    )
            if not hits:
                got = f" (measured {ratio:.2f}x)" if lab["kind"] == "straggler" and ratio else ""
                details.append(f"  fault {run.name}: MISSED {lab['kind']} rank {lab['ranks']}"
                               f"{got}")  # fmt: skip
    return {"clean": clean, "clean_runs": dict(clean_runs), "by_style": clean_by_style,
            "faults": faults, "details": details, "bad": report.bad,
            "measured": measured}  # fmt: skip


def _merged(rows) -> dict:
    out = {"runs": 0, "found": 0, "lat": [], "other": Counter(), "ratio": [], "early": 0,
           "split": 0}  # fmt: skip
    for fs in rows:
        for k, v in fs.items():
            out[k] += v
    return out


def _print_fault(name: str, style: str, fs: dict) -> None:
    rec = fs["found"] / fs["runs"] if fs["runs"] else float("nan")
    med = statistics.median(fs["lat"]) if fs["lat"] else float("nan")
    mx = max(fs["lat"]) if fs["lat"] else float("nan")
    other = ", ".join(f"{a}/{k} {c}" for (a, k), c in sorted(fs["other"].items())) or "-"
    meas = f"{statistics.median(fs['ratio']):7.2f}x" if fs["ratio"] else "       -"
    print(f"  {name:16s} {style:9s} {fs['runs']:4d} {rec:7.2f} {med:7.1f} {mx:7.1f} {meas} "
          f"{fs['early']:5d} {fs['split']:5d}  {other}")  # fmt: skip


MEASURED_BINS = (1.5, 1.25, 1.1, 0.0)  # lower edges, slowest first


def _print_measured(runs: list[tuple[float, int | None]]) -> None:
    """Straggler runs by what their slowdown came to, whatever was injected: on a
    crowded host a sleep is partly given back (a "1.25x" measured 1.05x), or grows."""
    if not runs:
        return
    print("stragglers by measured slowdown (all factors and styles):")
    top = float("inf")
    for low in MEASURED_BINS:
        lat = [la for r, la in runs if low <= r < top and la is not None]
        n = sum(1 for r, _ in runs if low <= r < top)
        if n:
            med = statistics.median(lat) if lat else float("nan")
            rng = f">= {low:.2f}x" if top == float("inf") else f"{low:.2f}-{top:.2f}x"
            print(f"  {rng:14s} runs {n:4d}  recall {len(lat) / n:5.2f}  latency median "
                  f"{med:5.1f}  max {max(lat, default=float('nan')):5.1f}")  # fmt: skip
        top = low


def print_scores(s: dict, verbose: bool = False) -> None:
    n = sum(s["clean_runs"].values())
    print(f"clean runs: {n} ({', '.join(f'{k} {v}' for k, v in sorted(s['clean_runs'].items()))})")
    per = (lambda c: 100.0 * c / n) if n else (lambda c: float("nan"))
    by_action = Counter()
    for (action, _kind), c in s["clean"].items():
        by_action[action] += c
    print("findings per 100 clean runs, by action:")
    for action in ("evict", "recover", "observe"):
        print(f"  {action:8s} {per(by_action[action]):7.1f}   ({by_action[action]} findings)")
    if s["clean"]:
        print("  by action and kind:")
        for (action, kind), c in sorted(s["clean"].items()):
            print(f"    {action:8s} {kind:12s} {per(c):7.1f}")
    for style, runs in sorted(s["clean_runs"].items()):
        c = s["by_style"][style]
        print(f"  {style:9s} evict {100 * c['evict'] / runs:6.1f}  recover "
              f"{100 * c['recover'] / runs:6.1f}  observe {100 * c['observe'] / runs:6.1f}"
              f"  per 100 runs")  # fmt: skip
    print("injected faults (recall: right kind on exactly its ranks; latency in steps):")
    print(f"  {'fault':16s} {'style':9s} {'runs':>4s} {'recall':>7s} {'lat med':>7s} "
          f"{'lat max':>7s} {'measured':>8s} {'early':>5s} {'split':>5s}  others")  # fmt: skip
    for name in sorted({n for n, _ in s["faults"]}):
        rows = {st: fs for (n, st), fs in s["faults"].items() if n == name}
        if len(rows) > 1:
            _print_fault(name, "all", _merged(rows.values()))
        for style, fs in sorted(rows.items()):
            _print_fault(name if len(rows) == 1 else "", style, fs)
    print("  (measured: the faulty rank's compute over its peers' median during the fault;"
          " early: runs whose\n   finding starts before the fault; split: runs where the"
          " fault came out as several findings)")
    _print_measured(s.get("measured") or [])
    if s["bad"]:
        print(f"malformed records: {s['bad']}")
    if verbose and s["details"]:
        print("details:")
        print("\n".join(s["details"]))
