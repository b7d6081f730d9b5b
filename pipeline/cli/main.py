"""The ``rankscope`` command line.

Each subcommand lives in its own module of ``pipeline/cli/`` exposing
``register(subparsers)`` (adds its parser, sets ``func``) and keeps its heavy
imports inside the function it runs, so ``rankscope --help`` stays instant.
Misuse prints what is wrong and exits 2; a failed run prints the reason and
exits 1; tracebacks are for bugs only.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from rankscope.pipeline.cli.errors import CliError

# Modules that add a subcommand; order is the order in --help.
COMMAND_MODULES = (
    "rankscope.pipeline.cli.simulate",
    "rankscope.pipeline.cli.replay",
    "rankscope.pipeline.cli.eval",
    "rankscope.pipeline.cli.findings",
    "rankscope.pipeline.cli.serve",
    "rankscope.pipeline.cli.publish",
    "rankscope.pipeline.cli.importer",
    "rankscope.pipeline.cli.collect_gpu",
    "rankscope.pipeline.cli.dashboard",
    "rankscope.pipeline.cli.demo",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rankscope",
        description="Localize faulty ranks and hosts in distributed training from telemetry.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except CliError as exc:
        print(f"rankscope: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
