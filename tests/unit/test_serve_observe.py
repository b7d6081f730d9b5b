"""serve's logs and metrics without a broker: the JSON lines, the levels, the
observer's counting of findings, the real metrics endpoint scraped over HTTP,
the new config checks and the CLI's refusals."""

from __future__ import annotations

import io
import logging
import math

import orjson
import pytest
from rankscope.pipeline.cli.main import main
from rankscope.pipeline.engine.findings import Finding
from rankscope.pipeline.serve.config import ServeConfig, ServeStats, dead_reason
from rankscope.pipeline.serve.histogram import Buckets
from rankscope.pipeline.serve.logs import configure_logging, event
from rankscope.pipeline.serve.metrics import MetricsEndpoint
from rankscope.pipeline.serve.observe import ServeObserver, action_sent
from rankscope.pipeline.serve.partition import PartitionState
from support.metrics import by_label, scrape

BUS = "kafka://127.0.0.1:9"


@pytest.fixture
def root_logging():
    """configure_logging replaces the root handlers: put pytest's back afterwards."""
    root = logging.getLogger()
    saved = (list(root.handlers), root.level, logging.getLogger("rankscope").level,
             logging.getLogger("kafka").level)  # fmt: skip
    yield
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    logging.getLogger("rankscope").setLevel(saved[2])
    logging.getLogger("kafka").setLevel(saved[3])


def test_the_kafka_clients_slow_loop_warning_is_load_not_news(root_logging):
    slow = ("Task %r ran for %.3fs (>%.3fs threshold). It is blocking the event loop -- "
            "likely a tight sync loop inside a coroutine. Other pollers will time out.")
    for verbose, kept in ((0, ["client"]), (2, ["slow", "client"])):
        out = io.StringIO()
        configure_logging("json", verbose=verbose, stream=out)
        logging.getLogger("kafka.net.selector").warning(slow, "slow", 0.155, 0.1)
        logging.getLogger("kafka.producer").warning("client")  # any other warning passes
        lines = [orjson.loads(line) for line in out.getvalue().splitlines()]
        assert [x["msg"].split()[1].strip("'") if x["msg"].startswith("Task") else x["msg"]
                for x in lines] == kept  # fmt: skip


def _finding(action="evict", first=20, detected=23, kind="straggler", job="j") -> Finding:
    return Finding(job=job, kind=kind, ranks=[5], hosts=["h2"], first_step=first,
                   last_step=detected, detected_step=detected, detected_t=100.0, score=4.0,
                   detector=kind, action=action)  # fmt: skip


def test_json_lines_have_stable_keys_then_the_event_fields(root_logging):
    out = io.StringIO()
    configure_logging("json", stream=out)
    log = logging.getLogger("rankscope.serve")
    event(log, "finding", "finding %s", "abc", finding_id="abc", ranks=[1, 2], msg="not mine")
    log.info("plain %d", 7)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("failed")
    logging.getLogger("kafka.producer").warning("client")  # WARNING passes
    logging.getLogger("kafka.producer").info("chatter")  # INFO does not
    lines = [orjson.loads(line) for line in out.getvalue().splitlines()]
    assert [list(x)[:5] for x in lines] == [["ts", "level", "logger", "event", "msg"]] * 4
    first, plain, failed, client = lines
    assert (first["event"], first["msg"], first["finding_id"], first["ranks"]) == (
        "finding", "finding abc", "abc", [1, 2])  # a field never overwrites a stable key
    assert (plain["event"], plain["msg"], plain["level"]) == ("log", "plain 7", "INFO")
    assert "RuntimeError: boom" in failed["exc"] and failed["level"] == "ERROR"
    assert client["logger"] == "kafka.producer" and first["ts"].endswith("Z")


def test_verbosity_levels(root_logging):
    configure_logging("text", 0, stream=io.StringIO())
    assert logging.getLogger("rankscope.serve").getEffectiveLevel() == logging.INFO
    assert logging.getLogger("kafka.conn").getEffectiveLevel() == logging.WARNING
    configure_logging("text", 1, stream=io.StringIO())
    assert logging.getLogger("rankscope.serve").getEffectiveLevel() == logging.DEBUG
    assert logging.getLogger("kafka.conn").getEffectiveLevel() == logging.WARNING
    configure_logging("text", 2, stream=io.StringIO())
    assert logging.getLogger("kafka.conn").getEffectiveLevel() == logging.INFO
    with pytest.raises(ValueError, match="log format"):
        configure_logging("xml")


