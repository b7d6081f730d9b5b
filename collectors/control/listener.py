"""Evict/recover control messages, received inside the training process.

A daemon thread reads ``<prefix>.control`` (every partition, no consumer
group: every rank sees every message, from the moment it started listening),
checks each message with ``control_auth.Verifier`` (unsigned, forged,
replayed and expired messages are rejected, counted and logged), keeps those
for this job, and queues them. Nothing happens on that thread: the queued
actions run in the training thread at the next step boundary, when the
collector calls ``at_step_boundary(step)``, so a policy never interrupts a
collective half way.

Who acts, and when (the contract):

- a message *affects* this rank when the rank is in ``ranks`` or its host is
  in ``hosts`` (an eviction takes the whole host, so every rank on it);
- ``on_action(callback)`` callbacks run for every accepted message of this
  job, affected or not, at the next step boundary (``immediate=True``: on
  the listener thread as soon as it arrives, e.g. to alert while the loop
  is hung); they receive a ``ControlAction`` with ``affects_me``;
- ``evict`` with policy ``raise`` (default): affected ranks raise
  ``RankEvicted`` from their next step boundary, so an elastic launcher
  (torchrun) restarts the job without the host; unaffected ranks carry on
  (their next collective fails and the launcher restarts them too);
- ``evict`` with ``exclude-file``: affected ranks append their host to the
  file (once per host, under a file lock) for the scheduler to read, e.g.
  Slurm ``--exclude``; training goes on;
- ``recover`` with ``rollback``: EVERY rank of the job calls the user's
  ``restore(last_good_step)`` at its next step boundary, where
  ``last_good_step = step - 1`` (the step before the incident began): a
  rollback of only the corrupted rank would leave the replicas disagreeing;
- policy ``none``: only the callbacks run.

Hostile input: every message is judged on its own and a malformed one (not
JSON, nested too deeply, too large, the wrong shape) is rejected and counted
in ``rejected``, never aborting the rest of the poll batch. Accepted nonces
are persisted per job and rank (``rankscope.collectors.control.seen``), so a
rank restarted by its launcher still refuses a captured message replayed to it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import queue
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

from rankscope.collectors.control.seen import SeenNonces, default_state_file
from rankscope.collectors.schema.control import ControlAuthConfig, Verifier, load_secret
from rankscope.collectors.schema.kafka import KafkaUrl

__all__ = [
    "ControlAction",
    "ControlListener",
    "ControlListenerConfig",
    "RankEvicted",
    "EVICT_POLICIES",
    "RECOVER_POLICIES",
    "start_listener",
]

log = logging.getLogger("rankscope.control")

MAX_MESSAGE_BYTES = 64 * 1024
"""A control message is a few hundred bytes; anything past this is refused unread."""
EVICT_POLICIES = ("raise", "exclude-file", "none")
RECOVER_POLICIES = ("rollback", "raise", "none")


@dataclass(frozen=True, slots=True)
class ControlAction:
    """One accepted control message, as this rank sees it."""

    job: str
    action: str
    ranks: tuple[int, ...]
    hosts: tuple[str, ...]
    step: int
    finding_id: str
    reason: str
    issued_t: float
    affects_me: bool


class RankEvicted(RuntimeError):
    """Raised from the step boundary of a rank that rankscope evicted."""

    def __init__(self, action: ControlAction) -> None:
        super().__init__(
            f"rankscope {action.action}: hosts {list(action.hosts)} ranks {list(action.ranks)} "
            f"(finding {action.finding_id}, step {action.step}): {action.reason}"
        )
        self.action = action


@dataclass(kw_only=True, slots=True)
class ControlListenerConfig:
    """What this rank listens to and how it reacts."""

    url: str
    """``kafka://`` URL of the cluster carrying ``<prefix>.control``."""
    job: str
    rank: int
    host: str = ""
    """This rank's host name; empty means ``socket.gethostname()``."""
    evict_policy: str = "raise"
    """``raise``, ``exclude-file`` or ``none``."""
    recover_policy: str = "none"
    """``rollback`` (needs ``restore``), ``raise`` or ``none``."""
    exclude_file: str | None = None
    """Where ``exclude-file`` appends evicted hosts, one a line."""
    max_age_s: float = 300.0
    """Older control messages are rejected as expired."""
    poll_timeout_s: float = 0.5
    """How long one poll of the topic waits; also bounds how long ``close`` takes."""
    state_file: str | None = None
    """Where accepted nonces persist across restarts; None: ``seen.default_state_file``."""

    def __post_init__(self) -> None:
        KafkaUrl.parse(self.url)  # raises ValueError with the reason
        if not self.job:
            raise ValueError("control listener: job must not be empty")
        if self.rank < 0:
            raise ValueError(f"control listener: rank {self.rank} is negative")
        if self.evict_policy not in EVICT_POLICIES:
            raise ValueError(f"evict_policy {self.evict_policy!r}; want one of {EVICT_POLICIES}")
        if self.recover_policy not in RECOVER_POLICIES:
            raise ValueError(
                f"recover_policy {self.recover_policy!r}; want one of {RECOVER_POLICIES}"
            )
        if self.evict_policy == "exclude-file" and not self.exclude_file:
            raise ValueError("evict_policy 'exclude-file' needs exclude_file")
        if self.max_age_s <= 0 or self.poll_timeout_s <= 0:
            raise ValueError("control listener: max_age_s and poll_timeout_s must be > 0")
        if not self.host:
            self.host = socket.gethostname()


