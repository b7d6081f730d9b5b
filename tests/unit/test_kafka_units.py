"""Kafka-side pieces that need no broker: URLs, configs, control signing, policies, decoding."""

from __future__ import annotations

import copy
import json
import logging
import re
import time

import orjson
import pytest
from rankscope.collectors.control.listener import (
    ControlListener,
    ControlListenerConfig,
    RankEvicted,
)
from rankscope.collectors.schema.control import (
    ControlAuthConfig,
    Verifier,
    canonical,
    load_secret,
    sign,
)
from rankscope.collectors.schema.kafka import KafkaUrl
from rankscope.collectors.sinks.kafka import KafkaSink, KafkaSinkConfig
from rankscope.pipeline.bus.decode import check_fast, decode_records
from rankscope.pipeline.bus.kafka import decode_value, encode_records
from rankscope.pipeline.engine.findings import Finding
from rankscope.pipeline.serve.control import ControlAnnouncer, control_message
from rankscope.pipeline.serve.loop import ServeConfig
from rankscope.pipeline.traces.validate import check_record
from support.engine_synth import one_step_record as _step

SECRET = b"unit-test-secret-0123456789"
URL = "kafka://127.0.0.1:9"


# -- URLs and configs -------------------------------------------------------


def test_kafka_url_parses_servers_security_and_options():
    u = KafkaUrl.parse(
        "kafka://alice:s%40cret@b1:9092,b2:9093?security_protocol=SASL_SSL"
        "&sasl_mechanism=SCRAM-SHA-512&ssl_check_hostname=false&topic_prefix=prod&acks=all",
        env={"RANKSCOPE_KAFKA_SSL_CAFILE": "/etc/ca.pem"},
    )
    assert u.bootstrap == ["b1:9092", "b2:9093"]
    assert u.topic("telemetry") == "prod.telemetry"
    kw = u.client_kwargs()
    assert kw["sasl_plain_username"] == "alice" and kw["sasl_plain_password"] == "s@cret"
    assert kw["security_protocol"] == "SASL_SSL" and kw["ssl_check_hostname"] is False
    assert kw["ssl_cafile"] == "/etc/ca.pem"
    assert u.options == {"acks": "all"}
    assert "s@cret" not in u.redacted() and "alice" not in u.redacted()


@pytest.mark.parametrize(
    "url, fragment",
    [
        ("file:///tmp/x", "not a kafka://"),
        ("kafka://", "no bootstrap server"),
        ("kafka://host", "not host:port"),
        ("kafka://h:1?topic_prefix=a/b", "odd characters"),
        ("kafka://h:1?ssl_check_hostname=maybe", "not a boolean"),
        ("kafka://h:1?request_timeout_ms=soon", "not an integer"),
    ],
)
def test_kafka_url_rejects_with_reason(url, fragment):
    with pytest.raises(ValueError, match=fragment):
        KafkaUrl.parse(url, env={})


@pytest.mark.parametrize(
    "kw, fragment",
    [
        ({"acks": "2"}, "acks"),
        ({"linger_ms": -1}, "linger_ms"),
        ({"compression": "brotli"}, "compression"),
        ({"buffer_records": 0}, "buffer_records"),
        ({"flush_timeout_s": -1.0}, "flush_timeout_s"),
        ({"reconnect_backoff_s": 0.0}, "reconnect_backoff_s"),
    ],
)
def test_sink_config_checks(kw, fragment):
    with pytest.raises(ValueError, match=fragment):
        KafkaSinkConfig(**kw)


def test_sink_url_unknown_option_is_an_error():
    with pytest.raises(ValueError, match="unknown option"):
        KafkaSink.from_url("kafka://127.0.0.1:9?lingerms=5")


