"""Reading a store another process is writing: a read-only attach with retry, then a snapshot.

DuckDB lets one process hold a file for writing and then refuses every other
open, read-only too; ``rankscope serve`` (without ``--share-db``) holds its
store for its whole life. So a reading command first tries a read-only attach
a few times with doubling waits (``serve --share-db`` lets go between writes),
and when the lock stays held reads a copy: the file and its WAL copied aside,
the WAL replayed into the copy, the copy opened read-only. A copy torn by a
write during it fails DuckDB's checksums on open and is taken again. The
caller learns whether it reads a snapshot (``Store.snapshot_t``) to say so.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rankscope.pipeline.store import Store, StoreError

__all__ = ["read_store", "is_lock_message"]

ATTEMPTS = 4
FIRST_WAIT_S = 0.05
SNAPSHOT_TRIES = 3


def is_lock_message(exc: BaseException) -> bool:
    msg = str(exc).lower()
    return "lock" in msg or "different configuration" in msg


def _signature(src: Path) -> tuple:
    out = []
    for p in (src, Path(str(src) + ".wal")):
        try:
            st = p.stat()
            out.append((st.st_mtime_ns, st.st_size))
        except FileNotFoundError:
            out.append(None)
    return tuple(out)


def _snapshot(src: Path, into: Path, strict: bool) -> Path:
    import duckdb

    sig = _signature(src)
    dst = into / "snapshot.duckdb"
    shutil.copyfile(src, dst)
    wal = Path(str(src) + ".wal")
    if wal.exists():
        shutil.copyfile(wal, Path(str(dst) + ".wal"))
    if strict and _signature(src) != sig:
        raise OSError("the store changed while it was copied")
    con = duckdb.connect(str(dst))  # replays the WAL into the copy
    try:
        con.execute("CHECKPOINT")
    finally:
        con.close()
    return dst


@contextmanager
def read_store(path: str | os.PathLike) -> Iterator[Store]:
    """A read-only ``Store`` of ``path``, whoever holds it (closed afterwards)."""
    src = Path(path)
    wait = FIRST_WAIT_S
    last: StoreError | None = None
    for _ in range(ATTEMPTS):
        try:
            store = Store(src, read_only=True)
        except StoreError as exc:
            if not is_lock_message(exc):
                raise
            last = exc
            time.sleep(wait)
            wait *= 2
            continue
        store.snapshot_t = None
        try:
            yield store
        finally:
            store.close()
        return
    tmp = Path(tempfile.mkdtemp(prefix="rankscope-read-"))
    try:
        for i in range(SNAPSHOT_TRIES):
            try:
                snap = _snapshot(src, tmp, strict=i < SNAPSHOT_TRIES - 1)
                store = Store(snap, read_only=True)
                break
            except (OSError, StoreError) as exc:
                last = StoreError(f"{src}: held by another process, and a snapshot failed: {exc}")
                for p in tmp.iterdir():
                    p.unlink()
        else:
            raise last
        store.snapshot_t = time.time()
        try:
            yield store
        finally:
            store.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