class ControlListener:
    """Background reader of control messages for one rank (see the module docstring)."""

    def __init__(
        self,
        cfg: ControlListenerConfig,
        *,
        secret: bytes | str | None = None,
        restore: Callable[[int], object] | None = None,
    ) -> None:
        if cfg.recover_policy == "rollback" and restore is None:
            raise ValueError("recover_policy 'rollback' needs a restore(last_good_step) function")
        self.cfg = cfg
        self._url = KafkaUrl.parse(cfg.url)
        auth = ControlAuthConfig(max_age_s=cfg.max_age_s)
        self._verifier = Verifier(load_secret(secret), auth)
        self._seen = SeenNonces(cfg.state_file or default_state_file(cfg.job, cfg.rank),
                                horizon_s=auth.max_age_s + auth.clock_skew_s)  # fmt: skip
        self._verifier.seed(self._seen.load())
        self._restore = restore
        self._callbacks: list[Callable[[ControlAction], object]] = []
        self._immediate: list[Callable[[ControlAction], object]] = []
        self._pending: queue.SimpleQueue[ControlAction] = queue.SimpleQueue()
        self._stop = threading.Event()
        self.ready = threading.Event()
        """Set once the listener reads the topic: messages from then on are seen."""
        self.accepted: list[ControlAction] = []
        self.rejected: dict[str, int] = {}
        self._thread = threading.Thread(target=self._run, name="rankscope-control", daemon=True)

    def start(self) -> ControlListener:
        """Start reading the topic (idempotent); ``ready`` is set once it reads."""
        if not self._thread.is_alive() and not self._stop.is_set():
            try:
                self._thread.start()
            except RuntimeError:  # started before and already finished
                pass
        return self

    def on_action(self, callback: Callable[[ControlAction], object], *, immediate=False) -> None:
        (self._immediate if immediate else self._callbacks).append(callback)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.cfg.poll_timeout_s + 5.0)

    # -- training thread --

    def at_step_boundary(self, step: int) -> None:
        """Run the actions that arrived since the last boundary; may raise ``RankEvicted``."""
        evicted: ControlAction | None = None
        while True:
            try:
                act = self._pending.get_nowait()
            except queue.Empty:
                break
            for cb in self._callbacks:
                try:
                    cb(act)
                except Exception:  # a user callback must not kill the collector
                    log.exception("control callback %r failed", cb)
            policy = self.cfg.evict_policy if act.action == "evict" else self.cfg.recover_policy
            try:
                if policy == "raise" and act.affects_me:
                    evicted = evicted or act
                elif policy == "exclude-file" and act.affects_me:
                    self._exclude_host()
                elif policy == "rollback":
                    log.warning("rank %d rolls back to step %d: %s", self.cfg.rank,
                                act.step - 1, act)  # fmt: skip
                    self._restore(act.step - 1)
            except Exception:  # a failing policy is logged; training is not stopped by it
                log.exception("control policy %r failed for %s", policy, act)
        if evicted is not None:
            raise RankEvicted(evicted)

    def _exclude_host(self) -> None:
        path = self.cfg.exclude_file
        with open(path, "a+", encoding="utf-8") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                fh.seek(0)
                present = {line.strip() for line in fh}
                if self.cfg.host not in present:
                    fh.write(self.cfg.host + "\n")
                    fh.flush()
                    os.fsync(fh.fileno())
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    # -- listener thread --

    def _reject(self, reason: str, raw: bytes) -> None:
        key = reason.split(":", 1)[0]
        self.rejected[key] = self.rejected.get(key, 0) + 1
        log.warning("rejected control message (%s): %.200r", reason, raw)

    def handle(self, raw: bytes, *, now: float | None = None) -> ControlAction | None:
        """Check one raw message; queue and return the action when it is accepted.
        Never raises: whatever is wrong with the message is its rejection's reason."""
        try:
            return self._handle(raw, now)
        except Exception as exc:  # noqa: BLE001 - RecursionError, odd types: the message's fault
            self._reject(f"malformed: {type(exc).__name__}", raw if isinstance(raw, bytes) else b"")
            return None

    def handle_batch(self, values) -> int:
        """``handle`` each raw message of one poll in turn; returns how many were accepted."""
        return sum(self.handle(v) is not None for v in values)

    def _handle(self, raw: bytes, now: float | None) -> ControlAction | None:
        if raw is None or len(raw) > MAX_MESSAGE_BYTES:
            self._reject(f"malformed: empty or larger than {MAX_MESSAGE_BYTES} bytes", b"")
            return None
        try:
            msg = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            self._reject("malformed: not JSON", raw)
            return None
        except RecursionError:
            self._reject("malformed: nested too deeply", raw[:200])
            return None
        reason = self._verifier.check(msg, now=now)
        if reason:
            self._reject(reason, raw)
            return None
        if msg["job"] != self.cfg.job:
            return None  # authentic, but for another job
        self._seen.add(msg["nonce"], float(msg["issued_t"]), now)  # before acting on it
        act = ControlAction(
            job=msg["job"],
            action=msg["action"],
            ranks=tuple(msg["ranks"]),
            hosts=tuple(msg["hosts"]),
            step=int(msg["step"]),
            finding_id=str(msg["finding_id"]),
            reason=str(msg["reason"]),
            issued_t=float(msg["issued_t"]),
            affects_me=self.cfg.rank in msg["ranks"] or self.cfg.host in msg["hosts"],
        )
        self.accepted.append(act)
        for cb in self._immediate:
            try:
                cb(act)
            except Exception:
                log.exception("control callback %r failed", cb)
        self._pending.put(act)
        return act

    def _connect(self):
        from kafka import KafkaConsumer, TopicPartition

        consumer = KafkaConsumer(
            **self._url.client_kwargs(),
            group_id=None,
            enable_auto_commit=False,
            bootstrap_timeout_ms=2000,
            reconnect_backoff_max_ms=1000,
        )
        topic = self._url.topic("control")
        parts = None
        while not self._stop.is_set():
            parts = consumer.partitions_for_topic(topic)
            if parts:
                break
            self._stop.wait(1.0)  # the service creates the topic; wait for it
        if not parts:
            consumer.close()
            return None
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        consumer.assign(tps)
        consumer.seek_to_end(*tps)
        for tp in tps:
            consumer.position(tp)  # resolve now, so `ready` means "sees what comes next"
        return consumer

    def _run(self) -> None:
        consumer = None
        errors = 0
        while not self._stop.is_set():
            try:
                if consumer is None:
                    consumer = self._connect()
                    if consumer is None:
                        break
                    self.ready.set()
                batches = consumer.poll(timeout_ms=int(self.cfg.poll_timeout_s * 1000))
                for msgs in batches.values():
                    self.handle_batch(m.value for m in msgs)
            except Exception as exc:  # broker away: log once in a while, retry
                errors += 1
                if errors == 1 or errors % 50 == 0:
                    log.warning("control listener: %s (error %d); retrying", exc, errors)
                self._stop.wait(1.0)
        if consumer is not None:
            try:
                consumer.close()
            except Exception:
                pass


def start_listener(control, *, job: str, rank: int, host: str) -> ControlListener:
    """The running listener ``RankCollector.attach(control=...)`` asks for: a
    ``ControlListener``, a ``ControlListenerConfig``, or a ``kafka://`` URL (then the
    defaults: evict raises ``RankEvicted``, secret from ``$RANKSCOPE_CONTROL_SECRET``)."""
    if isinstance(control, str):
        control = ControlListenerConfig(url=control, job=job, rank=rank, host=host)
    if isinstance(control, ControlListenerConfig):
        control = ControlListener(control)
    if not isinstance(control, ControlListener):
        raise ValueError(
            f"control={control!r}: want a kafka:// URL, a ControlListenerConfig or a "
            "ControlListener"
        )
    return control.start()
