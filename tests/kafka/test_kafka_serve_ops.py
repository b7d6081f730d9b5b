"""What an operator sees of a real `serve` on the real broker: its log lines (text and
JSON), its Prometheus endpoint scraped over HTTP, and its alert webhooks (real HTTP
servers on 127.0.0.1 that fail, time out, then answer), after publishing faulty
sample traces; and no client warning at start."""

from __future__ import annotations

import logging
import re
import signal
from collections import Counter

import orjson
import pytest
from rankscope.pipeline.bus.kafka import KafkaBus
from support.kafka import StderrLines, findings_in, rankscope, wait_for
from support.metrics import by_label, scrape
from support.paths import SAMPLE_TRACES
from support.webhook import Receiver

pytestmark = pytest.mark.kafka

TRACES = [SAMPLE_TRACES / "straggler-1.6x", SAMPLE_TRACES / "nonfinite"]
RECORDS = 3680  # step and beat records of the two traces
KAFKA_WARNING = re.compile(r"\bkafka[.\w]* (WARNING|ERROR)\b|Idempotence")


def _publish(url: str, procs) -> None:
    pub = rankscope("publish", *map(str, TRACES), "--bus", url)
    procs.append(pub)
    out, err = pub.communicate(timeout=60)
    assert pub.returncode == 0, err
    assert "Idempotence" not in err and f"published {RECORDS} records" in out


def _stop(serve, lines: StderrLines) -> list[str]:
    serve.send_signal(signal.SIGTERM)
    assert serve.wait(timeout=60) == 0, "\n".join(lines.lines[-40:])
    return lines.done()


def test_text_log_says_start_partitions_findings_actions_progress(kafka_url, procs, tmp_path):
    db = tmp_path / "f.duckdb"
    group = kafka_url.rsplit("=", 1)[1] + "-serve"
    serve = rankscope("serve", "--bus", kafka_url, "--db", str(db), "--group", group,
                      "--progress-interval", "1")  # fmt: skip
    procs.append(serve)
    lines = StderrLines(serve)
    _publish(kafka_url, procs)
    # Two progress lines at least: on a loaded host the first one may already come
    # after the last record, and the next is a second later (serve says it while idle).
    wait_for(lambda: len(lines.having("action sent:")) == 2
             and lines.having(f"({RECORDS:,} in all), lag 0 messages")
             and len(lines.having(" progress: ")) >= 2, 60,
             "both actions sent and two progress lines, one after the last record")  # fmt: skip
    log = _stop(serve, lines)
    text = "\n".join(log)
    assert not KAFKA_WARNING.search(text), text

    prefix = kafka_url.rsplit("=", 1)[1]
    (start,) = [ln for ln in log if " serving " in ln]
    assert f"kafka://{kafka_url[8:].split('?')[0]}?topic_prefix={prefix}" in start
    assert f"as group {group} into {db}" in start and "metrics off" in start
    assert f"partitions owned: {prefix}.gpu [0, 1, 2, 3]; {prefix}.telemetry [0, 1, 2, 3]" in text
    stored = {f["finding_id"]: f for f in findings_in(db)}
    assert {f["action"] for f in stored.values()} == {"evict", "recover"}
    for fid, f in stored.items():
        (line,) = [ln for ln in log if f"finding {fid}: " in ln]
        assert (f"{f['kind']} on ranks {f['ranks']} (hosts {','.join(f['hosts'])}) of job "
                f"{f['job']} from step {f['first_step']}, detected at step "
                f"{f['detected_step']}, action {f['action']}") in line  # fmt: skip
        (sent,) = [ln for ln in log if "action sent:" in ln and f"(finding {fid})" in ln]
        assert f"{f['action']} ranks {f['ranks']}" in sent and f"{prefix}.control" in sent
    progress = [ln for ln in log if " progress: " in ln]
    assert len(progress) >= 2 and "1 open incidents, 2 findings, 0 dead letters" in progress[-1]
    assert any(" rankscope serve: 3680 records" in ln for ln in log)


def test_json_log_metrics_and_alerts_once_across_a_restart(kafka_url, procs, tmp_path):
    flaky = Receiver(["503", "503", "200"])  # fails the first tries, then answers
    slow = Receiver(["hang"], hang_s=30)  # the first try never gets an answer
    try:
        _json_metrics_alerts(kafka_url, procs, tmp_path, flaky, slow)
    finally:
        flaky.close()
        slow.close()


def _serve_json(url, db, group, hooks, procs):
    serve = rankscope("serve", "--bus", url, "--db", str(db), "--group", group,
                      "--log-format", "json", "--progress-interval", "1", "--metrics-port", "0",
                      *[a for h in hooks for a in ("--alert-webhook", h.url)],
                      "--alert-timeout", "1")  # fmt: skip
    procs.append(serve)
    return serve, StderrLines(serve)


def _events(lines: list[str]) -> list[dict]:
    out = [orjson.loads(ln) for ln in lines]  # every line is one JSON object
    assert all(list(e)[:5] == ["ts", "level", "logger", "event", "msg"] for e in out)
    return out


