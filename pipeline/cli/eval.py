"""`rankscope eval TRACE...`: precision, recall, F1 and detection latency against labels.

One row per fault kind (and ``all``): labels, labels found, findings, false
findings, precision, recall, F1, and the detection latency in steps after
onset (median and max). Below the table: every missed label, every false
finding, unattributed findings, and the findings of traces without labels.
"""

from __future__ import annotations

import sys

import orjson

HEADER = ("kind", "labels", "found", "findings", "false", "unattr", "precision", "recall", "f1",
          "lat_med", "lat_max")  # fmt: skip


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "eval",
        help="score the detectors against the labels of recorded traces",
        description="Replay traces and compare their findings with each trace's labels.jsonl: "
        "precision, recall, F1 and detection latency per fault kind.",
    )
    p.add_argument("traces", nargs="+", metavar="TRACE", help="trace directory or file")
    p.add_argument("--json", action="store_true", help="print the scores as one JSON object")
    p.set_defaults(func=run)


def _f(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _row(k) -> tuple:
    return (k.kind, k.labels, k.found, k.findings, k.findings - k.true_findings, k.unattributed,
            _f(k.precision), _f(k.recall), _f(k.f1), _f(k.latency_median, 1),
            "-" if k.latency_max is None else k.latency_max)  # fmt: skip


def _describe(f) -> str:
    return (f"{f.kind} ranks {f.ranks} hosts {f.hosts} steps {f.first_step}-{f.last_step} "
            f"detected {f.detected_step} ({f.detector}, {f.action})")  # fmt: skip


def run(args) -> int:
    from rankscope.pipeline.cli.replay import check_traces, report_bad_lines, require_steps
    from rankscope.pipeline.cli.tables import ProgressBar, render_table
    from rankscope.pipeline.offline.evaluate import evaluate

    traces = check_traces(args.traces)
    bar = ProgressBar()
    try:
        ev = evaluate(traces, progress=bar)
    finally:
        bar.close()
    if ev.labeled_traces == 0 and not ev.unlabeled and ev.traces:
        print("rankscope: no trace has a labels.jsonl; nothing to score", file=sys.stderr)
    kinds = [ev.kinds[k] for k in sorted(ev.kinds)]
    if args.json:
        body = {
            "kinds": {k.kind: _as_dict(k) for k in kinds + [ev.total()]},
            "missed": [{"trace": t, **lab} for t, lab in ev.missed],
            "false": [{"trace": t, **f.to_dict()} for t, f in ev.false],
            "unlabeled": [{"trace": t, **f.to_dict()} for t, f in ev.unlabeled],
        }
        sys.stdout.buffer.write(orjson.dumps(body) + b"\n")
    else:
        print(f"{ev.traces} trace(s), {ev.labeled_traces} labeled")
        print(render_table(HEADER, [_row(k) for k in kinds] + [_row(ev.total())]))
        for title, items in (("missed", ev.missed), ("false findings", ev.false),
                             ("unattributed", ev.unattributed),
                             ("findings on unlabeled traces", ev.unlabeled)):  # fmt: skip
            if not items:
                continue
            print(f"\n{title}:")
            for trace, x in items:
                text = _describe(x) if not isinstance(x, dict) else (
                    f"{x['kind']} ranks {x['ranks']} hosts {x.get('hosts')} from step "
                    f"{x['step']} until {x.get('until')}")  # fmt: skip
                print(f"  {trace}: {text}")
    report_bad_lines(ev.report)
    require_steps(ev.report)
    return 0


def _as_dict(k) -> dict:
    return {"labels": k.labels, "found": k.found, "findings": k.findings,
            "false": k.findings - k.true_findings, "unattributed": k.unattributed,
            "precision": k.precision, "recall": k.recall, "f1": k.f1,
            "latency_median": k.latency_median, "latency_max": k.latency_max}  # fmt: skip

