"""`rankscope demo`: the main job on the embedded bus, no Kafka needed (``make demo``)."""

from __future__ import annotations

import sys

from rankscope.pipeline.cli.errors import CliError
from rankscope.pipeline.cli.verdict_flags import add_verdict_flags, verdict_configs


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "demo",
        help="simulate a faulty 8-rank run, localize it live, store and print the findings",
        description="Runs real multi-process gloo training with injected faults, streams its "
        "telemetry over the embedded bus into the detectors, stores the findings in DuckDB "
        "and prints them with the command that opens the dashboard.",
    )
    p.add_argument("--out", default="demo_out", metavar="DIR", help="output folder")
    p.add_argument("--steps", type=int, default=150, help="optimizer steps (default 150)")
    p.add_argument("--fault", action="append", metavar="SPEC",
                   help="fault spec (repeatable); default: a 1.6x straggler and an sdc-param")
    add_verdict_flags(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from rankscope.pipeline.cli.tables import FINDING_HEADER, findings_rows, render_table
    from rankscope.pipeline.demo import DEFAULT_FAULTS, DemoConfig, run_demo
    from rankscope.pipeline.simulate import SpecError

    try:
        cfg = DemoConfig(out_dir=args.out, steps=args.steps,
                         faults=tuple(args.fault or DEFAULT_FAULTS),
                         detector_configs=verdict_configs(args))  # fmt: skip
    except (ValueError, SpecError) as exc:
        raise CliError(str(exc)) from None
    print(f"rankscope demo: {cfg.ranks} ranks on {cfg.ranks // cfg.ranks_per_host} hosts, "
          f"{cfg.steps} steps, faults: {', '.join(cfg.faults)}")
    try:
        res = run_demo(cfg)
    except SpecError as exc:
        raise CliError(str(exc)) from None
    print(f"\ntraining ended ({res.ended}) after {res.wall_s:.0f} s; "
          f"{res.records} records streamed over the embedded bus\n")
    print("injected (ground truth):")
    for lab in res.labels:
        print(f"  {lab['kind']} on rank(s) {lab['ranks']} host(s) {lab.get('hosts')} "
              f"from step {lab['step']}")
    print("\nfindings:")
    rows = [f.to_dict() for f in res.findings]
    print(render_table(FINDING_HEADER, findings_rows(rows)) if rows else "  none")
    print(f"\nfindings stored in {cfg.db_path}")
    print(f"trace kept in {cfg.trace_dir} (replay it: rankscope replay {cfg.trace_dir})")
    print(f"open the dashboard: .venv/bin/rankscope dashboard --db {cfg.db_path}")
    sys.stdout.flush()
    return 0
