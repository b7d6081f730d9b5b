"""``rankscope simulate``: record a real multi-process training run with injected faults."""

from __future__ import annotations

import argparse

from rankscope.pipeline.cli.argtypes import number
from rankscope.pipeline.cli.errors import CliError

EPILOG = """\
fault specs (KIND[:key=value,...]; every kind takes rank=, from=, until=):
  straggler:rank=3,from=120,factor=1.6[,phase=backward]   slow compute
  network:rank=2,from=60,delay_s=0.02                     late all-reduces
  sdc-grad:rank=1,from=80[,bit=exponent|mantissa|N]       bit flip in a local gradient
  sdc-param:rank=1,from=80[,bit=...]                      bit flip in one replica's weights
  sdc-reduce:rank=1,from=80[,bit=...]                     bit flip in one rank's reduced gradient
  nonfinite:rank=5,from=90[,value=nan|inf]                NaN in one rank's local gradient
  hang:rank=6,from=100                                     a rank blocks forever in forward
  crash:rank=4,from=100[,code=N]                           a rank's process exits
  none                                                     a clean run
see docs/simulate.md
"""


def _fault(text: str):
    from rankscope.pipeline.simulate.spec import SpecError, parse_fault

    try:
        return parse_fault(text)
    except SpecError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


_positive = number(int, lo=1)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="run real multi-process training with injected faults and record its trace",
        description="Run real torch.distributed (gloo, CPU) training of a tiny transformer "
        "with the rank collector attached, inject faults, and write the trace plus "
        "labels.jsonl and meta.json.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--ranks", type=_positive, required=True, help="number of rank processes")
    p.add_argument("--steps", type=_positive, required=True, help="optimizer steps")
    p.add_argument("--ranks-per-host", type=_positive, default=1, metavar="K",
                   help="ranks per emulated host (node00, node01, ...; default 1)")
    p.add_argument("--topology", default=None, metavar="dp=..,tp=..,pp=..",
                   help="emulated parallel layout (tp fastest); default: all data-parallel")
    p.add_argument("--fault", dest="faults", type=_fault, action="append", default=[],
                   metavar="SPEC", help="fault to inject (repeatable); default: none")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    p.add_argument("--sink", default=None, metavar="URL",
                   help="collector sink (default file://OUT; 'embedded' streams to this "
                   "process, which writes OUT/records.jsonl.gz)")
    p.add_argument("--seed", type=int, default=0, help="seed for weights, data and faults")
    p.add_argument("--job", default=None, help="job name (default sim-<kinds>-s<seed>)")
    p.add_argument("--gzip", action="store_true", help="gzip the recorded JSONL at the end")
    p.add_argument("--stall-s", type=float, default=None,
                   help="after a hang fault fired, seconds without progress before the run "
                   "is ended (default 5)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rankscope.pipeline.simulate import SimConfig, SpecError, run_simulation

    extra = {} if args.stall_s is None else {"stall_s": args.stall_s}
    try:
        cfg = SimConfig(
            ranks=args.ranks,
            steps=args.steps,
            out_dir=args.out,
            faults=args.faults,
            ranks_per_host=args.ranks_per_host,
            topology=args.topology,
            sink=args.sink,
            seed=args.seed,
            job=args.job,
            gzip=args.gzip,
            **extra,
        )
    except SpecError as exc:
        raise CliError(str(exc)) from None
    received: list[dict] = []
    embedded = (cfg.sink or "").lower().startswith("embedded")
    print(f"simulate: job {cfg.job}, {cfg.ranks} ranks x {cfg.steps} steps, "
          f"{cfg.host_count()} hosts, topology {cfg.topology}, "
          f"faults: {', '.join(s.text for s in cfg.faults) or 'none'}", flush=True)
    result = run_simulation(cfg, on_record=received.append if embedded else None)
    if embedded:
        from rankscope.pipeline.traces.files import write_jsonl

        path = f"{args.out}/records.jsonl.gz" if cfg.gzip else f"{args.out}/records.jsonl"
        n = write_jsonl(received, path)
        print(f"simulate: {n} records streamed through the embedded channel -> {path}")
    else:
        print(f"simulate: trace {result.out_dir} ({len(result.trace_files)} files, "
              f"{result.trace_bytes / 1024:.0f} KiB)")
    done = sorted(set(result.steps_completed.values()))
    print(f"simulate: ended '{result.ended}' after {result.wall_s:.1f} s; "
          f"steps completed per rank: {done}; labels: {len(result.labels)}")
    if not result.ok:
        detail = "; ".join(f"rank {r}: {m}" for r, m in sorted(result.errors.items())[:4])
        raise CliError(
            f"run ended '{result.ended}' but its faults say '{result.expected_end}'"
            + (f" ({detail})" if detail else "")
        )
    return 0
