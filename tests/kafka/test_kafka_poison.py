"""Poison messages against the real broker and a real `rankscope serve` process: every case of
issue 17 that once stopped serve (and, the offset uncommitted, stopped every restart too)."""

from __future__ import annotations

import json

import pytest
from rankscope.pipeline.bus.kafka import KafkaBus, encode_records
from rankscope.pipeline.engine.engine import Engine
from rankscope.pipeline.store import Store
from support.engine_synth import make_records
from support.kafka import consume_all, findings_in, group_lag, rankscope

pytestmark = pytest.mark.kafka

U64_MAX = 2**64 - 1


def _key(f):
    return (f["finding_id"], f["kind"], tuple(f["ranks"]), f["first_step"], f["action"])


def _reference(records):
    eng = Engine()
    eng.feed(records)
    eng.flush()
    return {(f.finding_id, f.kind, tuple(f.ranks), f.first_step, f.action) for f in eng.findings()}


def _poison(records) -> list[tuple[bytes, int]]:
    """(message value, dead letters it must make) for each poison case of the issue."""
    r = records[8 * 12]  # a genuine record of step 12, as a template
    thirty = json.dumps({**r, "step": 0}).replace('"step": 0', '"step": ' + "1" * 30)
    gpu = {"v": 1, "type": "gpu", "job": r["job"], "host": r["host"], "gpu": 0, "t": r["t"],
           "temp_c": 55.0}  # fmt: skip
    return [
        (json.dumps({**r, "step": U64_MAX}).encode(), 1),  # DuckDB ConversionException once
        (thirty.encode(), 1),  # TypeError: Integer exceeds 64-bit range once
        (encode_records([gpu]), 0),  # KeyError: 'step' in note_steps once; now taken
        (encode_records([{**r, "step": 2**62}]), 0),  # valid: held, then dropped as "ahead"
        (json.dumps([records[8 * 20], 5, records[8 * 20 + 1]]).encode(), 1),  # one element
        (encode_records([{**r, "world": 2**20, "rank": 2**20 - 1 - i} for i in range(3)]), 3),
    ]


def _serve(kafka_url, db, group, procs):
    serve = rankscope("serve", "--bus", kafka_url, "--db", str(db), "--exit-when-idle", "2",
                      "--group", group, "--checkpoint-interval", "0.5")  # fmt: skip
    procs.append(serve)
    _, err = serve.communicate(timeout=120)
    return serve.returncode, err


def test_poison_messages_cost_only_themselves(kafka_url, procs, tmp_path):
    records = make_records(job="poison", dp=8, tp=1, steps=40, ranks_per_host=2,
                           straggler=(5, 15, 2.0))  # fmt: skip
    nan_job = make_records(job="nan", dp=4, tp=1, steps=10, ranks_per_host=2)
    for rec in nan_job:
        rec["lr"] = float("nan")  # Python's json writes the bare NaN token
    bus = KafkaBus(kafka_url)
    bus.ensure_topics(1)
    producer = bus.producer()
    tel = bus.topic("telemetry")
    poison = _poison(records)
    for step in range(40):
        producer.send(tel, key=b"poison", value=encode_records(records[8 * step : 8 * step + 8]))
        if step == 12:
            for value, _n in poison:
                producer.send(tel, key=b"poison", value=value)
    for step in range(10):
        producer.send(tel, key=b"nan", value=json.dumps(nan_job[4 * step : 4 * step + 4]).encode())
    producer.send(bus.topic("gpu"), key=b"poison", value=encode_records([records[0]]))
    producer.flush()
    producer.close()

    db = tmp_path / "f.duckdb"
    group = "poison-serve"
    rc, err = _serve(kafka_url, db, group, procs)
    assert rc == 0, err[-3000:]
    assert {_key(f) for f in findings_in(db)} == _reference(records + nan_job)
    assert group_lag(kafka_url, group) == 0  # the offsets moved past every poison message

    want = sum(n for _v, n in poison) + 1  # + the step record on the gpu topic
    dead = consume_all(kafka_url, "deadletter", expect=want)
    reasons = [dict(m.headers)["reason"].decode() for m in dead]
    assert len(reasons) == want, reasons
    assert sum("64-bit" in r for r in reasons) == 2
    assert sum("world 1048576 outside" in r for r in reasons) == 3
    assert any("array element 1 is a int" in r for r in reasons)
    assert any("belongs on telemetry" in r for r in reasons)
    with Store(db, read_only=True) as st:
        jobs = {j["job"]: j for j in st.list_jobs()}
        assert st.count("bad_records") == want
    assert jobs["poison"]["last_step"] == 39 and jobs["poison"]["frames"] == 40
    assert jobs["poison"]["world"] == 8
    assert jobs["nan"]["frames"] == 10  # arrays with NaN literals kept whole

    # the restart reads none of it again: no new dead letters, nothing more to do
    rc, err = _serve(kafka_url, db, group, procs)
    assert rc == 0, err[-3000:]
    again = consume_all(kafka_url, "deadletter", expect=want + 1, timeout_s=5)
    assert len(again) == want, [dict(m.headers)["source"] for m in again]
    assert {_key(f) for f in findings_in(db)} == _reference(records + nan_job)


class _BuggyEngine(Engine):
    """A wall-clock engine with a bug on one record shape: what an engine bug not found
    yet looks like to the service (the bounded retry must not depend on knowing it)."""

    def __init__(self):
        from rankscope.pipeline.engine.assemble import AssemblerConfig
        from rankscope.pipeline.engine.engine import EngineConfig

        super().__init__(EngineConfig(assembler=AssemblerConfig(clock="wall")))

    def feed(self, records, now=None):
        if any(r.get("tokens") == 13 for r in records):
            raise ZeroDivisionError("a bug")
        return super().feed(records, now)


def test_a_message_the_engine_cannot_process_is_dead_lettered_once(kafka_url, tmp_path):
    from rankscope.pipeline.serve.loop import ServeConfig, Service

    records = make_records(job="bug", dp=4, tp=1, steps=30, ranks_per_host=2)
    bus = KafkaBus(kafka_url)
    bus.ensure_topics(1)
    producer = bus.producer()
    tel = bus.topic("telemetry")
    for step in range(30):
        batch = records[4 * step : 4 * step + 4]
        if step == 10:
            batch = [{**r, "tokens": 13} for r in batch]
        producer.send(tel, key=b"bug", value=encode_records(batch))
    producer.flush()
    producer.close()

    def run():
        cfg = ServeConfig(bus=kafka_url, db_path=str(tmp_path / "s.duckdb"), group="bug-serve",
                          idle_exit_s=2.0, checkpoint_interval_s=0.5, partitions=1)  # fmt: skip
        return Service(cfg, engine_factory=_BuggyEngine).run()

    stats = run()  # once: the exception went up and out of serve, every restart again
    assert stats.deadletters == 1 and stats.messages == 30
    assert group_lag(kafka_url, "bug-serve") == 0
    (dead,) = consume_all(kafka_url, "deadletter", expect=1)
    assert dict(dead.headers)["reason"] == b"engine error: ZeroDivisionError: a bug"
    with Store(tmp_path / "s.duckdb", read_only=True) as st:
        (job,) = st.list_jobs()
    assert job["frames"] == 29 and job["last_step"] == 29
    again = run()  # the restart does not meet it again
    assert again.deadletters == 0 and again.messages == 0
