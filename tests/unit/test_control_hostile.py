"""The control listener under hostile input: malformed messages never cost the genuine ones
after them, and replay protection survives a restart of the rank."""

from __future__ import annotations

import json
import time

import orjson
from rankscope.collectors.control.listener import ControlListener, ControlListenerConfig
from rankscope.collectors.schema.control import sign

SECRET = b"unit-test-secret-0123456789"
URL = "kafka://127.0.0.1:9"


def _msg(**over):
    m = {"job": "j", "action": "evict", "ranks": [3], "hosts": ["node01"], "step": 40,
         "finding_id": "f1", "reason": "straggler", "issued_t": time.time()}  # fmt: skip
    m.update(over)
    return orjson.dumps(sign(m, SECRET))


def _listener(tmp_path, rank=3):
    cfg = ControlListenerConfig(url=URL, job="j", rank=rank, host="node01",
                                state_file=str(tmp_path / "seen.json"))  # fmt: skip
    return ControlListener(cfg, secret=SECRET)


def test_malformed_messages_are_counted_and_the_batch_goes_on(tmp_path):
    li = _listener(tmp_path)
    deep = b"[" * 200_000 + b"]" * 200_000  # RecursionError in json.loads once escaped
    batch = [
        deep,
        _msg(finding_id="a"),
        b"{not json",
        b"[1, 2, 3]",  # JSON, the wrong shape
        json.dumps({"sig": "x", "job": {"a": [1] * 10}}).encode(),
        b"\xff\xfe",
        b" " * (1 << 20),  # far larger than any control message
        None,
        orjson.dumps({**orjson.loads(_msg(finding_id="c")), "step": "forty"}),  # signed, bad
        _msg(finding_id="b"),
    ]
    assert li.handle_batch(batch) == 2
    assert [a.finding_id for a in li.accepted] == ["a", "b"]
    assert sum(li.rejected.values()) == len(batch) - 2, li.rejected


def test_a_restarted_rank_refuses_a_replayed_message(tmp_path):
    captured = _msg(finding_id="r1")
    first = _listener(tmp_path)
    assert first.handle(captured) is not None
    restarted = _listener(tmp_path)  # a new process: memory gone, the state file kept
    assert restarted.handle(captured) is None
    assert restarted.rejected == {"replayed": 1}
    assert restarted.handle(_msg(finding_id="r2")) is not None  # genuine new ones still pass


def test_an_unusable_state_file_falls_back_to_memory(tmp_path, caplog):
    (tmp_path / "seen.json").write_text("[[[[ not json")
    li = _listener(tmp_path)
    raw = _msg(finding_id="u1")
    assert li.handle(raw) is not None and li.handle(raw) is None  # still once per process
    assert json.loads((tmp_path / "seen.json").read_text())  # rewritten, usable again
