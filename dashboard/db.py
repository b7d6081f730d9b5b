"""How the dashboard shares one DuckDB file with `rankscope serve`.

DuckDB lets one process hold a database file for writing, and while it does,
no other process can open the file at all, not even read-only. The dashboard
is a second process, so it never keeps the file open:

* Every page render opens a READ-ONLY connection, runs its queries and closes
  it, through the read path every reading command shares
  (``rankscope.pipeline.store_read``): retries with doubling backoff while the
  file is locked, then a snapshot copy (file and WAL) that the page dates. The
  copy is kept under ``snapshot_dir`` and reused while the store is unchanged.
* Triage is the dashboard's only write: a short read-write connection, one
  transaction, closed at once, retried with backoff while serve holds the
  lock. `serve --share-db` holds the file only while it writes, so triage
  lands between its writes; a `serve` that keeps the file open for its whole
  life leaves the lock held, and the user is told so (with that remedy)
  instead of the verdict being dropped silently.

Missing files, empty stores and older schema versions become a
``StoreUnavailable`` with a sentence a person can act on, never a traceback.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import duckdb
from rankscope.dashboard.config import DashboardConfig
from rankscope.pipeline.store import SCHEMA_VERSION, StoreError
from rankscope.pipeline.store_read import StoreBusy, is_lock_message, read_connection

__all__ = ["StoreUnavailable", "Reader", "open_reader", "write_with_retry", "is_lock_error"]

T = TypeVar("T")


class StoreUnavailable(Exception):
    """The store cannot be shown; ``reason`` is one of the names below, ``str()`` says why.

    missing, not_rankscope, old_schema, new_schema, locked, unreadable.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(slots=True)
class Reader:
    """An open read-only connection plus where its data came from."""

    con: duckdb.DuckDBPyConnection
    path: str
    snapshot_t: float | None = None  # unix time of the snapshot copy; None: the live file


_BUSY = (duckdb.IOException, duckdb.ConnectionException)


def is_lock_error(exc: BaseException) -> bool:
    """True when the file is busy (``store_read.is_lock_message``) and ``exc`` is DuckDB's."""
    return isinstance(exc, _BUSY) and is_lock_message(exc)


def _backoff(cfg: DashboardConfig) -> Iterator[float]:
    wait = cfg.open_backoff_s
    while True:
        yield wait
        wait = min(wait * 2, cfg.max_backoff_s)


def _check_schema(con: duckdb.DuckDBPyConnection, path: str) -> None:
    rows = con.execute("SELECT table_name FROM information_schema.tables").fetchall()
    tables = {r[0] for r in rows}
    if "schema_version" not in tables or "findings" not in tables:
        raise StoreUnavailable(
            "not_rankscope",
            f"{path} is a DuckDB file but not a rankscope findings store "
            "(no schema_version/findings tables). Point --db at the file that "
            "`rankscope replay --db` or `rankscope serve --db` writes.",
        )
    row = con.execute("SELECT max(version) FROM schema_version").fetchone()
    version = int(row[0]) if row and row[0] is not None else 0
    if version < SCHEMA_VERSION:
        raise StoreUnavailable(
            "old_schema",
            f"{path} has schema version {version}, older than this rankscope's "
            f"{SCHEMA_VERSION}. The dashboard only reads; open the store once with a writing "
            f"command (e.g. `rankscope replay TRACE --db {path}`) to migrate it.",
        )
    if version > SCHEMA_VERSION:
        raise StoreUnavailable(
            "new_schema",
            f"{path} has schema version {version}, newer than this rankscope's "
            f"{SCHEMA_VERSION}: upgrade rankscope to read it.",
        )


def _snapshot_dir(cfg: DashboardConfig) -> Path:
    base = Path(cfg.snapshot_dir) if cfg.snapshot_dir else Path(tempfile.gettempdir())
    return base / "rankscope-dashboard"


@contextmanager
def open_reader(cfg: DashboardConfig) -> Iterator[Reader]:
    """A read-only view of the store for one page render; always closed afterwards.

    Opened through the shared read path (``rankscope.pipeline.store_read``), with
    the snapshot kept in the config's folder and reused while the store is unchanged."""
    src = Path(cfg.db_path)
    if not src.exists():
        raise StoreUnavailable(
            "missing",
            f"No findings store at {src}. Create one with `rankscope replay TRACE --db {src}` "
            f"or `rankscope serve --db {src}`, or run `make demo`.",
        )
    with ExitStack() as stack:
        try:
            ro = stack.enter_context(read_connection(
                src, attempts=cfg.open_attempts, first_wait_s=cfg.open_backoff_s,
                max_wait_s=cfg.max_backoff_s, snapshot_dir=_snapshot_dir(cfg)))  # fmt: skip
        except StoreBusy as exc:
            raise StoreUnavailable("locked", str(exc)) from exc
        except StoreError as exc:
            raise StoreUnavailable("unreadable", str(exc)) from exc
        _check_schema(ro.con, str(src))
        yield Reader(ro.con, str(src), snapshot_t=ro.snapshot_t)


def write_with_retry(cfg: DashboardConfig, fn: Callable[[duckdb.DuckDBPyConnection], T]) -> T:
    """Run ``fn`` in one transaction on a short read-write connection; retry while locked."""
    src = Path(cfg.db_path)
    if not src.exists():
        raise StoreUnavailable("missing", f"No findings store at {src}.")
    waits = _backoff(cfg)
    last: Exception | None = None
    for _ in range(cfg.write_attempts):
        try:
            con = duckdb.connect(str(src))
        except _BUSY as exc:
            if not is_lock_error(exc):
                raise StoreUnavailable("unreadable", f"cannot open {src}: {exc}") from exc
            last = exc
            time.sleep(next(waits))
            continue
        try:
            _check_schema(con, str(src))
            con.execute("BEGIN TRANSACTION")
            try:
                out = fn(con)
            except BaseException:
                con.execute("ROLLBACK")
                raise
            con.execute("COMMIT")
            return out
        finally:
            con.close()
    raise StoreUnavailable(
        "locked",
        f"{src} stayed locked by a writing process for {cfg.write_attempts} tries ({last}); "
        "the triage was not saved. If `rankscope serve` writes this store, start it with "
        "--share-db so it holds the file only while writing; then try again.",
    )
