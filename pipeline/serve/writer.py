"""The service's writer thread: DuckDB writes and what is published after them.

Why a thread: a store is a DuckDB commit (a WAL sync), a checkpoint writes
megabytes of engine state, and the findings, control and dead-letter messages
are published after their write; done in the consumer loop, that left it
waiting on the disk for about 40% of its time. The loop now hands each turn's
output over as a ``WriteJob`` and goes on decoding and detecting. DuckDB and
the producer's sends release the GIL, so on a second core the write costs
the loop almost nothing.

Order and delivery are those of ``rankscope.pipeline.serve.loop``: jobs are written one
after the other in the order given, each job's findings before its dead
letters, scores and checkpoint, and its messages published only after its
write. The offsets of a checkpoint are handed back (``take_commits``) only
once the checkpoint is written and the producer flushed; the loop commits
them, since a Kafka consumer must stay on one thread. The queue is bounded
(``depth`` jobs), so a slow disk slows the loop instead of growing memory.
A write that fails is tried again piece by piece (``_write_apart``): a
finding, dead letter, score batch or job row that fails alone is dropped with
a log line and published to the dead-letter topic (one bad value must not stop
the service); only when the checkpoint itself cannot be written is the
failure raised in the loop at its next ``submit``, as it would have been
inline.

Everything handed over must be a snapshot the loop no longer changes:
findings are copied (``Finding.from_dict(f.to_dict())``), the engine state
is already JSON text, score rows are fresh arrays.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from rankscope.pipeline.serve.observe import action_sent

__all__ = ["WriteJob", "ServeWriter"]

log = logging.getLogger("rankscope.serve")


@dataclass(slots=True)
class WriteJob:
    """One loop turn's output, written in one go (see ``DbSession.write``)."""

    findings: list = field(default_factory=list)
    dead: list = field(default_factory=list)
    """``(topic, partition, offset, index, reason, value)`` per dead letter."""
    control: list = field(default_factory=list)
    """Signed control messages to publish after the findings are stored."""
    scores: list = field(default_factory=list)
    jobs: list = field(default_factory=list)
    checkpoints: list = field(default_factory=list)
    """``(topic, partition, next_offset, engine_state_json)`` rows."""
    commit: dict | None = None
    """Offsets to commit once the checkpoint is written; None: no checkpoint in this job."""
    submitted: float = 0.0
    """``time.monotonic()`` at ``submit`` (benchmarks: how far the store lags)."""


