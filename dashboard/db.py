"""How the dashboard shares one DuckDB file with `rankscope serve`.

DuckDB lets one process hold a database file for writing, and while it does,
no other process can open the file at all, not even read-only. The dashboard
is a second process, so it never keeps the file open:

* Every page render opens a READ-ONLY connection, runs its queries and closes
  it. When the file is locked (serve is writing), it retries with doubling
  backoff; when the lock stays held, it copies the file (and its WAL) to a
  snapshot and reads that, and the page says how old the snapshot is. A torn
  copy (serve checkpointed during the copy) fails DuckDB's block checksums on
  open and is simply copied again.
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

import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import duckdb
from rankscope.dashboard.config import DashboardConfig
from rankscope.pipeline.store import SCHEMA_VERSION

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
    """True when the file is busy: another process holds its lock, or (inside this
    process) another session has it open in the other mode (read-only vs read-write)."""
    msg = str(exc).lower()
    if isinstance(exc, duckdb.IOException):
        return "lock" in msg
    return isinstance(exc, duckdb.ConnectionException) and "different configuration" in msg


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


def _connect_ro(path: str) -> duckdb.DuckDBPyConnection:
    try:
        return duckdb.connect(path, read_only=True)
    except _BUSY as exc:
        if is_lock_error(exc):
            raise
        raise StoreUnavailable("unreadable", f"cannot open {path}: {exc}") from exc
    except duckdb.Error as exc:
        raise StoreUnavailable(
            "unreadable", f"{path} is not a readable DuckDB database: {exc}"
        ) from exc


def _snapshot_path(cfg: DashboardConfig, src: Path) -> Path:
    base = Path(cfg.snapshot_dir) if cfg.snapshot_dir else Path(tempfile.gettempdir())
    base = base / "rankscope-dashboard"
    base.mkdir(parents=True, exist_ok=True)
    tag = hashlib.sha256(str(src.resolve()).encode()).hexdigest()[:16]
    return base / f"{tag}.duckdb"


def _signature(src: Path) -> str:
    parts = []
    for p in (src, Path(str(src) + ".wal")):
        try:
            st = p.stat()
            parts.append(f"{st.st_mtime_ns}:{st.st_size}")
        except FileNotFoundError:
            parts.append("-")
    return "|".join(parts)


def _snapshot_is_current(cfg: DashboardConfig, src: Path) -> bool:
    dst = _snapshot_path(cfg, src)
    sig_file = dst.with_suffix(".sig")
    try:
        return dst.exists() and sig_file.read_text() == _signature(src)
    except OSError:
        return False


def _take_snapshot(cfg: DashboardConfig, src: Path, strict: bool = True) -> tuple[Path, float]:
    """Copy the store and its WAL aside (atomically replaced; reused while unchanged).

    ``strict``: refuse a copy during which the writer changed either file (the
    caller tries again); the last try takes what DuckDB can open.
    """
    dst = _snapshot_path(cfg, src)
    sig_file = dst.with_suffix(".sig")
    sig = _signature(src)
    if _snapshot_is_current(cfg, src):
        return dst, dst.stat().st_mtime
    tmp = Path(tempfile.mkdtemp(dir=dst.parent))
    try:
        shutil.copyfile(src, tmp / "snap.duckdb")
        wal = Path(str(src) + ".wal")
        if wal.exists():
            shutil.copyfile(wal, tmp / "snap.duckdb.wal")
        if strict and _signature(src) != sig:
            raise OSError("the store changed while it was being copied")
        # Open once to replay the WAL into the copy, so readers need only one file.
        con = duckdb.connect(str(tmp / "snap.duckdb"))
        try:
            con.execute("CHECKPOINT")
        finally:
            con.close()
        os.replace(tmp / "snap.duckdb", dst)
        sig_file.write_text(sig)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst, time.time()


@contextmanager
def open_reader(cfg: DashboardConfig) -> Iterator[Reader]:
    """A read-only view of the store for one page render; always closed afterwards."""
    src = Path(cfg.db_path)
    if not src.exists():
        raise StoreUnavailable(
            "missing",
            f"No findings store at {src}. Create one with `rankscope replay TRACE --db {src}` "
            f"or `rankscope serve --db {src}`, or run `make demo`.",
        )
    reader = None
    waits = _backoff(cfg)
    for attempt in range(cfg.open_attempts):
        try:
            reader = Reader(_connect_ro(str(src)), str(src))
            break
        except _BUSY:
            if attempt == 0 and _snapshot_is_current(cfg, src):
                break  # the writer changed nothing since the last copy: read it now
            time.sleep(next(waits))
    if reader is None:  # a writer keeps the lock: read a snapshot copy instead
        last_exc: Exception | None = None
        for attempt in range(cfg.open_attempts):
            try:
                snap, taken = _take_snapshot(cfg, src, strict=attempt < cfg.open_attempts - 1)
                reader = Reader(_connect_ro(str(snap)), str(src), snapshot_t=taken)
                break
            except (duckdb.Error, OSError, StoreUnavailable) as exc:
                last_exc = exc
                time.sleep(next(waits))
        if reader is None:
            raise StoreUnavailable(
                "locked",
                f"{src} is held by a writing process and no consistent snapshot could be "
                f"copied ({last_exc}). Try again in a moment.",
            )
    try:
        _check_schema(reader.con, str(src))
        yield reader
    finally:
        reader.con.close()


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