def test_sink_never_blocks_and_counts_drops_without_a_broker():
    sink = KafkaSink.from_url("kafka://127.0.0.1:9?buffer_records=10&flush_timeout_s=0.2")
    try:
        rec = {"v": 1, "type": "step", "job": "j", "rank": 0, "step": 0, "world": 1,
               "host": "h", "t": 1.0}  # fmt: skip
        t0 = time.monotonic()
        for i in range(100):
            sink.send([{**rec, "step": i}])
        assert time.monotonic() - t0 < 1.0  # 100 sends to a dead broker: no waiting on it
        st = sink.stats()
        assert st["buffered"] == 10 and st["dropped"] == 90 and st["sent"] == 0
    finally:
        sink.close()
    assert sink.stats()["dropped"] == 100  # what never got out is counted at close


SLOW_LOOP = (
    "Task %r ran for %.3fs (>%.3fs threshold). It is blocking the event loop -- "
    "likely a tight sync loop inside a coroutine. Other pollers will time out."
)


def test_the_clients_slow_loop_warning_is_counted_not_printed_on_a_sinks_thread(caplog):
    """Beside a training loop holding the GIL a slow client step is load: counted in the
    sink's stats, kept out of the training log; other threads' clients still warn."""
    import inspect
    import threading

    import kafka.net.selector
    from rankscope.collectors.schema.kafka import SLOW_LOOP_MARK

    joined = re.sub(r"'\s*'", "", inspect.getsource(kafka.net.selector))  # 'a' 'b' -> 'ab'
    assert SLOW_LOOP_MARK in joined and SLOW_LOOP_MARK in SLOW_LOOP  # the client says it so
    caplog.set_level(logging.WARNING)
    sink = KafkaSink.from_url("kafka://127.0.0.1:9?flush_timeout_s=0.2")
    try:
        before = sink.stats()["client_slow_loops"]

        def warn():
            logging.getLogger("kafka.net.selector").warning(SLOW_LOOP, "t", 0.15, 0.1)

        for name in (sink._thread.name, "someone-elses-client"):
            t = threading.Thread(target=warn, name=name)
            t.start()
            t.join()
        assert sink.stats()["client_slow_loops"] == before + 1
    finally:
        sink.close()
    slow = [r for r in caplog.records if "blocking the event loop" in r.getMessage()]
    assert [r.threadName for r in slow] == ["someone-elses-client"]


@pytest.mark.parametrize(
    "kw, fragment",
    [
        ({"partitions": 0}, "partitions"),
        ({"group": ""}, "group"),
        ({"db_path": ""}, "db_path"),
        ({"poll_timeout_s": 0}, "poll_timeout_s"),
        ({"max_poll_messages": 0}, "max_poll_messages"),
        ({"idle_exit_s": -1.0}, "idle_exit_s"),
        ({"decode_workers": -1}, "decode_workers"),
        ({"decode_workers": 65}, "decode_workers"),
        ({"bus": "kafka://nohostport"}, "host:port"),
    ],
)
def test_serve_config_checks(kw, fragment):
    args = {"bus": URL, "db_path": "x.duckdb", **kw}
    with pytest.raises(ValueError, match=fragment):
        ServeConfig(**args)


# -- control messages -------------------------------------------------------


def _msg(**over):
    m = {"job": "j", "action": "evict", "ranks": [3], "hosts": ["node01"], "step": 40,
         "finding_id": "f1", "reason": "straggler", "issued_t": time.time()}  # fmt: skip
    m.update(over)
    return m


def test_signed_message_is_accepted_once():
    v = Verifier(SECRET)
    m = sign(_msg(), SECRET)
    assert v.check(copy.deepcopy(m)) is None
    assert v.check(copy.deepcopy(m)).startswith("replayed")
    again = sign(_msg(), SECRET)  # a re-announcement after a service restart: new nonce
    assert v.check(again).startswith("replayed")
    escalated = sign(_msg(action="recover"), SECRET)
    assert v.check(escalated) is None  # another action of the same finding is news


