"""The service's DuckDB access: the findings ``Store`` plus the service tables.

DuckDB lets one process write a file. ``share=False`` (default) keeps the
file open for the life of ``serve``; ``share=True`` opens it only for each
write and retries while another process holds it, so several ``serve``
processes of one consumer group can write one file (each write is short).
Sessions are serialized by a lock: the writer thread writes while the Kafka
client's IO thread may read a checkpoint (a rebalance), and one DuckDB
connection must not be used by two threads at once.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

from rankscope.pipeline.serve.tables import ServeTables
from rankscope.pipeline.store import Store, StoreError

__all__ = ["ServeDb", "DbSession"]


@dataclass(slots=True)
class _BadMessage:
    file: str
    line: str
    reason: str


class DbSession:
    """One open store and its service tables."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.tables = ServeTables(store.con)

    def write(self, *, findings, deadletters, control, scores, jobs, group, checkpoints) -> None:
        """Everything of one loop turn, findings first, checkpoints last.

        Findings commit on their own (the store's transaction); the rest goes in one
        transaction, so a turn costs at most two commits (each a WAL sync)."""
        self.store.write_turn(findings=findings)
        if not (deadletters or control or scores or jobs or checkpoints):
            return
        con = self.store.con
        con.execute("BEGIN TRANSACTION")
        try:
            bad = [
                _BadMessage(topic, f"{part}:{off}" + (f"#{idx}" if idx >= 0 else ""), reason)
                for topic, part, off, idx, reason, _value in deadletters
            ]
            for topic in {b.file for b in bad}:
                self.store.record_bad(topic, [b for b in bad if b.file == topic])
            self.store.write_turn(scores=scores, jobs=jobs, source="kafka")
            for msg in control:
                self.store.mark_delivered(msg["finding_id"], msg["action"], msg["issued_t"])
            self.tables.save_checkpoints(group, checkpoints)
            con.execute("COMMIT")
        except Exception:
            con.execute("ROLLBACK")
            raise


class ServeDb:
    def __init__(self, path: str, *, share: bool = False, lock_wait_s: float = 60.0) -> None:
        self.path = path
        self.share = share
        self.lock_wait_s = lock_wait_s
        self._session: DbSession | None = None
        self._lock = threading.Lock()
        if not share:
            self._session = DbSession(Store(path))

    def _open(self) -> DbSession:
        deadline = time.monotonic() + self.lock_wait_s
        while True:
            try:
                return DbSession(Store(self.path))
            except StoreError as exc:
                if "lock" not in str(exc).lower() or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    @contextlib.contextmanager
    def session(self):
        with self._lock:
            if self._session is not None:
                yield self._session
                return
            s = self._open()
            try:
                yield s
            finally:
                s.store.close()

    def close(self) -> None:
        with self._lock:
            if self._session is not None:
                self._session.store.close()
                self._session = None
