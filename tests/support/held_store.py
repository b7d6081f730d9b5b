"""A real second process holding a DuckDB store for writing, as `serve` does.

It opens the store read-write, writes one job row that stays in the WAL (no
checkpoint), and holds the file lock until released: a reader in the test's
process meets DuckDB's lock and must go through a snapshot that replays the WAL.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

__all__ = ["HeldStore", "HELD_JOB"]

HELD_JOB = "live-job"

WRITER = textwrap.dedent("""
    import sys, time, pathlib
    from rankscope.pipeline.store import Store
    db, ready, release, job = sys.argv[1:5]
    s = Store(db)
    s.con.execute("SET checkpoint_threshold = '1GB'")  # keep the new rows in the WAL
    s.record_job({"job": job, "world": 4, "hosts": 1, "last_step": 7, "frames": 8,
                  "last_t": 1.0})
    pathlib.Path(ready).write_text("ok")
    while not pathlib.Path(release).exists():
        time.sleep(0.05)
    s.close()
""")


class HeldStore:
    """A second process holding ``db`` for writing until ``let_go()``."""

    def __init__(self, db: Path, tmp: Path, job: str = HELD_JOB) -> None:
        self.ready, self.release = tmp / "ready", tmp / "release"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(db), str(self.ready), str(self.release), job]
        )
        deadline = time.monotonic() + 60
        while not self.ready.exists():
            assert self.proc.poll() is None, "writer process died"
            assert time.monotonic() < deadline, "writer did not start"
            time.sleep(0.05)

    def let_go(self) -> None:
        self.release.write_text("go")
        self.proc.wait(timeout=30)