class ServeWriter:
    """Writes ``WriteJob``\\ s in order on its own thread (see the module docstring)."""

    def __init__(self, db, producer, bus, *, group: str, stats, depth: int = 2) -> None:
        self._db = db
        self._producer = producer
        self._bus = bus
        self._group = group
        self._stats = stats
        self._jobs: queue.Queue[WriteJob | None] = queue.Queue(maxsize=depth)
        self._done_lock = threading.Lock()
        self._commits: list[dict] = []
        self._delivered: list[dict] = []  # control messages sent, not yet marked in DuckDB
        self._error: BaseException | None = None
        self._idle = threading.Event()
        self._idle.set()
        self._pending = 0
        self.write_log: list[tuple[float, float]] = []
        """``(submitted, written)`` monotonic times per job (kept only with ``keep_log``)."""
        self.keep_log = False
        self._thread = threading.Thread(target=self._run, name="rankscope-serve-writer",
                                        daemon=True)  # fmt: skip
        self._thread.start()

    # -- the loop's side ---------------------------------------------------
    def submit(self, job: WriteJob) -> None:
        """Queue a job; waits while ``depth`` jobs are queued. Raises a failed write's error."""
        self._raise()
        job.submitted = time.monotonic()
        with self._done_lock:
            self._pending += 1
            self._idle.clear()
        while True:
            try:
                self._jobs.put(job, timeout=0.5)
                return
            except queue.Full:
                self._raise()

    def take_commits(self) -> list[dict]:
        """Offsets of checkpoints written since the last call, oldest first."""
        self._raise()
        with self._done_lock:
            out, self._commits = self._commits, []
        return out

    def drain(self, timeout_s: float = 120.0) -> None:
        """Wait until every submitted job is written (and published)."""
        deadline = time.monotonic() + timeout_s
        while not self._idle.wait(0.2):
            self._raise()
            if time.monotonic() > deadline:
                raise TimeoutError(f"serve writer: jobs not written within {timeout_s} s")
        self._raise()

    def close(self) -> None:
        """Write what is queued, mark the last control messages delivered, stop the thread."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()
        if self._delivered and self._error is None:
            with self._db.session() as db:
                db.write(findings=[], deadletters=[], control=self._delivered, scores=[],
                         jobs=[], group=self._group, checkpoints=[])  # fmt: skip
            self._delivered = []
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"serve writer failed: {self._error}") from self._error

    # -- the thread ---------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if self._error is None:
                try:
                    try:
                        t0 = time.perf_counter()
                        self._write(job)
                        self._stats.observe_write(time.perf_counter() - t0,
                                                  checkpoint=bool(job.checkpoints))
                    except Exception as exc:
                        log.warning("serve write failed (%s); writing it piece by piece", exc)
                        self._write_apart(job)
                except BaseException as exc:  # handed to the loop, which stops serving
                    log.exception("serve writer failed")
                    self._error = exc
            with self._done_lock:
                self._pending -= 1
                if self.keep_log:
                    self.write_log.append((job.submitted, time.monotonic()))
                if self._pending == 0:
                    self._idle.set()

    def _write(self, job: WriteJob) -> None:
        delivered, self._delivered = self._delivered, []
        with self._db.session() as db:
            db.write(
                findings=job.findings, deadletters=job.dead, control=delivered,
                scores=job.scores, jobs=job.jobs, group=self._group,
                checkpoints=job.checkpoints,
            )  # fmt: skip
        self._publish(job)
        if job.commit is not None:
            if self._producer is not None:
                self._producer.flush(timeout=30)
            with self._done_lock:
                self._commits.append(job.commit)

    def _write_apart(self, job: WriteJob) -> None:
        """Each piece of ``job`` on its own; pieces that fail alone are dropped and
        dead-lettered. The checkpoint goes last and its failure is raised."""
        pieces = [WriteJob(findings=[f]) for f in job.findings]
        pieces += [WriteJob(dead=[d]) for d in job.dead]
        pieces += [WriteJob(scores=[sc]) for sc in job.scores]
        pieces += [WriteJob(jobs=[j]) for j in job.jobs]
        pieces.append(WriteJob(control=job.control))
        for piece in pieces:
            try:
                self._write(piece)
            except Exception as exc:  # this piece is the poison: drop it, say so
                self._stats.dead_letter(f"store: {exc}")
                what = piece.findings or piece.dead or piece.scores or piece.jobs
                log.error("dropped an unwritable item (%s): %r", exc, what)
                if self._producer is not None:
                    self._producer.send(self._bus.topic("deadletter"), value=repr(what)[
                        :100_000].encode(), headers=[("reason", f"store: {exc}".encode()[:1000]),
                                                     ("source", b"serve-writer")])  # fmt: skip
        self._write(WriteJob(checkpoints=job.checkpoints, commit=job.commit))

    def _publish(self, job: WriteJob) -> None:
        from rankscope.pipeline.bus.kafka import encode_records

        if not (job.findings or job.control or job.dead) or self._producer is None:
            return  # (no producer: a writer that only stores)
        topic = self._bus.topic
        send = self._producer.send
        for f in job.findings:
            send(topic("findings"), key=f.job.encode(), value=f.to_json())
        for msg in job.control:
            send(topic("control"), key=msg["job"].encode(), value=encode_records([msg]))
            self._delivered.append(msg)
            action_sent(self._stats, msg, topic("control"))
        for src, part, off, idx, reason, value in job.dead:
            headers = [
                ("reason", reason.encode()[:1000]),
                ("source", f"{src}:{part}:{off}:{idx}".encode()),
            ]
            send(topic("deadletter"), value=value or b"", headers=headers)
