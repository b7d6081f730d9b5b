"""The ``rankscope`` command line: ``main`` dispatches to one module per command."""

from rankscope.pipeline.cli.errors import CliError
from rankscope.pipeline.cli.main import build_parser, main

__all__ = ["CliError", "build_parser", "main"]
