"""Helpers for the tests against the real broker (``scripts/kafka up``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.paths import ROOT

SECRET = "kafka-test-secret-0123456789"


def bootstrap() -> str:
    addr = os.environ.get("RANKSCOPE_KAFKA_BOOTSTRAP")
    if addr:
        return addr
    f = ROOT / ".kafka" / "bootstrap"
    if not f.is_file():
        pytest.skip("no Kafka broker: run `scripts/kafka up` (make test does)")
    return f.read_text().strip()


def consume_all(url: str, kind: str, *, expect: int, timeout_s: float = 20.0, idle_s=None):
    """Every message of one topic (from the start) once ``expect`` arrived, time is up,
    or (with ``idle_s``) nothing more came for that long."""
    from kafka import KafkaConsumer, TopicPartition
    from rankscope.pipeline.bus.kafka import KafkaBus

    bus = KafkaBus(url)
    c = KafkaConsumer(**bus.url.client_kwargs(), group_id=None, enable_auto_commit=False)
    try:
        deadline = time.monotonic() + timeout_s
        parts = None
        while not parts and time.monotonic() < deadline:
            parts = c.partitions_for_topic(bus.topic(kind))
            if not parts:
                time.sleep(0.2)
        if not parts:
            return []
        tps = [TopicPartition(bus.topic(kind), p) for p in sorted(parts)]
        c.assign(tps)
        c.seek_to_beginning(*tps)
        out = []
        last = time.monotonic()
        while len(out) < expect and time.monotonic() < deadline:
            for msgs in c.poll(timeout_ms=200).values():
                out.extend(msgs)
                last = time.monotonic()
            if idle_s is not None and out and time.monotonic() - last > idle_s:
                break
        return out
    finally:
        c.close()


def rankscope(*args: str, env: dict | None = None, **kw) -> subprocess.Popen:
    """Start ``rankscope ARGS`` as a real process (stderr captured)."""
    full_env = {**os.environ, "RANKSCOPE_CONTROL_SECRET": SECRET, **(env or {})}
    return subprocess.Popen(
        [sys.executable, "-m", "rankscope.pipeline.cli", *args],
        cwd=ROOT,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def wait_for(pred, timeout_s: float, what: str, step_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(step_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def findings_in(db: Path) -> list[dict]:
    """Findings of a store another process may be writing (retry while it is locked)."""
    from rankscope.pipeline.store import Store, StoreError

    if not db.exists():
        return []
    for _ in range(50):
        try:
            with Store(db, read_only=True) as st:
                return st.list_findings()
        except StoreError:
            time.sleep(0.1)
    return []


def group_partitions(url: str, group: str, kind: str = "telemetry") -> list[list[int]] | None:
    """Per member of a *stable* consumer group, the partitions of ``kind`` it holds
    (as the broker's group coordinator says); None while the group is not stable."""
    from kafka import KafkaAdminClient
    from rankscope.pipeline.bus.kafka import KafkaBus

    bus = KafkaBus(url)
    admin = KafkaAdminClient(**bus.url.client_kwargs())
    try:
        desc = admin.describe_groups([group]).get(group) or {}
    finally:
        admin.close()
    if desc.get("error") or desc.get("group_state") != "Stable":
        return None
    out = []
    for member in desc.get("members") or []:
        assigned = (member.get("member_assignment") or {}).get("assigned_partitions") or []
        out.append(sorted(p for a in assigned if a["topic"] == bus.topic(kind)
                          for p in a["partitions"]))  # fmt: skip
    return out


def group_lag(url: str, group: str, kind: str = "telemetry") -> int | None:
    """Messages of ``kind`` not yet committed by ``group`` (None before any commit)."""
    from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition
    from rankscope.pipeline.bus.kafka import KafkaBus

    bus = KafkaBus(url)
    admin = KafkaAdminClient(**bus.url.client_kwargs())
    c = KafkaConsumer(**bus.url.client_kwargs(), group_id=None)
    try:
        committed = {
            tp: om.offset
            for tp, om in admin.list_group_offsets({group: None}).get(group, {}).items()
            if tp.topic == bus.topic(kind)
        }
        parts = c.partitions_for_topic(bus.topic(kind)) or set()
        ends = c.end_offsets([TopicPartition(bus.topic(kind), p) for p in parts])
    finally:
        c.close()
        admin.close()
    if not committed:
        return None
    return sum(end - max(committed.get(tp, 0), 0) for tp, end in ends.items())


class StderrLines:
    """The stderr lines of a running process, read on a thread as they come."""

    def __init__(self, proc: subprocess.Popen) -> None:
        import threading

        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(proc.stderr,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.append(line.rstrip("\n"))

    def having(self, text: str) -> list[str]:
        return [ln for ln in list(self.lines) if text in ln]

    def done(self, timeout_s: float = 30.0) -> list[str]:
        """Every line, once the process closed its stderr (call after it exits)."""
        self._thread.join(timeout_s)
        return list(self.lines)