@pytest.mark.parametrize(
    "tamper, fragment",
    [
        (lambda m: m.pop("sig"), "unsigned"),
        (lambda m: m.__setitem__("hosts", ["node00"]), "bad signature"),
        (lambda m: m.__setitem__("sig", "0" * 64), "bad signature"),
        (lambda m: m.pop("nonce"), "missing nonce"),
        (lambda m: m.__setitem__("action", "reboot"), "unknown action"),
        (lambda m: m.__setitem__("ranks", ["3"]), "ranks"),
    ],
)
def test_forged_or_altered_messages_are_rejected(tamper, fragment):
    m = sign(_msg(), SECRET)
    tamper(m)
    assert fragment in Verifier(SECRET).check(m)


def test_wrong_secret_expired_and_future_messages_are_rejected():
    assert "bad signature" in Verifier(SECRET).check(sign(_msg(), b"another-secret-0123456789"))
    cfg = ControlAuthConfig(max_age_s=60, clock_skew_s=5)
    now = time.time()
    old = sign(_msg(issued_t=now - 61), SECRET)
    assert Verifier(SECRET, cfg).check(old, now=now).startswith("expired")
    future = sign(_msg(issued_t=now + 30), SECRET)
    assert Verifier(SECRET, cfg).check(future, now=now).startswith("not yet valid")


def test_canonical_encoding_ignores_key_order_and_sig():
    a = {"b": 1, "a": [1, 2], "sig": "x"}
    assert canonical(a) == canonical({"a": [1, 2], "b": 1}) == b'{"a":[1,2],"b":1}'


def test_secret_must_be_long_enough_and_can_come_from_env(tmp_path):
    with pytest.raises(ValueError, match="at least 16"):
        load_secret("short")
    with pytest.raises(ValueError, match="no control secret"):
        load_secret(env={})
    f = tmp_path / "secret"
    f.write_bytes(b"file-secret-0123456789\n")
    assert load_secret(env={"RANKSCOPE_CONTROL_SECRET_FILE": str(f)}) == b"file-secret-0123456789"


def _finding(action="evict"):
    return Finding(job="j", kind="straggler", ranks=[3], hosts=["node01"], first_step=40,
                   last_step=46, detected_step=46, detected_t=1.0, score=9.0,
                   detector="straggler", action=action)  # fmt: skip


def test_announcer_signs_each_finding_action_once():
    ann = ControlAnnouncer(SECRET)
    assert control_message(_finding("observe")) is None
    first = ann.messages([_finding()])
    assert len(first) == 1 and first[0]["step"] == 40 and first[0]["hosts"] == ["node01"]
    assert Verifier(SECRET).check(first[0]) is None
    assert ann.messages([_finding()]) == []  # the same verdict again: not re-announced
    assert len(ann.messages([_finding("recover")])) == 1
    restarted = ControlAnnouncer(SECRET, announced={(_finding().finding_id, "evict")})
    assert restarted.messages([_finding()]) == []


# -- who acts, and when -----------------------------------------------------


def _listener(rank, host, tmp_path, **kw):
    kw.setdefault("state_file", str(tmp_path / f"control-{rank}.json"))  # this test's own
    cfg = ControlListenerConfig(url=URL, job="j", rank=rank, host=host, **kw)
    return ControlListener(cfg, secret=SECRET, restore=kw.pop("restore", None))


def test_evict_raises_only_in_affected_ranks_at_the_next_boundary(tmp_path):
    lst = {r: _listener(r, f"node{r // 2:02d}", tmp_path) for r in range(4)}
    seen = {r: [] for r in lst}
    for r, li in lst.items():
        li.on_action(seen[r].append)
    raw = orjson.dumps(sign(_msg(ranks=[3], hosts=["node01"]), SECRET))
    for li in lst.values():
        assert li.handle(raw) is not None  # queued, nothing raised on the listener thread
    outcome = {}
    for r, li in lst.items():
        try:
            li.at_step_boundary(41)
            outcome[r] = "runs"
        except RankEvicted as exc:
            outcome[r] = "evicted"
            assert exc.action.finding_id == "f1"
    # the whole host goes: rank 2 shares node01 with the straggler rank 3
    assert outcome == {0: "runs", 1: "runs", 2: "evicted", 3: "evicted"}
    assert all(len(s) == 1 for s in seen.values())  # every rank's callbacks hear of it
    assert [s[0].affects_me for _, s in sorted(seen.items())] == [False, False, True, True]
    for li in lst.values():
        li.at_step_boundary(42)  # acted once; nothing left