def test_observer_logs_counts_and_times_each_finding_once_per_action(caplog):
    stats = ServeStats()
    obs = ServeObserver(ServeConfig(bus=BUS, db_path="x.duckdb"), stats)
    part = PartitionState(lambda: None)
    part.arrival[("j", 23)] = 0.0  # long ago: the latency is large and finite
    with caplog.at_level(logging.INFO, "rankscope.serve"):
        obs.found(part, [_finding("recover"), _finding("observe", 40, 44, "network")])
        obs.found(part, [_finding("recover")])  # a re-report
        obs.found(part, [_finding("evict")])  # escalation
    events = [(r.event, r.levelname) for r in caplog.records]
    assert events == [("finding", "WARNING"), ("finding", "INFO"), ("escalated", "WARNING")]
    assert stats.findings_by == {("straggler", "recover"): 1, ("network", "observe"): 1,
                                 ("straggler", "evict"): 1}  # fmt: skip
    assert len(stats.detect_latency_s) == 1  # only the straggler's step arrival was known
    buckets, _, n = stats.delay_steps["straggler"].snapshot()
    assert n == 1 and buckets[3] == (3.0, 1)  # onset 20, detected 23: 3 steps
    from kafka.structs import TopicPartition

    with caplog.at_level(logging.WARNING, "rankscope.serve"):
        obs.dead(TopicPartition("p.telemetry", 2), 41, 3, "'rank' must be an int")
    (dead,) = [r for r in caplog.records if r.event == "dead_letter"]
    assert dead.fields == {"topic": "p.telemetry", "partition": 2, "offset": 41, "index": 3,
                           "reason": "'rank' must be an int"}  # fmt: skip
    assert stats.dead_by_reason == {"record": 1}
    action_sent(stats, {"action": "evict", "ranks": [5], "hosts": [], "job": "j", "step": 20,
                        "finding_id": "f"}, "p.control")  # fmt: skip
    assert stats.control_by_action == {"evict": 1} and stats.control_sent == 1


def test_the_metrics_endpoint_serves_the_counters_over_http():
    stats = ServeStats()
    obs = ServeObserver(ServeConfig(bus=BUS, db_path="x.duckdb"), stats)
    stats.count_records("p.telemetry", 0, 1000, "columns")
    stats.count_records("p.telemetry", 0, 24, "records")
    stats.count_records("p.gpu", 0, 8, "records")
    stats.dead_letter("message is not JSON: x", -1)
    stats.dead_letter("'rank' must be an int", 3)
    stats.dead_letter("store: disk full")
    stats.observe_write(0.003, checkpoint=False)
    stats.observe_write(0.2, checkpoint=True)
    obs.found(PartitionState(lambda: None), [_finding("evict")])
    obs.lag = {("p.telemetry", 0): 5, ("p.gpu", 0): None}
    ep = MetricsEndpoint("127.0.0.1", 0, obs, group="g")
    try:
        m = scrape(f"http://127.0.0.1:{ep.port}/metrics")
    finally:
        ep.close()
    assert m[("rankscope_records_total", (("partition", "0"), ("path", "columns"),
                                          ("topic", "p.telemetry")))] == 1000  # fmt: skip
    assert sum(v for (n, _), v in m.items() if n == "rankscope_records_total") == 1032
    assert m[("rankscope_consumer_lag_messages", (("partition", "0"), ("topic", "p.telemetry")))
             ] == 5  # fmt: skip
    assert not any(n == "rankscope_consumer_lag_messages" and ("topic", "p.gpu") in lab
                   for n, lab in m)  # unknown lag is left out, not 0  # fmt: skip
    dead = by_label(m, "rankscope_dead_letters_total", "reason")
    assert dead == {"message": 1, "record": 1, "store": 1}
    assert m[("rankscope_findings_total", (("action", "evict"), ("kind", "straggler")))] == 1
    assert m[("rankscope_detection_delay_steps_count", (("kind", "straggler"),))] == 1
    assert m[("rankscope_store_write_seconds_bucket", (("le", "0.005"), ("what", "turn")))] == 1
    assert m[("rankscope_store_write_seconds_count", (("what", "checkpoint"),))] == 1
    assert m[("rankscope_record_to_finding_seconds_count", ())] == 1
    assert m[("rankscope_serve_info", (("group", "g"),))] == 1
    assert ("process_resident_memory_bytes", ()) in m


