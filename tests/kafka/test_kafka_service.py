"""`rankscope publish` and `rankscope serve` against the real broker, as real processes."""

from __future__ import annotations

import ast
import signal
import time

import orjson
import pytest
from rankscope.collectors.schema.control import Verifier
from rankscope.pipeline.bus.kafka import KafkaBus, encode_records
from rankscope.pipeline.engine.engine import Engine
from rankscope.pipeline.store import Store
from rankscope.pipeline.traces.files import write_jsonl
from support.engine_synth import make_records
from support.kafka import (
    SECRET,
    consume_all,
    findings_in,
    group_lag,
    group_partitions,
    rankscope,
    wait_for,
)

pytestmark = pytest.mark.kafka


def _reference(records):
    eng = Engine()
    eng.feed(records)
    eng.flush()
    return {(f.finding_id, f.kind, tuple(f.ranks), f.first_step, f.action) for f in eng.findings()}


def _stored(db):
    return {
        (f["finding_id"], f["kind"], tuple(f["ranks"]), f["first_step"], f["action"])
        for f in findings_in(db)
    }


def _group(url: str) -> str:
    return url.rsplit("=", 1)[1] + "-serve"


def test_publish_serve_findings_control_and_dead_letters(kafka_url, procs, tmp_path):
    records = make_records(job="e2e", dp=8, tp=1, steps=50, ranks_per_host=2,
                           straggler=(5, 20, 2.0))  # fmt: skip
    write_jsonl(records, tmp_path / "trace.jsonl")
    pub = rankscope("publish", str(tmp_path / "trace.jsonl"), "--bus", kafka_url, "--batch", "8")
    procs.append(pub)
    out, err = pub.communicate(timeout=60)
    assert pub.returncode == 0, err
    assert f"published {len(records)} records" in out

    bus = KafkaBus(kafka_url)
    producer = bus.producer()
    junk = [b"{not json", b"42", encode_records([records[0], {**records[1], "rank": "one"}])]
    for value in junk:
        producer.send(bus.topic("telemetry"), key=b"e2e", value=value)
    producer.flush()
    producer.close()

    db = tmp_path / "f.duckdb"
    serve = rankscope("serve", "--bus", kafka_url, "--db", str(db), "--exit-when-idle", "2",
                      "--group", _group(kafka_url))  # fmt: skip
    procs.append(serve)
    _, err = serve.communicate(timeout=90)
    assert serve.returncode == 0, err
    assert _stored(db) == _reference(records)
    (f,) = findings_in(db)
    assert (f["kind"], f["ranks"], f["hosts"], f["action"]) == ("straggler", [5], ["h2"], "evict")

    published = [orjson.loads(m.value) for m in consume_all(kafka_url, "findings", expect=1)]
    assert f["finding_id"] in {p["finding_id"] for p in published}
    (ctl,) = [orjson.loads(m.value) for m in consume_all(kafka_url, "control", expect=1)]
    assert Verifier(SECRET.encode()).check(ctl) is None
    assert (ctl["action"], ctl["hosts"], ctl["step"]) == ("evict", ["h2"], 20)

    # three bad things: two whole messages and one record inside a good message
    dead = consume_all(kafka_url, "deadletter", expect=3)
    reasons = sorted(dict(m.headers)["reason"].decode() for m in dead)
    assert len(reasons) == 3
    assert any("not JSON" in r for r in reasons) and any("'rank'" in r for r in reasons)
    with Store(db, read_only=True) as st:
        bad = st.con.execute("SELECT source, location, reason FROM bad_records").fetchall()
    assert len(bad) == 3 and {b[0] for b in bad} == {bus.topic("telemetry")}


