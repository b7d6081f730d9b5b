"""`rankscope dashboard`: open the Streamlit triage app over a findings store.

The command checks the store first (missing file, not a rankscope store, an
older or newer schema version), so a mistake is one sentence on stderr and
exit 1, not a traceback in a browser tab. It then replaces itself with
`streamlit run dashboard/app.py` (headless, on the given port), handing the
database path over in ``RANKSCOPE_DB``; replacing rather than spawning means
Ctrl-C and SIGTERM reach Streamlit directly and leave no orphan server.

The pipeline must not import the dashboard package, so the app's file is
located with ``importlib.util.find_spec`` and run by path.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
from pathlib import Path

from rankscope.pipeline.cli.argtypes import number
from rankscope.pipeline.cli.errors import CliError

DB_ENV = "RANKSCOPE_DB"  # read by dashboard/config.py


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "dashboard",
        help="open the triage dashboard (Streamlit) over a findings database",
        description="Start the Streamlit triage app on a findings store written by "
        "`rankscope replay --db` or `rankscope serve --db` (it may be running).",
    )
    p.add_argument("--db", default="rankscope.duckdb", help="findings store (DuckDB file)")
    p.add_argument("--port", type=_port, default=8501, help="HTTP port (default 8501)")
    p.add_argument(
        "--address", default="localhost", help="address to listen on (default localhost)"
    )
    p.set_defaults(func=run)


_port = number(int, lo=1, hi=65535, name="port")


def check_store(path: Path) -> str:
    """Say what is wrong with the store as a CliError, or return a one-line summary."""
    import duckdb
    from rankscope.pipeline.store import SCHEMA_VERSION

    if not path.exists():
        raise CliError(
            f"no findings store at {path}; create one with `rankscope replay TRACE --db {path}` "
            "or `rankscope serve --db ...`, or run `make demo`"
        )
    if path.is_dir():
        raise CliError(f"{path} is a directory; --db wants a DuckDB file")
    try:
        con = duckdb.connect(str(path), read_only=True)
    except duckdb.IOException as exc:
        if "lock" in str(exc).lower():
            return "in use by a writing process (the dashboard reads snapshots while it is)"
        raise CliError(f"cannot open {path}: {exc}") from None
    except duckdb.Error as exc:
        raise CliError(f"{path} is not a DuckDB database ({exc})") from None
    try:
        tables = {
            r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()
        }
        if "schema_version" not in tables or "findings" not in tables:
            raise CliError(f"{path} is a DuckDB file but not a rankscope findings store")
        version = con.execute("SELECT max(version) FROM schema_version").fetchone()[0] or 0
        if version < SCHEMA_VERSION:
            raise CliError(
                f"{path} has store schema version {version}, older than {SCHEMA_VERSION}; "
                f"migrate it by opening it once with a writing command, e.g. "
                f"`rankscope replay TRACE --db {path}`"
            )
        if version > SCHEMA_VERSION:
            raise CliError(
                f"{path} has store schema version {version}, newer than this rankscope "
                f"({SCHEMA_VERSION}); upgrade rankscope"
            )
        jobs = con.execute("SELECT count(DISTINCT job) FROM findings").fetchone()[0]
        n = con.execute("SELECT count(*) FROM findings").fetchone()[0]
    finally:
        con.close()
    if n == 0:
        return "empty so far (no findings yet; the page fills as they arrive)"
    return f"{n} findings in {jobs} jobs"


def _port_free(address: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((address, port))
        except OSError:
            return False
    return True


def run(args) -> int:
    path = Path(args.db)
    summary = check_store(path)
    spec = importlib.util.find_spec("rankscope.dashboard")
    if spec is None or not spec.submodule_search_locations:
        raise CliError("the dashboard package is not installed next to rankscope's pipeline")
    app = Path(list(spec.submodule_search_locations)[0]) / "app.py"
    if not _port_free(args.address, args.port):
        raise CliError(f"port {args.port} on {args.address} is in use; pick another with --port")
    env = dict(os.environ)
    env[DB_ENV] = str(path.resolve())
    argv = [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(app),
        "--server.headless=true",
        f"--server.port={args.port}",
        f"--server.address={args.address}",
        "--browser.gatherUsageStats=false",
        "--server.fileWatcherType=none",
    ]
    print(
        f"rankscope dashboard: http://{args.address}:{args.port}/  ({path}: {summary})",
        file=sys.stderr,
        flush=True,
    )
    os.execve(sys.executable, argv, env)
    return 0  # not reached