def test_rollback_runs_on_every_rank_with_the_last_good_step(tmp_path):
    restored = []
    li = ControlListener(
        ControlListenerConfig(url=URL, job="j", rank=0, host="node00", recover_policy="rollback"),
        secret=SECRET,
        restore=restored.append,
    )
    li.handle(orjson.dumps(sign(_msg(action="recover", step=40), SECRET)))
    li.at_step_boundary(47)
    assert restored == [39]  # rank 0 is not named, rolls back all the same


def test_exclude_file_gets_the_host_once_and_other_jobs_are_ignored(tmp_path):
    path = tmp_path / "exclude.txt"
    lst = [
        _listener(r, "node01", tmp_path, evict_policy="exclude-file", exclude_file=str(path))
        for r in (2, 3)
    ]
    raw = orjson.dumps(sign(_msg(), SECRET))
    other_job = orjson.dumps(sign(_msg(job="someone-else", finding_id="f2"), SECRET))
    for li in lst:
        li.handle(raw)
        assert li.handle(other_job) is None
        li.at_step_boundary(41)
    assert path.read_text() == "node01\n"


def test_listener_logs_and_counts_rejections(tmp_path, caplog):
    li = _listener(0, "node00", tmp_path)
    forged = sign(_msg(hosts=["node00"]), b"attacker-secret-0123456789")
    assert li.handle(orjson.dumps(forged)) is None
    assert li.handle(orjson.dumps(_msg())) is None
    assert li.handle(b"{nope") is None
    li.at_step_boundary(1)  # nothing to act on
    assert li.rejected == {"bad signature (forged or altered)": 1, "unsigned": 1, "malformed": 1}
    assert "rejected control message" in caplog.text


def test_listener_config_checks():
    with pytest.raises(ValueError, match="exclude_file"):
        ControlListenerConfig(url=URL, job="j", rank=0, evict_policy="exclude-file")
    with pytest.raises(ValueError, match="evict_policy"):
        ControlListenerConfig(url=URL, job="j", rank=0, evict_policy="shoot")
    with pytest.raises(ValueError, match="restore"):
        ControlListener(
            ControlListenerConfig(url=URL, job="j", rank=0, recover_policy="rollback"),
            secret=SECRET,
        )


# -- message values ---------------------------------------------------------


def test_values_are_one_record_or_an_array():
    assert decode_value(encode_records([_step()])) == [_step()]
    assert decode_value(encode_records([_step(), _step(rank=2)]))[1]["rank"] == 2
    for bad, fragment in [(b"nope", "not JSON"), (b"3", "neither"), (None, "null")]:
        with pytest.raises(ValueError, match=fragment):
            decode_value(bad)
    # an array's elements are judged one by one (a non-record costs only itself)
    good, bad = [], []
    decode_records(b"[1]", good, bad)
    assert good == [] and bad[0][:2] == (0, "array element 0 is a int, not a record")


