"""`rankscope findings [--db PATH] [--job J] [--json]`: list the findings in a store."""

from __future__ import annotations

import sys

import orjson
from rankscope.pipeline.cli.errors import CliError


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "findings",
        help="list stored findings",
        description="List the findings stored by `rankscope replay --db` or `rankscope serve`.",
    )
    p.add_argument("--db", default="rankscope.duckdb", metavar="PATH", help="DuckDB store")
    p.add_argument("--job", metavar="J", help="only this job")
    p.add_argument("--kind", metavar="K", help="only this fault kind")
    p.add_argument("--json", action="store_true", help="one finding per line as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from rankscope.pipeline.cli.tables import FINDING_HEADER, findings_rows, render_table
    from rankscope.pipeline.store import StoreError
    from rankscope.pipeline.store_read import read_store

    try:  # a store `serve` holds is read through a snapshot (pipeline/store_read.py)
        with read_store(args.db) as store:
            findings = store.list_findings(job=args.job, kind=args.kind)
            jobs = [j for j in store.list_jobs() if args.job is None or j["job"] == args.job]
            if store.snapshot_t is not None:
                say_snapshot("findings", args.db)
    except StoreError as exc:
        raise CliError(str(exc)) from None
    if args.json:
        out = sys.stdout.buffer
        for f in findings:
            f = dict(f)
            if not f.get("unattributed"):
                f.pop("unattributed", None)
            if f.get("triage") is None:
                f.pop("triage", None)
            out.write(orjson.dumps(f) + b"\n")
        out.flush()
        return 0
    if not findings:
        print("no findings" + (f" for job {args.job!r}" if args.job else ""))
        _print_loss(jobs)
        return 0
    header = FINDING_HEADER + ("triage",)
    rows = [r + (f.get("triage") or "",) for r, f in zip(findings_rows(findings), findings,
                                                         strict=True)]  # fmt: skip
    print(render_table(header, rows))
    _print_loss(jobs)
    return 0


def say_snapshot(command: str, db) -> None:
    """Tell the reader (on stderr) that a writer holds the store and a copy was read."""
    print(f"rankscope {command}: {db} is held by a writer; read a snapshot taken just now",
          file=sys.stderr)  # fmt: skip


def _print_loss(jobs: list[dict]) -> None:
    """One line per job that lost anything on the way (the jobs table's loss counts)."""
    from rankscope.pipeline.engine.step_buffers import LOSS_COUNTS

    for j in jobs:
        counts = {k: j.get(k) or 0 for k in LOSS_COUNTS}
        if any(counts.values()):
            parts = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in counts.items() if v)
            print(f"job {j['job']}: lost on the way: {parts}")
