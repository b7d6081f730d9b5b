"""`rankscope replay TRACE... [--db PATH] [--json]`: run the detectors over recorded traces.

Prints the findings as a table (or, with ``--json``, exactly one finding per
line on stdout and nothing else); a progress bar and the malformed-line
summary (``file:line: reason``) go to stderr. With ``--db`` the findings,
scores and job rows are written to the DuckDB store (idempotently).
"""

from __future__ import annotations

import sys

from rankscope.pipeline.cli.errors import CliError

MAX_LISTED_ERRORS = 20


def trace_command(subparsers, name: str, help: str, description: str):
    """A subcommand over ``TRACE...`` (replay, eval): its parser, the traces argument added."""
    p = subparsers.add_parser(name, help=help, description=description)
    p.add_argument("traces", nargs="+", metavar="TRACE", help="trace directory or file")
    return p


def register(subparsers) -> None:
    p = trace_command(
        subparsers,
        "replay",
        help="run the detectors over recorded traces and print the findings",
        description="Replay traces (directories or .jsonl/.jsonl.gz/.parquet files) through "
        "the same engine the service runs, and print one line per finding.",
    )
    p.add_argument("--db", metavar="PATH", help="also store findings in this DuckDB file")
    p.add_argument("--json", action="store_true", help="one finding per line as JSON on stdout")
    p.add_argument(
        "--progress",
        choices=("auto", "always", "never"),
        default="auto",
        help="progress bar on stderr (auto: when stderr is a terminal)",
    )
    p.set_defaults(func=run)


def report_bad_lines(report, stream=None) -> None:
    """The malformed-line summary: a count and the first reasons with file:line."""
    stream = stream or sys.stderr
    if not report.bad:
        return
    print(f"rankscope: {report.bad} malformed record(s) skipped:", file=stream)
    for e in report.errors[:MAX_LISTED_ERRORS]:
        print(f"  {e}", file=stream)
    if report.bad > MAX_LISTED_ERRORS:
        print(f"  ... and {report.bad - MAX_LISTED_ERRORS} more", file=stream)


def check_traces(paths: list[str]) -> list[str]:
    """The usable trace paths; fail early, naming the path, on one that does not exist.

    A plain file that is not a record file (a README caught by ``dir/*``) is
    skipped with a warning, as long as some trace remains.
    """
    from pathlib import Path

    from rankscope.pipeline.traces.files import trace_files

    usable = []
    for p in paths:
        try:
            files = trace_files(p)
        except FileNotFoundError as exc:
            raise CliError(str(exc)) from None
        except ValueError as exc:
            if Path(p).is_file() and len(paths) > 1:
                print(f"rankscope: skipping {exc}", file=sys.stderr)
                continue
            raise CliError(str(exc)) from None
        if not files:
            raise CliError(f"{p}: no record files (.jsonl, .jsonl.gz, .parquet) in this directory")
        usable.append(p)
    if not usable:
        raise CliError("none of the given paths is a trace")
    return usable


def run(args) -> int:
    from rankscope.pipeline.cli.tables import (
        FINDING_HEADER,
        ProgressBar,
        findings_rows,
        render_table,
    )
    from rankscope.pipeline.offline.replay import replay
    from rankscope.pipeline.store import Store, StoreError

    traces = check_traces(args.traces)
    store = None
    if args.db:
        try:
            store = Store(args.db)
        except StoreError as exc:
            raise CliError(str(exc)) from None
    enabled = {"auto": None, "always": True, "never": False}[args.progress]
    bar = ProgressBar(enabled, min_total=0 if args.progress == "always" else 20000)
    try:
        result = replay(traces, store=store, progress=bar)
    finally:
        bar.close()
        if store is not None:
            store.close()
    findings = [f.to_dict() for f in result.findings]
    if args.json:
        out = sys.stdout.buffer
        for f in result.findings:
            out.write(f.to_json() + b"\n")
        out.flush()
    else:
        if findings:
            print(render_table(FINDING_HEADER, findings_rows(findings)))
        else:
            print("no findings")
    report_bad_lines(result.report)
    print(f"rankscope: {result.report.summary()}, {len(findings)} finding(s)"
          + (f", stored in {args.db}" if args.db else ""), file=sys.stderr)  # fmt: skip
    require_steps(result.report)
    return 0


def require_steps(report) -> None:
    """A trace without step records gives the detectors nothing: "no findings" would
    read as a clean run, so it fails instead, saying what the trace did hold."""
    if report.good.get("step", 0):
        return
    held = ", ".join(f"{n} {kind}" for kind, n in sorted(report.good.items()) if n)
    what = f"it holds {held} record(s)" if held else "it holds no valid record"
    raise CliError(
        f"no step records in the trace ({what}): there is nothing to "
        "detect on; was the collector attached to the optimizer (or rc.step() called)?"
    )