def test_killed_serve_restarts_without_losing_or_duplicating(kafka_url, procs, tmp_path):
    a = make_records(job="kill-a", dp=8, tp=1, steps=80, ranks_per_host=2, straggler=(3, 15, 2.0))
    b = make_records(job="kill-b", dp=8, tp=1, steps=80, ranks_per_host=2, digest_flip=(6, 50))
    records = sorted(a + b, key=lambda r: (r["step"], r["job"], r["rank"]))
    write_jsonl(records, tmp_path / "trace.jsonl")
    db = tmp_path / "f.duckdb"
    args = ("serve", "--bus", kafka_url, "--db", str(db), "--checkpoint-interval", "0.2",
            "--group", _group(kafka_url))  # fmt: skip

    serve = rankscope(*args)
    procs.append(serve)
    # 80 steps 0.2 s apart at 3x: the stream lasts about 5 s
    pub = rankscope("publish", str(tmp_path / "trace.jsonl"), "--bus", kafka_url,
                    "--batch", "8", "--rate", "3")  # fmt: skip
    procs.append(pub)
    wait_for(lambda: consume_all(kafka_url, "findings", expect=1, timeout_s=1), 40,
             "the first finding")  # fmt: skip
    assert pub.poll() is None, "the stream should still be flowing"
    serve.send_signal(signal.SIGKILL)  # mid-stream, no chance to write or commit
    serve.wait(timeout=10)
    assert pub.wait(timeout=60) == 0

    serve = rankscope(*args, "--exit-when-idle", "2")
    procs.append(serve)
    _, err = serve.communicate(timeout=90)
    assert serve.returncode == 0, err
    stored = _stored(db)
    assert stored == _reference(records)
    assert {k[1] for k in stored} == {"straggler", "sdc"}

    # SIGTERM: finish, write, commit, exit 0; a third run then has nothing left to read
    serve = rankscope(*args)
    procs.append(serve)
    time.sleep(3)
    serve.send_signal(signal.SIGTERM)
    _, err = serve.communicate(timeout=60)
    assert serve.returncode == 0, err
    assert "rankscope serve: 0 records" in err
    assert _stored(db) == stored


def test_two_serve_processes_split_the_jobs(kafka_url, procs, tmp_path):
    """Two processes of one group, two jobs on two partitions: each process serves one.

    Waits for real conditions, not times: the group stable with one telemetry
    partition per member before anything is published (a process that joins late
    would otherwise find the other holding both), and every record committed
    before both are stopped (together: one stopping first would hand its
    partition to the other, which is a rebalance, not a split). The two start
    at the same moment on purpose: that is what once hung a kafka-python group
    leader (see ``Service._setup`` and docs/kafka.md)."""
    from kafka.partitioner import murmur2

    def partition(job):
        return (murmur2(job.encode()) & 0x7FFFFFFF) % 2

    jobs = []
    for i in range(20):  # two job names that land on different partitions
        name = f"split-{i}"
        if not jobs or partition(name) != partition(jobs[0]):
            jobs.append(name)
        if len(jobs) == 2:
            break
    records = make_records(job=jobs[0], dp=8, tp=1, steps=40, ranks_per_host=2,
                           straggler=(1, 10, 2.0))  # fmt: skip
    records += make_records(job=jobs[1], dp=8, tp=1, steps=40, ranks_per_host=2,
                            straggler=(6, 10, 2.0))  # fmt: skip
    write_jsonl(records, tmp_path / "trace.jsonl")
    db = tmp_path / "shared.duckdb"
    group = _group(kafka_url)
    args = ("serve", "--bus", kafka_url, "--db", str(db), "--share-db", "--partitions", "2",
            "--group", group, "--checkpoint-interval", "0.5", "-v")  # fmt: skip
    servers = [rankscope(*args), rankscope(*args)]
    procs.extend(servers)
    seen = {}

    def split_up():
        g = seen["group"] = group_partitions(kafka_url, group)
        return g if g and sorted(g) == [[0], [1]] else None

    def caught_up():
        seen["lag"] = group_lag(kafka_url, group)
        return seen["lag"] == 0

    try:
        split = wait_for(split_up, 90, "both serve processes in the group, one partition each")
        pub = rankscope("publish", str(tmp_path / "trace.jsonl"), "--bus", kafka_url,
                        "--partitions", "2", "--batch", "8")  # fmt: skip
        procs.append(pub)
        assert pub.wait(timeout=60) == 0
        wait_for(caught_up, 90, "every record processed and committed")
    except AssertionError as exc:
        for s in servers:
            s.kill()
        tails = [s.communicate(timeout=30)[1][-3000:] for s in servers]
        raise AssertionError(f"{exc}; last seen {seen}; serve logs: {tails}") from None
    still = group_partitions(kafka_url, group)
    for s in servers:
        s.send_signal(signal.SIGTERM)
    logs = []
    for s in servers:
        _, err = s.communicate(timeout=60)
        assert s.returncode == 0, err
        logs.append(err)
    assert sorted(still or []) == sorted(split), ("a rebalance", [g[-4000:] for g in logs])
    stored = findings_in(db)
    assert {(f["job"], tuple(f["ranks"])) for f in stored} == {(jobs[0], (1,)), (jobs[1], (6,))}
    # each process processed the records of one partition (one job), all of them
    per_job = {job: sum(r["job"] == job for r in records) for job in jobs}
    served = []
    for log in logs:
        (line,) = [ln for ln in log.splitlines() if " rankscope serve: " in ln]  # a log line
        served.append(ast.literal_eval(line.split("records by partition ")[1]))
    assert sorted(map(sorted, served)) == [[0], [1]], served
    assert sorted(n for d in served for n in d.values()) == sorted(per_job.values())