def test_buckets_are_cumulative_and_skip_nan():
    b = Buckets((1, 2, 5))
    for v in (0.5, 1.0, 1.5, 7.0, math.nan):
        b.observe(v)
    buckets, total, n = b.snapshot()
    assert buckets == [(1.0, 2), (2.0, 3), (5.0, 3), (math.inf, 4)] and (total, n) == (10.0, 4)
    with pytest.raises(ValueError, match="increasing"):
        Buckets((2, 1))


@pytest.mark.parametrize("reason, idx, cls", [
    ("value is not JSON", -1, "message"), ("'rank' must be an int", 0, "record"),
    ("a step record on the gpu topic (it belongs on telemetry)", 1, "wrong_topic"),
    ("engine error: KeyError: 'x'", -1, "engine"), ("store: disk full", -1, "store"),
])  # fmt: skip
def test_dead_letter_classes(reason, idx, cls):
    assert dead_reason(reason, idx) == cls


@pytest.mark.parametrize("kw, match", [
    ({"progress_interval_s": 0}, "progress_interval_s"),
    ({"metrics_port": 70000}, "metrics_port"),
    ({"metrics_port": -1}, "metrics_port"),
    ({"metrics_host": ""}, "metrics_host"),
])  # fmt: skip
def test_serve_config_checks_the_ops_settings(kw, match):
    with pytest.raises(ValueError, match=match):
        ServeConfig(bus=BUS, db_path="x.duckdb", **kw)


@pytest.mark.parametrize("extra, said", [
    (["--alert-timeout", "3"], "need --alert-webhook"),
    (["--alert-webhook", "ftp://h/x"], "not an http"),
    (["--metrics-port", "70000"], "metrics_port"),
    (["--alert-webhook", "@/nonexistent/hooks"], "No such file"),
])  # fmt: skip
def test_serve_cli_refuses_bad_ops_flags(extra, said, tmp_path, capsys, root_logging):
    code = main(["serve", "--bus", BUS, "--db", str(tmp_path / "s.duckdb"), "--no-control",
                 *extra])  # fmt: skip
    assert code == 1
    assert said in capsys.readouterr().err


def test_a_metrics_port_in_use_is_a_clear_error(tmp_path, capsys, root_logging):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        code = main(["serve", "--bus", BUS, "--db", str(tmp_path / "s.duckdb"), "--no-control",
                     "--metrics-port", str(busy.getsockname()[1])])  # fmt: skip
    assert code == 1
    assert "metrics endpoint on 127.0.0.1:" in capsys.readouterr().err


def test_findings_stored_before_start_are_not_new(tmp_path, caplog):
    from rankscope.pipeline.serve.db import ServeDb

    db = ServeDb(str(tmp_path / "s.duckdb"))
    try:
        with db.session() as s:
            s.store.write_turn(findings=[_finding("recover")])
        stats = ServeStats()
        obs = ServeObserver(ServeConfig(bus=BUS, db_path="s.duckdb"), stats)
        with caplog.at_level(logging.INFO, "rankscope.serve"):
            obs.start("kafka://127.0.0.1:9?topic_prefix=p", ["p.telemetry", "p.gpu"], db)
            part = PartitionState(lambda: None)
            obs.found(part, [_finding("recover")])  # rebuilt after a restart: nothing
            obs.found(part, [_finding("evict")])  # its escalation is news
        obs.close()
    finally:
        db.close()
    assert [r.event for r in caplog.records] == ["start", "escalated"]
    assert stats.findings_by == {("straggler", "evict"): 1}
