"""The ``rankscope`` command line.

Each subcommand lives in its own ``pipeline/cmd_*.py`` module exposing
``register(subparsers)`` (adds its parser, sets ``func``) and keeps its heavy
imports inside the function it runs, so ``rankscope --help`` stays instant.
Misuse prints what is wrong and exits 2; a failed run prints the reason and
exits 1; tracebacks are for bugs only.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules that add a subcommand; order is the order in --help.
COMMAND_MODULES = (
    "pipeline.cmd_simulate",
    "pipeline.cmd_replay",
    "pipeline.cmd_eval",
    "pipeline.cmd_findings",
    "pipeline.cmd_serve",
    "pipeline.cmd_publish",
    "pipeline.cmd_import",
    "pipeline.cmd_collect_gpu",
    "pipeline.cmd_dashboard",
    "pipeline.cmd_demo",
)


class CliError(Exception):
    """A user-facing failure: printed as ``rankscope: <message>``, exit 1."""


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