def test_fast_check_agrees_with_the_validation_entry():
    # the verdict is the one validation entry's (schema and bounds), check_record
    variants = [_step()]
    for key in list(_step()):
        for value in (None, "x", 1.5, 2.0, True, [], 7, -1, 2**64 - 1, 10**30, 1e30, "x" * 5000):
            v = _step()
            v[key] = value
            variants.append(v)
        v = _step()
        del v[key]
        variants.append(v)
    for value in (None, "x", 1.5, True):
        v = _step()
        v["collectives"][0]["seq"] = value
        variants.append(v)
    variants.append({"v": 1, "type": "beat", "job": "j", "rank": 0, "host": "h", "t": 1.0,
                     "step": 3, "phase": "sleeping"})  # fmt: skip
    for v in variants * 2:  # the second pass answers from the shape cache
        try:
            check_record(copy.deepcopy(v))
            valid = True
        except ValueError:
            valid = False
        if check_fast(copy.deepcopy(v)):
            assert valid, v
        good, bad = [], []  # the same verdicts behind a valid record of the common shape
        value = json.dumps([_step(), v]).encode()  # 10**30 too (orjson can't write it)
        try:  # the verdict on what the wire holds (orjson reads 10**30 as a float)
            check_record(orjson.loads(value)[1])
            valid = True
        except ValueError:
            valid = False
        decode_records(value, good, bad)
        assert len(good) == 1 + valid and len(bad) == 1 - valid, v


def test_decode_records_keeps_good_records_around_bad_ones():
    good, bad = [], []
    value = orjson.dumps([_step(), _step(rank="one"), _step(step=3.0)])
    decode_records(value, good, bad)
    assert [r["step"] for r in good] == [2, 3] and isinstance(good[1]["step"], int)
    assert bad[0][0] == 1 and "rank" in bad[0][1]


# -- command line misuse ------------------------------------------------------


def test_cli_misuse_says_what_is_wrong(tmp_path, capsys, monkeypatch):
    from rankscope.pipeline.cli import main

    monkeypatch.delenv("RANKSCOPE_CONTROL_SECRET", raising=False)
    monkeypatch.delenv("RANKSCOPE_CONTROL_SECRET_FILE", raising=False)
    trace = tmp_path / "t.jsonl"
    trace.write_bytes(orjson.dumps(_step()) + b"\n")
    assert main(["publish", str(trace), "--bus", "kafka://nohost"]) == 1
    assert "not host:port" in capsys.readouterr().err
    assert main(["publish", str(trace), "--bus", URL, "--batch", "0"]) == 1
    assert "--batch" in capsys.readouterr().err
    assert main(["serve", "--bus", URL, "--db", str(tmp_path / "x.duckdb")]) == 1
    assert "control secret" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--db", "x.duckdb"])
    assert exc.value.code == 2


def test_producers_opt_out_of_idempotence_only_when_acks_is_not_all():
    from kafka import KafkaProducer
    from rankscope.collectors.schema.kafka import idempotence_kwargs

    defaults = KafkaProducer.DEFAULT_CONFIG
    assert idempotence_kwargs(1, defaults) == idempotence_kwargs(0, defaults) == (
        {"enable_idempotence": False} if "enable_idempotence" in defaults else {})
    assert idempotence_kwargs("all", defaults) == idempotence_kwargs(-1, defaults) == {}
    assert idempotence_kwargs(1, {"acks": 1}) == {}  # a client without the setting


def test_a_codec_without_its_package_falls_back_to_gzip_said_once(monkeypatch, caplog):
    """lz4 is the default codec; where its package is missing the producers still send
    (gzip, in the standard library) and say why once."""
    import logging

    from kafka import codec
    from rankscope.collectors.schema import kafka as schema
    from rankscope.collectors.sinks.kafka import KafkaSinkConfig

    assert KafkaSinkConfig().compression == "lz4"
    assert schema.compression_type("lz4") == "lz4" and schema.compression_type("none") is None
    monkeypatch.setattr(codec, "has_lz4", lambda: False)
    monkeypatch.setattr(schema, "_said_codec", set())
    with caplog.at_level(logging.WARNING, logger="rankscope.kafka"):
        got = [schema.compression_type("lz4") for _ in range(3)]
    assert got == ["gzip"] * 3
    said = [r.getMessage() for r in caplog.records if "compression lz4" in r.getMessage()]
    assert len(said) == 1 and "using gzip" in said[0]
    with pytest.raises(ValueError, match="compression='brotli'"):
        schema.compression_type("brotli")