def _json_metrics_alerts(url, procs, tmp_path, flaky, slow):
    db = tmp_path / "f.duckdb"
    group = url.rsplit("=", 1)[1] + "-serve"
    serve, lines = _serve_json(url, db, group, (flaky, slow), procs)
    _publish(url, procs)
    bus = KafkaBus(url)
    producer = bus.producer()
    producer.send(bus.topic("telemetry"), key=b"sample-nonfinite", value=b"{not json")
    producer.flush()
    producer.close()
    wait_for(lambda: len(flaky.accepted()) == 2 and len(slow.accepted()) == 2, 90,
             "both alerts accepted by both webhooks")  # fmt: skip
    (start,) = [e for e in _events(list(lines.lines)) if e["event"] == "start"]
    metrics_url = start["metrics"]

    seen = {}

    def settled():
        m = seen["m"] = scrape(metrics_url)
        done = sum(v for (n, _), v in m.items() if n == "rankscope_records_total") == RECORDS
        lag = [v for (n, _), v in m.items() if n == "rankscope_consumer_lag_messages"]
        caught_up = len(lag) == 8 and set(lag) == {0}  # 4 partitions of telemetry and of gpu
        dead = by_label(m, "rankscope_dead_letters_total", "reason")
        return m if done and caught_up and dead else None

    try:
        m = wait_for(settled, 30, "every record and the dead letter counted, no lag")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {seen}") from None
    log = _events(_stop(serve, lines))
    stored = findings_in(db)

    # metrics against the store and the trace
    want = Counter((f["kind"], f["action"]) for f in stored)
    got = {(dict(lab)["kind"], dict(lab)["action"]): v for (n, lab), v in m.items()
           if n == "rankscope_findings_total"}  # fmt: skip
    assert got == want and set(want) == {("straggler", "evict"), ("nonfinite", "recover")}
    assert by_label(m, "rankscope_dead_letters_total", "reason") == {"message": 1}
    assert by_label(m, "rankscope_control_messages_total", "action") == {"evict": 1, "recover": 1}
    delay = by_label(m, "rankscope_detection_delay_steps_sum", "kind")
    assert delay == {f["kind"]: f["detected_step"] - f["first_step"] for f in stored}
    assert m[("rankscope_record_to_finding_seconds_count", ())] == 2
    assert m[("rankscope_store_write_seconds_count", (("what", "checkpoint"),))] >= 1
    assert by_label(m, "rankscope_alerts_sent_total", "webhook") == {"0": 2, "1": 2}
    assert by_label(m, "rankscope_alert_retries_total", "webhook") == {"0": 2, "1": 1}

    # each alert arrived once per webhook (accepted), retried tries carry the same id
    ids = {f["finding_id"] for f in stored}
    for rx, statuses in ((flaky, ["503", "503", "200", "200"]), (slow, ["hang", "200", "200"])):
        assert [r["status"] for r in rx.requests] == statuses
        assert sorted(a["finding_id"] for a in rx.accepted()) == sorted(ids)
        assert {r["headers"]["X-Rankscope-Alert-Id"] for r in rx.requests} == ids

    # the JSON log
    kinds = Counter(e["event"] for e in log)
    assert kinds["start"] == kinds["assigned"] == kinds["summary"] == 1 and kinds["progress"] >= 2
    assert kinds["finding"] == kinds["action"] == 2
    keys = ("job", "kind", "ranks", "hosts", "first_step", "detected_step", "action", "detector")
    for e in (e for e in log if e["event"] == "finding"):
        (f,) = [f for f in stored if f["finding_id"] == e["finding_id"]]
        assert {k: e[k] for k in keys} == {k: f[k] for k in keys}
    (dead,) = [e for e in log if e["event"] == "dead_letter"]
    assert (dead["index"], dead["level"]) == (-1, "WARNING") and "JSON" in dead["reason"]
    last = [e for e in log if e["event"] == "progress"][-1]
    assert (last["records"], last["lag_messages"], last["dead_letters"]) == (RECORDS, 0, 1)
    assert set(last["alerts"]) == {"sent", "failed", "dropped", "queued", "retries"}
    assert not [e for e in log if e["logger"].startswith("kafka") and e["level"] != "INFO"]

    # a new group reads everything again into the same store: the same findings, stored
    # already, so neither logged as new nor counted nor alerted again
    before = len(flaky.requests), len(slow.requests)
    serve, lines = _serve_json(url, db, group + "-again", (flaky, slow), procs)
    wait_for(lambda: [ln for ln in list(lines.lines)
                      if '"progress"' in ln and f'"records":{RECORDS},' in ln], 60,
             "the second serve through every record")  # fmt: skip
    again = _events(_stop(serve, lines))
    assert Counter(e["event"] for e in again)["finding"] == 0
    assert [e["findings"] for e in again if e["event"] == "progress"][-1] == 2
    assert (len(flaky.requests), len(slow.requests)) == before


@pytest.mark.parametrize("acks", ["1", "all"])
def test_producers_start_without_a_client_warning(kafka_url, caplog, acks):
    """The sink (training side) and the bus producer (serve, publish) against the real
    broker: kafka-python says nothing at WARNING, whatever ``acks`` asks."""
    from rankscope.collectors.sinks.kafka import KafkaSink

    KafkaBus(kafka_url).ensure_topics(partitions=1, kinds=("telemetry",))
    with caplog.at_level(logging.INFO, "kafka"):
        sink = KafkaSink.from_url(f"{kafka_url}&acks={acks}&linger_ms=5")
        sink.send([{"v": 1, "type": "beat", "job": "w", "rank": 0, "t": 1.0, "step": 0,
                    "phase": "fwd"}])  # fmt: skip
        sink.flush()
        sink.close()
        producer = KafkaBus(kafka_url).producer(**({"acks": "all"} if acks == "all" else {}))
        producer.send(KafkaBus(kafka_url).topic("telemetry"), value=b"[]").get(timeout=30)
        producer.close()
    kafka_lines = [r for r in caplog.records if r.name.startswith("kafka")]
    assert kafka_lines, "the client logged nothing at INFO: the capture is not working"
    assert [r.getMessage() for r in kafka_lines if r.levelno >= logging.WARNING] == []
