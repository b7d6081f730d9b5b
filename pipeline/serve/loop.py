"""``rankscope serve``: the online service loop over a Kafka consumer group.

One loop, one thread: poll ``<prefix>.telemetry`` and ``<prefix>.gpu``, decode
and validate, feed the engine, tick it, write what came out, and now and
then checkpoint and commit. One ``Engine`` per assigned partition number
(partition *i* of telemetry and gpu go to the same process, see
``rankscope.pipeline.bus.kafka``), so a partition's engine state moves with the
partition when the group rebalances and several ``serve`` processes split
the jobs.

Delivery (at least once, idempotent writes, so a crash loses and duplicates
nothing):

1. findings are upserted into DuckDB by ``finding_id`` as they come;
2. then published to ``<prefix>.findings``, and evict/recover verdicts as
   signed messages to ``<prefix>.control`` (once per finding and action,
   remembered in DuckDB);
3. every ``checkpoint_interval_s`` (and on shutdown) the engine state of
   each partition is saved with the offset to resume from, and only then the
   same offsets are committed to Kafka. Steps 1-3 run on a writer thread
   (``rankscope.pipeline.serve.writer``) in the order the loop hands them over, so the
   loop does not wait on the disk; the loop commits the offsets the writer
   reports written. The resume offset is the earliest
   message holding a record of a step the engine has not built yet: those
   steps are not in the saved state, so their records must come again.
   Records of steps already built are dropped as late on re-read. A
   rebalance writes nothing (the Kafka client calls back on its IO thread,
   which must not block): the partition's next owner resumes from its last
   checkpoint and rebuilds the same findings from the records after it.

Malformed messages (not JSON, not records) and records that break the schema
or its bounds go to ``<prefix>.deadletter`` and the DuckDB ``bad_records``
table with the reason; the rest of the batch goes on. A message that makes
the engine raise is retried once on its own, then dead-lettered, and the
offset moves on (``rankscope.pipeline.serve.guard``). SIGTERM/SIGINT finish the batch,
write, checkpoint, commit and return.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

import orjson
from rankscope.pipeline.bus.decode import COLUMNS_MIN_RECORDS, StepBatch
from rankscope.pipeline.bus.decode_pool import DecodePool, decode_outcome
from rankscope.pipeline.bus.kafka import KafkaBus
from rankscope.pipeline.engine.findings import Finding
from rankscope.pipeline.serve.align import GpuAligner, StreamClock
from rankscope.pipeline.serve.config import ServeConfig, ServeStats
from rankscope.pipeline.serve.db import ServeDb
from rankscope.pipeline.serve.guard import (
    engine_output,
    engine_state,
    feed_apart,
    misrouted,
    tick_guarded,
)
from rankscope.pipeline.serve.hooks import log_failed_commit, loop_gc, rebalance_listener
from rankscope.pipeline.serve.observe import ServeObserver
from rankscope.pipeline.serve.partition import PartitionState
from rankscope.pipeline.serve.writer import ServeWriter, WriteJob

__all__ = ["ServeConfig", "Service", "ServeStats"]

log = logging.getLogger("rankscope.serve")


def _dumps_or_none(rec) -> bytes | None:
    try:
        return orjson.dumps(rec)
    except TypeError:
        return None


SERVE_PENDING_STEPS = 256
"""Open steps per job ``serve`` holds while waiting for late ranks (the disorder it absorbs)."""


def default_engine_factory(detector_configs: dict | None = None):
    """serve's engine; ``detector_configs``: name -> Config (e.g. the hang monitor's
    crash and hang deadlines, ``rankscope serve --crash-within/--hang-within``)."""
    from rankscope.pipeline.engine.assemble import AssemblerConfig
    from rankscope.pipeline.engine.engine import Engine, EngineConfig

    asm = AssemblerConfig(clock="event", max_pending_steps=SERVE_PENDING_STEPS)
    return Engine(EngineConfig(assembler=asm), detector_configs=detector_configs)


class _InLoop:
    """Decoding without workers (``ServeConfig.decode_workers=0``)."""

    @staticmethod
    def outcomes(values, min_columns):
        return (decode_outcome(v, min_columns) for v in values)

    @staticmethod
    def start() -> None:
        return None

    @staticmethod
    def close() -> None:
        return None


_IN_LOOP = _InLoop()


class Service:
    """The consume-detect-store loop (see the module docstring)."""

    def __init__(self, cfg: ServeConfig, *, engine_factory=default_engine_factory) -> None:
        self.cfg = cfg
        self.bus = KafkaBus(cfg.bus)
        self.engine_factory = engine_factory
        self.topics = {k: self.bus.topic(k) for k in ("telemetry", "gpu")}
        self._align = GpuAligner(self.topics["telemetry"], self.topics["gpu"])
        self._clocks: dict[int, StreamClock] = {}
        self.stats = ServeStats()
        self._obs = ServeObserver(cfg, self.stats)  # logs, metrics, alerts
        self._stop = threading.Event()
        self._parts: dict[int, PartitionState] = {}
        self._db = ServeDb(cfg.db_path, share=cfg.share_db)
        self._consumer = None
        self._producer = None
        self._writer: ServeWriter | None = None
        self._announcer = None
        self._last_checkpoint = time.monotonic()
        self._pending_findings: list = []
        self._pending_control: list[dict] = []  # signed, not yet published
        self._last_store = time.monotonic()
        self._pending_dead: list[tuple] = []
        self._positions_checked = 0.0
        self._decoder = DecodePool(cfg.decode_workers) if cfg.decode_workers else _IN_LOOP

    def stop(self, *_args) -> None:
        """Ask the loop to finish its batch, write, commit and return (signal-safe)."""
        self._stop.set()

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)

    # -- setup -------------------------------------------------------------
    def _setup(self) -> None:
        from rankscope.pipeline.serve.control import ControlAnnouncer

        # the endpoint first: a port in use fails before joining the group
        self._obs.start(self.bus.url.redacted(), list(self.topics.values()), self._db)
        self.bus.ensure_topics(self.cfg.partitions)
        if self.cfg.control_secret is not None:
            with self._db.session() as db:
                sent = db.tables.announced()
            self._announcer = ControlAnnouncer(self.cfg.control_secret, announced=sent)
        else:
            log.warning("no control secret configured: evict/recover will not be announced")
        self._producer = self.bus.producer(linger_ms=5)
        self._writer = ServeWriter(self._db, self._producer, self.bus, group=self.cfg.group,
                                   stats=self.stats)  # fmt: skip
        self._writer.keep_log = self.cfg.measure_latency
        self.engine_factory()  # import the detectors now, not on the client's IO thread
        self._decoder.start()  # the workers import while the consumer joins its group
        session_ms = int(self.cfg.session_timeout_s * 1000)
        self._consumer = self.bus.consumer(
            (),
            group=self.cfg.group,
            max_poll_records=self.cfg.max_poll_messages,
            session_timeout_ms=session_ms,
            heartbeat_interval_ms=max(1000, session_ms // 5),
        )
        for topic in self.topics.values():  # metadata first: a join without it assigns nothing
            self._consumer.partitions_for_topic(topic)
        self._consumer.subscribe(list(self.topics.values()), listener=rebalance_listener(self))
        # One more metadata fetch, now that the subscription is known, so the client's
        # snapshot of the subscribed partitions is current before the first join. Else the
        # first join's leader re-joins at once, and kafka-python 3.0.12 can hang that
        # re-join for good when another process joins at the same moment (see
        # docs/kafka.md: two processes started together, one expelled).
        self._consumer.topics()

    def _assign(self, assigned) -> None:
        """Keep the partitions we had, seek new ones to their checkpoints.

        Runs on the Kafka client's IO thread, so it only reads a row; the engine
        state is loaded by the loop on first use. A partition assigned to us
        again keeps its engine: if the client re-reads from an older offset, the
        assembler drops records of steps it has built as late."""
        numbers = {tp.partition for tp in assigned}
        for pnum in [p for p in self._parts if p not in numbers]:
            del self._parts[pnum]  # gone to another process: it resumes from our checkpoint
        with self._db.session() as db:
            for tp in sorted(assigned, key=lambda tp: (tp.partition, tp.topic)):
                part = self._parts.get(tp.partition)
                if part is None:
                    part = self._parts[tp.partition] = PartitionState(self.engine_factory)
                elif tp.topic in part.next_offset:
                    continue  # ours before the rebalance, still ours
                saved = db.tables.load_checkpoint(self.cfg.group, tp.topic, tp.partition)
                if saved is not None:
                    if saved[1] and tp.topic == self.topics["telemetry"]:
                        part.saved_state = saved[1]
                    self._consumer.seek(tp, saved[0])
                    part.next_offset[tp.topic] = saved[0]
        self._align.assigned(self._consumer, numbers)
        self._obs.assigned(assigned)

    def _revoke(self, revoked) -> None:
        """Nothing is written here (the Kafka client's IO thread must not block) and
        nothing dropped yet: ``_assign`` keeps what comes back to us. A partition that
        goes to another process is resumed there from its last checkpoint, whose
        state and offset belong together, and the same findings are rebuilt from
        the records after it (idempotent writes)."""
        self._obs.revoked(revoked)

    # -- the loop ----------------------------------------------------------
    def run(self) -> ServeStats:
        t0 = time.monotonic()
        try:
            self._setup()
            with loop_gc():
                self._loop()
            self._write(force_checkpoint=True)
            self._writer.drain()
            self._commit_written(wait=True)
            self._writer.close()
            if self.stats._first is not None:
                end = self.stats._first + self.stats.busy_s
                lag = [done - end for sub, done in self._writer.write_log if sub >= end]
                self.stats.store_lag_s = lag[0] if lag else None
        finally:
            self.stats.seconds = time.monotonic() - t0
            self._close()
        return self.stats

    def _loop(self) -> None:
        last_msg = time.monotonic()
        while not self._stop.is_set():
            batch = self._consumer.poll(
                timeout_ms=int(self.cfg.poll_timeout_s * 1000),
                max_records=self.cfg.max_poll_messages,
            )
            now = time.time()
            self._align.update(self._consumer, self._parts)
            if batch:
                self._consume(batch, now)
                last_msg = time.monotonic()
            elif not self._parts:
                self._stop.wait(self.cfg.poll_timeout_s)  # unassigned: poll does not wait
            elif time.monotonic() - last_msg > 1.0:
                self._resolve_positions()
            for pnum, part in self._parts.items():
                self._found(part, tick_guarded(part, self._stream_now(pnum, now), self.stats), now)
                if self.cfg.measure_latency:
                    part.built_steps(time.time(), self.stats.step_latency_s)
            self._write()
            self._commit_written()
            self._obs.turn(self._align.lag, self._parts)
            if not self._parts:
                last_msg = time.monotonic()  # idle counts only while partitions are ours
            idle_exit = self.cfg.idle_exit_s
            if idle_exit is not None and time.monotonic() - last_msg > idle_exit:
                for part in self._parts.values():
                    self._found(part, part.engine.flush(), time.time())
                    part.dirty = True  # the flushed state and its offset go in the last checkpoint
                return

    def _stream_now(self, pnum: int, now: float) -> float:
        """The partition's engine clock (``align.StreamClock``: held still in a backlog)."""
        clock = self._clocks.get(pnum)
        if clock is None:
            clock = self._clocks[pnum] = StreamClock()
        lags = [self._align.lag.get((t, pnum)) for t in self.topics.values()]
        return clock(now, None if None in lags else sum(lags))

    def _resolve_positions(self) -> None:
        """Make sure every assigned partition has a fetch position.

        kafka-python 3 may leave positions unset after two quick rebalances at
        start-up (the first join often has no topic metadata yet), and then
        never fetches; asking for the position resolves it."""
        if time.monotonic() - self._positions_checked < 1.0:
            return
        self._positions_checked = time.monotonic()
        try:
            for tp in self._consumer.assignment():
                self._consumer.position(tp, timeout_ms=2000)
        except Exception as exc:  # broker away or a rebalance in between: try again later
            log.debug("resolving positions: %s", exc)

    def _consume(self, batch, now: float) -> None:
        telemetry = self.topics["telemetry"]
        if self.stats._first is None:
            self.stats._first = time.monotonic()
        # GPU samples first: a step built from this batch joins the samples up to its time
        for tp, msgs in sorted(batch.items(), key=lambda kv: kv[0].topic == telemetry):
            part = self._parts.get(tp.partition)
            if part is None:  # assignment we were not told about: start fresh
                part = self._parts[tp.partition] = PartitionState(self.engine_factory)
            good: list[dict] = []
            fed_from = 0  # index into msgs of the first message not yet fed
            pnow = self._stream_now(tp.partition, now)
            is_tel = tp.topic == telemetry
            outcomes = self._decoder.outcomes([m.value for m in msgs],
                                              COLUMNS_MIN_RECORDS if is_tel else 1 << 62)
            for k, (m, (batch, recs, bad, error)) in enumerate(zip(msgs, outcomes, strict=True)):
                if error is not None:
                    self._dead(tp, m.offset, -1, error, m.value)
                    continue
                start = len(good)
                good.extend(recs)
                if not is_tel:
                    bad.extend(misrouted(good, start))
                for idx, reason, rec in bad:
                    self._dead(tp, m.offset, idx, reason, _dumps_or_none(rec))
                if batch is not None:  # step records as columns: records before it go first
                    self._feed(tp, part, good, msgs[fed_from:k], pnow)
                    if is_tel:
                        part.note_batch(batch.job, batch.step, m.offset, now)
                    self._feed_columns(tp, part, batch, m, pnow)
                    good, fed_from = [], k + 1
                    continue
                if is_tel:
                    part.note_steps(good, start, m.offset, now)
                if len(good) >= self.cfg.feed_records or k == len(msgs) - 1:
                    self._feed(tp, part, good, msgs[fed_from : k + 1], pnow)
                    good, fed_from = [], k + 1
            if good:
                self._feed(tp, part, good, msgs[fed_from:], pnow)
            self.stats.messages += len(msgs)
            part.next_offset[tp.topic] = msgs[-1].offset + 1
            part.dirty = True
        self.stats.busy_s = time.monotonic() - self.stats._first

    def _feed(self, tp, part: PartitionState, good: list[dict], msgs, now: float) -> None:
        if not good:
            return
        try:
            found = part.engine.feed(good, now)
        except Exception:  # an engine bug must not stop the service: isolate the message
            log.exception("engine failed on a batch from %s; feeding its messages apart", tp)
            found, n = feed_apart(part, msgs, now, gpu_topic=tp.topic != self.topics["telemetry"],
                                  dead=lambda m, why: self._dead(tp, m.offset, -1, why, m.value))
            good = good[:n]  # what was fed: the counts below
        self.stats.count_records(tp.topic, tp.partition, len(good), "records")
        self._found(part, found, now)
        if self.cfg.measure_latency:
            part.built_steps(time.time(), self.stats.step_latency_s)

    def _feed_columns(self, tp, part: PartitionState, batch: StepBatch, msg, now: float) -> None:
        try:
            found = part.engine.feed_columns(batch.job, batch.step, batch.chunk, now)
        except Exception:  # an engine bug must not stop the service: retry it as records
            log.exception("engine failed on a batch from %s; feeding it as records", tp)
            found, batch.n = feed_apart(part, [msg], now, gpu_topic=False,
                                        dead=lambda m, why: self._dead(tp, m.offset, -1, why,
                                                                       m.value))  # fmt: skip
        self.stats.count_records(tp.topic, tp.partition, batch.n, "columns")
        self._found(part, found, now)
        if self.cfg.measure_latency:
            part.built_steps(time.time(), self.stats.step_latency_s)

    def _found(self, part: PartitionState, findings, now: float) -> None:
        if not findings:
            return
        self._obs.found(part, findings)  # logged, counted, alerted when new or escalated
        self._pending_findings.extend(findings)
        if self._announcer is not None:  # an action to announce makes the next write due
            self._pending_control.extend(self._announcer.messages(findings))
        self.stats.findings += len(findings)

    def _dead(self, tp, offset: int, idx: int, reason: str, value: bytes | None) -> None:
        self._obs.dead(tp, offset, idx, reason)  # logged and counted by class
        self._pending_dead.append((tp.topic, tp.partition, offset, idx, reason, value))

    def _write(self, *, force_checkpoint: bool = False) -> None:
        """Hand findings, dead letters, control messages and (when due) a checkpoint to
        the writer thread, which stores, publishes and flushes them in that order.

        Updated findings wait up to ``store_interval_s`` (a store costs a commit, so
        writing every loop turn would cap throughput); control messages, dead
        letters and checkpoints go at once, each after the findings before them."""
        mono = time.monotonic()
        due = force_checkpoint or mono - self._last_checkpoint >= self.cfg.checkpoint_interval_s
        store_due = mono - self._last_store >= self.cfg.store_interval_s
        if not (
            (self._pending_findings and store_due) or self._pending_control or self._pending_dead
            or due
        ):  # fmt: skip
            return
        self._last_store = mono
        latest = {f.finding_id: f for f in self._pending_findings}  # the last update wins
        job = WriteJob(
            findings=[Finding.from_dict(f.to_dict()) for f in latest.values()],  # snapshots
            dead=self._pending_dead,
            control=self._pending_control,
        )
        self._pending_findings, self._pending_dead, self._pending_control = [], [], []
        if due:
            job.checkpoints, job.commit = self._checkpoint_rows()
            for part in self._parts.values():
                scores, summaries = engine_output(part, self.stats)
                job.scores.extend(scores)
                job.jobs.extend(summaries)
            self._last_checkpoint = time.monotonic()
            self.stats.checkpoints += 1
        self._writer.submit(job)

    def _commit_written(self, *, wait: bool = False) -> None:
        """Commit the offsets of the checkpoints the writer has stored (the newest wins);
        without waiting for the broker's answer except on the way out."""
        merged: dict = {}
        for offsets in self._writer.take_commits():
            merged.update(offsets)
        if merged:
            self._commit(merged, wait=wait)

    def _commit(self, offsets, *, wait: bool) -> None:
        """Commit offsets to Kafka; a group rebalancing meanwhile defers it to the next
        checkpoint (nothing is lost: an owner resumes from the DuckDB checkpoint, whose
        offsets are at or past the last ones committed). A commit in flight while the
        loop goes on costs no round trip; if it fails, the next one covers it."""
        from kafka import errors as kerr

        try:
            if wait:
                self._consumer.commit(offsets)
            else:
                self._consumer.commit_async(offsets, callback=log_failed_commit)
        except (
            kerr.CommitFailedError, kerr.IllegalGenerationError, kerr.RebalanceInProgressError,
            kerr.UnknownMemberIdError,
        ) as exc:  # fmt: skip
            log.warning("offset commit deferred to the next checkpoint: %s", exc)

    def _checkpoint_rows(self):
        from kafka.structs import OffsetAndMetadata, TopicPartition

        telemetry = self.topics["telemetry"]
        rows, commit = [], {}
        for pnum, part in self._parts.items():
            state = None
            if part.dirty:
                state = engine_state(part, self.stats)
                if state is None:  # no checkpoint, no commit for it: retried next time
                    continue
            for topic in list(part.next_offset):
                off = part.resume_offset(topic, telemetry)
                if off is None:
                    continue
                if part.dirty or topic != telemetry:
                    rows.append((topic, pnum, off, state if topic == telemetry else None))
                commit[TopicPartition(topic, pnum)] = OffsetAndMetadata(off, "", -1)
            part.dirty = False
        return rows, commit

    def _close(self) -> None:
        self._decoder.close()
        try:
            self._obs.close()  # queued alerts get their drain time; before the store closes
        except Exception as exc:  # on the way out: log, never mask
            log.warning("closing alerts and metrics: %s", exc)
        if self._writer is not None:
            try:
                self._writer.close()  # a no-op after a clean run; else writes what it holds
            except Exception as exc:  # on the way out after another error: log, never mask
                log.warning("closing the serve writer: %s", exc)
        for client in (self._consumer, self._producer):
            if client is None:
                continue
            try:
                if client is self._consumer:
                    client.close(autocommit=False, timeout_ms=5000)  # offsets are committed
                else:
                    client.close(timeout=10)
            except Exception as exc:  # closing on the way out: log, never mask
                log.warning("closing Kafka client: %s", exc)
        self._db.close()
