"""Alert webhooks against real HTTP servers on 127.0.0.1: retries, timeouts, once per
finding, the ledger across a restart, the bodies, the signature, the config checks."""

from __future__ import annotations

import hashlib
import hmac
import logging

import orjson
import pytest
from rankscope.pipeline.engine.findings import Finding
from rankscope.pipeline.serve.alert_ledger import AlertLedger
from rankscope.pipeline.serve.alerts import AlertConfig, AlertSender, alert_body
from rankscope.pipeline.serve.db import ServeDb
from support.kafka import wait_for
from support.webhook import Receiver

FAST = {"backoff_s": 0.05, "backoff_max_s": 0.2, "timeout_s": 1.0, "drain_s": 2.0}


def _finding(action="evict", step=20, kind="straggler") -> dict:
    return Finding(job="j", kind=kind, ranks=[5], hosts=["h2"], first_step=step, last_step=step,
                   detected_step=step + 3, detected_t=1.0, score=4.0, detector="straggler",
                   action=action, evidence={"rule": "x"}).to_dict()  # fmt: skip


@pytest.fixture
def receivers():
    made: list[Receiver] = []

    def make(*script, **kw):
        made.append(Receiver(script, **kw))
        return made[-1]

    yield make
    for r in made:
        r.close()


def test_503_then_200_delivers_once_and_re_reports_post_nothing(receivers):
    rx = receivers("503", "503", "200")
    sender = AlertSender(AlertConfig(urls=(rx.url,), **FAST))
    f = _finding("recover")
    sender.offer(f)
    sender.offer(f)  # a re-report of the same incident
    sender.offer({**f, "action": "evict"})  # its escalation: same finding id
    sender.offer(_finding("observe", step=40))  # not an action: no alert
    wait_for(lambda: rx.accepted(), 10, "the alert accepted")
    sender.close()
    assert [r["status"] for r in rx.requests] == ["503", "503", "200"]
    assert {r["headers"]["X-Rankscope-Alert-Id"] for r in rx.requests} == {f["finding_id"]}
    (got,) = rx.accepted()
    assert (got["finding_id"], got["action"], got["ranks"]) == (f["finding_id"], "recover", [5])
    (c,) = sender.counts()
    assert (c["sent"], c["retries"], c["failed"], c["dropped"]) == (1, 2, 0, 0)


def test_a_webhook_that_never_answers_delays_neither_the_caller_nor_the_other(receivers):
    mute = receivers("hang", "hang", hang_s=30)
    fine = receivers()
    sender = AlertSender(AlertConfig(urls=(mute.url, fine.url), attempts=2,
                                     **{**FAST, "timeout_s": 0.3}))  # fmt: skip
    sender.offer(_finding())
    assert sender.counts()[0]["failed"] == 0  # offer came back before the tries ran out
    wait_for(lambda: fine.accepted(), 10, "the other webhook's alert")
    wait_for(lambda: sender.counts()[0]["failed"] == 1, 10, "the mute webhook given up")
    assert len(mute.requests) == 2  # two tries, each timed out
    sender.close()
    assert [c["sent"] for c in sender.counts()] == [0, 1]


def test_a_4xx_is_given_up_without_retrying(receivers, caplog):
    rx = receivers("404")
    sender = AlertSender(AlertConfig(urls=(rx.url,), **FAST))
    with caplog.at_level(logging.WARNING, "rankscope.serve.alerts"):
        sender.offer(_finding())
        wait_for(lambda: sender.counts()[0]["failed"] == 1, 10, "the alert given up")
        sender.close()
    assert len(rx.requests) == 1
    assert "HTTP 404" in caplog.text and "secret-token" not in caplog.text  # no URL path


def test_a_full_queue_drops_counted_and_warned_once(receivers, caplog):
    rx = receivers("hang", hang_s=30)
    sender = AlertSender(AlertConfig(urls=(rx.url,), queue_size=1, attempts=1,
                                     **{**FAST, "drain_s": 0.0}))  # fmt: skip
    with caplog.at_level(logging.WARNING, "rankscope.serve.alerts"):
        sender.offer(_finding(step=1))
        wait_for(lambda: rx.requests, 10, "the first try in flight")
        for step in range(2, 6):  # one fits the queue, three are dropped
            sender.offer(_finding(step=step))
        sender.close()
    assert sender.counts()[0]["dropped"] == 3
    assert caplog.text.count("alert queue full") == 1


def test_the_ledger_keeps_a_restarted_sender_from_posting_again(receivers, tmp_path):
    rx = receivers()
    db = ServeDb(str(tmp_path / "s.duckdb"))
    try:
        ledger = AlertLedger(db)
        sender = AlertSender(AlertConfig(urls=(rx.url,), **FAST), delivered=ledger.delivered(),
                             mark=ledger.mark)  # fmt: skip
        sender.offer(_finding())
        wait_for(lambda: rx.accepted(), 10, "the alert")
        sender.close()
        again = AlertSender(AlertConfig(urls=(rx.url,), **FAST), delivered=ledger.delivered(),
                            mark=ledger.mark)  # fmt: skip
        again.offer(_finding())
        again.offer(_finding(step=50))  # a new finding still goes
        wait_for(lambda: len(rx.accepted()) == 2, 10, "the new finding's alert")
        again.close()
    finally:
        db.close()
    assert [a["first_step"] for a in rx.accepted()] == [20, 50]


def test_bodies_and_signature(receivers):
    f = _finding()
    slack = orjson.loads(alert_body(f, "slack"))
    assert list(slack) == ["text"] and "evict straggler on ranks [5]" in slack["text"]
    generic = orjson.loads(alert_body(f, "json", now=7.0))
    assert {k: generic[k] for k in f} == f
    assert (generic["source"], generic["alerted_t"]) == ("rankscope", 7.0)

    secret = b"alert-secret-0123456789"
    rx = receivers()
    sender = AlertSender(AlertConfig(urls=(rx.url,), body="slack", secret=secret, **FAST))
    sender.offer(f)
    wait_for(lambda: rx.accepted(), 10, "the signed alert")
    sender.close()
    (req,) = rx.requests
    ts = req["headers"]["X-Rankscope-Timestamp"]
    mac = hmac.new(secret, ts.encode() + b"." + req["body"], hashlib.sha256).hexdigest()
    assert req["headers"]["X-Rankscope-Signature"] == "sha256=" + mac


@pytest.mark.parametrize("kw, match", [
    ({"urls": ()}, "at least one"),
    ({"urls": ("ftp://h/x",)}, "not an http"),
    ({"urls": ("http:///x",)}, "not an http"),
    ({"body": "xml"}, "body"),
    ({"secret": b"short"}, "16 bytes"),
    ({"timeout_s": 0}, "timeout_s"),
    ({"backoff_s": 0}, "backoff_s"),
    ({"drain_s": -1}, "drain_s"),
    ({"backoff_max_s": 0.5}, "backoff_max_s"),
    ({"attempts": 0}, "attempts"),
    ({"queue_size": 0}, "queue_size"),
])  # fmt: skip
def test_alert_config_checks(kw, match):
    with pytest.raises(ValueError, match=match):
        AlertConfig(**{"urls": ("http://127.0.0.1:9/h",), **kw})
