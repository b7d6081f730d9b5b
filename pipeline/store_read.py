"""Reading a store another process is writing: a read-only attach with retry, then a snapshot.

DuckDB lets one process hold a file for writing and then refuses every other
open, read-only too; ``rankscope serve`` (without ``--share-db``) holds its
store for its whole life. So every reader (``findings``, ``eval --db``, the
dashboard) first tries a read-only attach a few times with doubling waits
(``serve --share-db`` lets go between writes), and when the lock stays held
reads a copy: the file and its WAL copied aside, the WAL replayed into the
copy, the copy opened read-only. A copy torn by a write during it fails
DuckDB's checksums on open and is taken again. A reader that comes back often
(the dashboard, once per page) names a ``snapshot_dir``: its copy is kept
there and reused while the store's file and WAL are unchanged. The caller
learns whether it reads a snapshot (``snapshot_t``) to say so.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rankscope.pipeline.store import Store, StoreError

__all__ = ["read_store", "read_connection", "ReadOnly", "StoreBusy", "is_lock_message"]

ATTEMPTS = 4
FIRST_WAIT_S = 0.05
MAX_WAIT_S = 0.5


class StoreBusy(StoreError):
    """A writer holds the store and no consistent snapshot of it could be copied."""


@dataclass(slots=True)
class ReadOnly:
    """An open read-only DuckDB connection and whether it reads a snapshot copy."""

    con: object  # duckdb.DuckDBPyConnection
    snapshot_t: float | None  # unix time the copy was taken; None: the live file


def is_lock_message(exc: BaseException) -> bool:
    """The file is busy: another process holds its lock, or (in this process) another
    connection has it open in the other mode (read-only vs read-write)."""
    msg = str(exc).lower()
    return "lock" in msg or "different configuration" in msg


def _signature(src: Path) -> str:
    parts = []
    for p in (src, Path(str(src) + ".wal")):
        try:
            st = p.stat()
            parts.append(f"{st.st_mtime_ns}:{st.st_size}")
        except FileNotFoundError:
            parts.append("-")
    return "|".join(parts)


def _connect(path: Path):
    """A read-only connection; a lock error is raised as it is, any other as a StoreError."""
    import duckdb

    try:
        return duckdb.connect(str(path), read_only=True)
    except (duckdb.IOException, duckdb.ConnectionException) as exc:
        if is_lock_message(exc):
            raise
        raise StoreError(f"cannot open {path}: {exc}") from exc
    except duckdb.Error as exc:
        raise StoreError(f"{path} is not a readable DuckDB database: {exc}") from exc


class _Snapshots:
    """Where copies of ``src`` go: a kept, reusable one under ``keep_dir``, or a temporary one."""

    def __init__(self, src: Path, keep_dir: str | os.PathLike | None) -> None:
        self.src = src
        self.kept = keep_dir is not None
        if self.kept:
            base = Path(keep_dir)
            base.mkdir(parents=True, exist_ok=True)
            tag = hashlib.sha256(str(src.resolve()).encode()).hexdigest()[:16]
            self.dst = base / f"{tag}.duckdb"
        else:
            base = Path(tempfile.mkdtemp(prefix="rankscope-read-"))
            self.dst = base / "snapshot.duckdb"
        self.base = base
        self.sig_file = self.dst.with_suffix(".sig")

    def current(self) -> bool:
        try:
            return self.kept and self.dst.exists() and self.sig_file.read_text() == _signature(
                self.src)  # fmt: skip
        except OSError:
            return False

    def take(self, strict: bool) -> float:
        """Copy the store and its WAL aside and replay the WAL into the copy; the copy's time.

        ``strict``: refuse a copy during which the writer changed either file (the
        caller tries again); the last try takes what DuckDB can open."""
        import duckdb

        if self.current():
            return self.dst.stat().st_mtime
        sig = _signature(self.src)
        tmp = Path(tempfile.mkdtemp(dir=self.base))
        try:
            shutil.copyfile(self.src, tmp / "snap.duckdb")
            wal = Path(str(self.src) + ".wal")
            if wal.exists():
                shutil.copyfile(wal, tmp / "snap.duckdb.wal")
            if strict and _signature(self.src) != sig:
                raise OSError("the store changed while it was copied")
            con = duckdb.connect(str(tmp / "snap.duckdb"))  # replays the WAL into the copy
            try:
                con.execute("CHECKPOINT")
            finally:
                con.close()
            os.replace(tmp / "snap.duckdb", self.dst)
            self.sig_file.write_text(sig)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return self.dst.stat().st_mtime

    def cleanup(self) -> None:
        if not self.kept:
            shutil.rmtree(self.base, ignore_errors=True)


def _waits(first_s: float, max_s: float) -> Iterator[float]:
    wait = first_s
    while True:
        yield wait
        wait = min(wait * 2, max_s)


@contextmanager
def read_connection(
    path: str | os.PathLike,
    *,
    attempts: int = ATTEMPTS,
    first_wait_s: float = FIRST_WAIT_S,
    max_wait_s: float = MAX_WAIT_S,
    snapshot_dir: str | os.PathLike | None = None,
) -> Iterator[ReadOnly]:
    """A read-only connection to ``path`` or to a snapshot of it, whoever holds it.

    Raises ``StoreError`` for a missing or unreadable file, ``StoreBusy`` when
    the lock stays held and no snapshot could be taken. Closed afterwards."""
    import duckdb

    src = Path(path)
    if not src.is_file():
        raise StoreError(f"{src}: no findings store here (run `rankscope replay TRACE --db {src}`"
                         " or `rankscope serve` first)")  # fmt: skip
    snaps = _Snapshots(src, snapshot_dir)
    waits = _waits(first_wait_s, max_wait_s)
    con, snapshot_t, last = None, None, None
    try:
        for attempt in range(attempts):
            try:
                con = _connect(src)
                break
            except (duckdb.IOException, duckdb.ConnectionException) as exc:
                last = exc
                if attempt == 0 and snaps.current():
                    break  # the writer changed nothing since the last copy: read it now
                time.sleep(next(waits))
        for attempt in range(attempts if con is None else 0):
            try:
                snapshot_t = snaps.take(strict=attempt < attempts - 1)
                con = _connect(snaps.dst)
                break
            except (duckdb.Error, OSError, StoreError) as exc:
                last = exc
                time.sleep(next(waits))
        if con is None:
            raise StoreBusy(f"{src} is held by a writing process and no consistent snapshot "
                            f"could be copied ({last}); try again in a moment")  # fmt: skip
        try:
            yield ReadOnly(con, snapshot_t)
        finally:
            con.close()
    finally:
        snaps.cleanup()


@contextmanager
def read_store(path: str | os.PathLike, **kw) -> Iterator[Store]:
    """A read-only ``Store`` of ``path``, whoever holds it (``kw``: ``read_connection``'s)."""
    with read_connection(path, **kw) as ro:
        store = Store(path, read_only=True, con=ro.con)
        store.snapshot_t = ro.snapshot_t
        yield store
