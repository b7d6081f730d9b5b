"""The Kafka sink in a real training loop while the real broker goes away and comes back."""

from __future__ import annotations

import subprocess
import threading
import time

import orjson
import pytest
from rankscope.pipeline.bus.kafka import KafkaBus
from support.kafka import ROOT, consume_all, wait_for

pytestmark = pytest.mark.kafka


def _broker(cmd: str) -> None:
    done = subprocess.run([str(ROOT / "scripts/kafka"), cmd], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"scripts/kafka {cmd} failed: {done.stderr[-2000:]}")


def test_training_goes_on_while_the_broker_is_down(kafka_url):
    import torch
    from rankscope.collectors import RankCollector

    KafkaBus(kafka_url).ensure_topics(partitions=1, kinds=("telemetry", "gpu"))
    model = torch.nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rc = RankCollector.attach(
        model, opt, job="outage", rank=0, world=1, host="node00", beat_interval_s=0.5,
        sink=kafka_url + "&buffer_records=40&linger_ms=5&flush_timeout_s=10",
    )  # fmt: skip
    x, y = torch.randn(32, 16), torch.randn(32, 1)
    outage: dict[str, float] = {}

    failure: list[BaseException] = []

    def stop_for_10s():
        try:
            _broker("down")
            outage["down"] = time.monotonic()
            time.sleep(10)
            outage["restarting"] = time.monotonic()
            _broker("up")
            outage["up"] = time.monotonic()
        except BaseException as exc:
            failure.append(exc)

    longest, step, t_end = 0.0, 0, None
    t_start = time.monotonic()
    stopper = threading.Thread(target=stop_for_10s)
    try:
        while (t_end is None or time.monotonic() < t_end) and not failure:
            t0 = time.monotonic()
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            rc.loss(loss.detach())
            opt.step()
            time.sleep(0.04)  # the rest of a real step
            longest = max(longest, time.monotonic() - t0)
            step += 1
            if step == 30:
                stopper.start()
            if t_end is None and "up" in outage:
                t_end = time.monotonic() + 3.0  # train on a while after the broker is back
    finally:
        if stopper.is_alive():
            stopper.join()
        rc.close()
    assert not failure, failure
    assert longest < 1.0, f"a training step took {longest:.2f} s while the broker was away"

    print({k: round(v - t_start, 1) for k, v in outage.items()}, "end", time.monotonic() - t_start)
    msgs = consume_all(kafka_url, "telemetry", expect=10**9, timeout_s=30, idle_s=2.0)
    records = []
    for m in msgs:
        body = orjson.loads(m.value)
        records.extend(body if isinstance(body, list) else [body])
    steps = sorted(r["step"] for r in records if r["type"] == "step")
    assert steps[0] == 0 and steps[-1] == step - 1  # before the outage and after it
    missing = sorted(set(range(step)) - set(steps))
    assert missing, "the 40-record buffer cannot have held a 10 s outage"
    # The gap is counted where it ends: the first step *or beat* record the sink took
    # after the drops began carries the count (both kinds carry ``dropped``; which one
    # comes first is chance), so at the latest the first step record after the gap.
    after_gap = min((r for r in records if r["type"] == "step" and r["step"] > missing[0]),
                    key=lambda r: r["step"])  # fmt: skip
    carriers = [r for r in records if r["type"] in ("step", "beat") and r.get("dropped", 0) > 0]
    near = [r for r in carriers if missing[0] - 1 <= r["step"] <= after_gap["step"]]
    assert near, (missing[:3], missing[-3:], after_gap, carriers[:3])
    print("gap", missing[0], "-", missing[-1], "count first on",
          [(r["type"], r["step"], r["dropped"]) for r in near[:2]])  # fmt: skip
    total_dropped = sum(r["dropped"] for r in carriers)
    assert total_dropped >= len(missing)


def test_a_dropped_record_passes_on_the_count_it_carried(kafka_url):
    """A record the sink has no room for may itself carry a count (stamped by the
    collector's sender); dropping it must not lose that count."""
    from rankscope.collectors.sinks.kafka import KafkaSink

    KafkaBus(kafka_url).ensure_topics(partitions=1, kinds=("telemetry",))
    sink = KafkaSink.from_url(kafka_url + "&buffer_records=2&linger_ms=0")
    rec = {"v": 1, "type": "step", "job": "carry", "rank": 0, "world": 1, "host": "h", "t": 1.0}
    try:
        sink.send([{**rec, "step": 0}, {**rec, "step": 1}])  # the bound is reached
        sink.send([{**rec, "step": 2, "dropped": 5}])  # no room: gone, with its 5
        assert sink.stats()["dropped"] == 1
        wait_for(lambda: sink.stats()["sent"] == 2, 30, "the first two records delivered")
        sink.send([{**rec, "step": 3}])
    finally:
        sink.close()
    got = {}
    for m in consume_all(kafka_url, "telemetry", expect=2):
        body = orjson.loads(m.value)
        got.update({r["step"]: r.get("dropped", 0) for r in (body if isinstance(body, list)
                                                              else [body])})  # fmt: skip
    assert got == {0: 0, 1: 0, 3: 6}


def test_the_sink_knows_its_producers_network_thread(kafka_url):
    """The slow-loop warning is held back by thread name: the real client's network
    thread must be among the names the sink gave the filter."""
    from rankscope.collectors.sinks import kafka as sink_mod

    KafkaBus(kafka_url).ensure_topics(partitions=1, kinds=("telemetry",))
    sink = sink_mod.KafkaSink.from_url(kafka_url + "&linger_ms=0")
    rec = {"v": 1, "type": "step", "job": "names", "rank": 0, "step": 0, "world": 1,
           "host": "h", "t": 1.0}  # fmt: skip
    try:
        sink.send([rec])
        wait_for(lambda: sink.stats()["sent"] == 1, 30, "the record delivered")
        live = {t.name for t in threading.enumerate()} - {sink._thread.name}
        assert live & sink_mod._QUIET.threads  # the producer's own thread is known
    finally:
        sink.close()
