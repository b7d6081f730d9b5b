"""``rankscope import flight-recorder DIR --out TRACE_DIR``: foreign hang evidence as a trace.

Reads PyTorch Flight Recorder dumps (one pickle per rank, loaded with an
unpickler that refuses every global, so a crafted file cannot run code),
writes a rankscope trace of beat records that ``rankscope replay``
localizes like a live hang, and prints what it read and what the hang
monitor concludes from the written trace. Refused, truncated or missing
dumps are reported; a rank without a dump is treated as silent (suspect).
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

__all__ = ["register", "run", "import_flight_recorder", "verdict_of"]


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "import",
        help="convert foreign traces (PyTorch Flight Recorder dumps) into a rankscope trace",
        description=__doc__.split("\n\n")[1],
    )
    sub = p.add_subparsers(dest="format", metavar="FORMAT", required=True)
    fr = sub.add_parser(
        "flight-recorder",
        help="PyTorch Flight Recorder dumps, one file per rank (_dump_<rank>, ...)",
        description="Convert a directory of Flight Recorder dumps into a beat trace.",
    )
    fr.add_argument("directory", help="directory holding one dump file per rank")
    fr.add_argument("--out", required=True, help="trace directory to write")
    fr.add_argument("--job", default=None, help="job name (default: the directory's name)")
    fr.add_argument("--world", type=int, default=None, help="world size, if more ranks than dumps")
    fr.add_argument(
        "--beat-interval-s", type=float, default=5.0, help="seconds between written beats"
    )
    fr.add_argument("--force", action="store_true", help="overwrite an existing trace in --out")
    fr.add_argument("--json", action="store_true", help="print the verdict as one JSON line")
    fr.set_defaults(func=run)


def verdict_of(records: list[dict]) -> list:
    """Replay beats through the hang monitor on the record clock; its signals."""
    from rankscope.detectors.hang.monitor import HangMonitor

    mon = HangMonitor()
    signals = []
    ordered = sorted(records, key=lambda r: r["t"])
    for t, batch in itertools.groupby(ordered, key=lambda r: r["t"]):
        mon.observe_beats(list(batch))
        signals.extend(mon.check(t))
    return signals


def fault_labels(directory) -> list[dict]:
    """Ground truth from a ``fault_injection.log`` beside the dumps (the format of
    NVIDIA's resiliency test cases: ``Fault ranks: [9, 14]``, ``Rank 9, fault_type: X``),
    as ``hang`` labels for ``rankscope eval``; empty when there is none."""
    log = Path(directory) / "fault_injection.log"
    if not log.is_file():
        return []
    ranks, types = [], {}
    for line in log.read_text(errors="replace").splitlines():
        head, _, rest = line.partition(":")
        if head.strip() == "Fault ranks":
            ranks = [int(x) for x in rest.strip(" []").split(",") if x.strip().isdigit()]
        elif head.startswith("Rank ") and "fault_type" in line:
            r = head.split(",")[0].removeprefix("Rank ").strip()
            if r.isdigit():
                types[int(r)] = rest.strip()
    if not ranks:
        return []
    note = "fault_injection.log: " + ", ".join(f"rank {r} {types.get(r, '?')}" for r in ranks)
    return [{"kind": "hang", "ranks": sorted(ranks), "hosts": [f"rank{r}" for r in sorted(ranks)],
             "step": 0, "until": None, "note": note}]  # fmt: skip


def import_flight_recorder(directory, out, job=None, world=None, beat_interval_s=5.0):
    """Read dumps, write the trace (and labels, when the dumps come with ground
    truth); returns ``(report, records, meta)``."""
    from rankscope.pipeline.importers.flight_recorder import load_dumps
    from rankscope.pipeline.importers.flight_recorder_beats import dumps_to_records
    from rankscope.pipeline.traces.files import write_jsonl, write_labels, write_meta

    dumps, report = load_dumps(directory, world=world)
    if not dumps:
        raise ValueError("no usable flight recorder dump:\n" + "\n".join(report.lines()))
    job = job or Path(directory).resolve().name
    records, meta = dumps_to_records(dumps, report, job, beat_interval_s=beat_interval_s)
    out = Path(out)
    write_jsonl(records, out / "beats.jsonl")
    write_meta(out, meta)
    labels = fault_labels(directory)
    if labels:
        write_labels(out, labels)
    return report, records, meta


def run(args) -> int:
    import orjson
    from rankscope.pipeline.cli.errors import CliError

    src, out = Path(args.directory), Path(args.out)
    if not src.is_dir():
        raise CliError(f"{src}: no such directory")
    if args.beat_interval_s <= 0:
        raise CliError("--beat-interval-s should be > 0")
    if out.exists() and any(out.iterdir()) and not args.force:
        raise CliError(f"{out} exists and is not empty (use --force to overwrite)")
    try:
        report, records, meta = import_flight_recorder(
            src, out, job=args.job, world=args.world, beat_interval_s=args.beat_interval_s
        )
    except ValueError as exc:
        raise CliError(str(exc)) from None
    for line in report.lines():
        print(line, file=sys.stderr)
    print(f"wrote {len(records)} beat records to {out}", file=sys.stderr)
    signals = verdict_of(records)
    verdict = {
        "job": meta["job"],
        "hang": sorted(
            {r for s in signals if s.kind == "hang" and not s.unattributed for r in s.ranks}
        ),  # fmt: skip
        "crash": sorted({r for s in signals if s.kind == "crash" for r in s.ranks}),
        "unattributed": sorted({r for s in signals if s.unattributed for r in s.ranks}),
    }
    if args.json:
        sys.stdout.write(orjson.dumps(verdict).decode() + "\n")
    else:
        print(
            f"hang culprits: {verdict['hang'] or 'none'}; crashed/silent: "
            f"{verdict['crash'] or 'none'}"
            + (f"; unattributed: {verdict['unattributed']}" if verdict["unattributed"] else "")
        )
        for s in signals:
            for r, why in s.evidence.get("reasons", {}).items():
                print(f"  rank {r} ({s.kind}): {why}")
    return 0
