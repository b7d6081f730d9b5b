"""`rankscope eval TRACE...`: precision, recall, F1 and detection latency against labels.

One row per fault kind (and ``all``): labels, labels found, findings, false
findings, precision, recall, F1, and the detection latency in steps after
onset (median and max). Below the table: every missed label, every false
finding, unattributed findings, and the findings of traces without labels.
With ``--db`` the findings scored are those a store holds for each trace's
jobs (a live ``serve``'s, read through ``pipeline/store_read.py``), not a replay's.
"""

from __future__ import annotations

import sys

import orjson

HEADER = ("kind", "labels", "found", "findings", "false", "unattr", "precision", "recall", "f1",
          "lat_med", "lat_max")  # fmt: skip


def register(subparsers) -> None:
    from rankscope.pipeline.cli.replay import trace_command

    p = trace_command(
        subparsers,
        "eval",
        help="score the detectors against the labels of recorded traces",
        description="Replay traces and compare their findings with each trace's labels.jsonl: "
        "precision, recall, F1 and detection latency per fault kind.",
    )
    p.add_argument("--db", metavar="PATH", help="score the findings stored in this DuckDB file "
                   "(by `serve` or `replay --db`, which may be running) for each trace's jobs "
                   "instead of replaying the traces")  # fmt: skip
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
    if args.db:
        ev = evaluate(traces, findings_of=stored_findings(args.db, "eval"))
    else:
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
    if not args.db:
        require_steps(ev.report)
    return 0


def stored_findings(db: str, command: str):
    """``findings_of(trace)`` over a store (read through ``pipeline/store_read.py``, so a
    store ``serve`` holds is read too): the stored findings of the trace's jobs. A job
    the store has never seen is said on stderr, so its silence does not read as clean."""
    from rankscope.pipeline.cli.errors import CliError
    from rankscope.pipeline.cli.findings import say_snapshot
    from rankscope.pipeline.engine.findings import Finding
    from rankscope.pipeline.store import StoreError
    from rankscope.pipeline.store_read import read_store
    from rankscope.pipeline.traces.files import trace_jobs

    try:
        with read_store(db) as store:
            rows = store.list_findings()
            known = {j["job"] for j in store.list_jobs()}
            snapshot = store.snapshot_t is not None
    except StoreError as exc:
        raise CliError(str(exc)) from None
    if snapshot:
        say_snapshot(command, db)
    by_job: dict[str, list] = {}
    for row in rows:
        by_job.setdefault(row["job"], []).append(Finding.from_dict(row))

    def findings_of(path) -> list:
        jobs = trace_jobs(path)
        for job in sorted(jobs - known - set(by_job)):
            print(f"rankscope {command}: job {job!r} of {path} is not in {db}", file=sys.stderr)
        return [f for job in sorted(jobs) for f in by_job.get(job, [])]

    return findings_of


def _as_dict(k) -> dict:
    return {"labels": k.labels, "found": k.found, "findings": k.findings,
            "false": k.findings - k.true_findings, "unattributed": k.unattributed,
            "precision": k.precision, "recall": k.recall, "f1": k.f1,
            "latency_median": k.latency_median, "latency_max": k.latency_max}  # fmt: skip

