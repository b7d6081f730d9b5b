"""Device timing's event logic on CPU: scripted events stand in for CUDA's.

``ScriptedEvent`` is the only fake: it behaves as ``torch.cuda.Event`` does at
its boundary (``record``, ``query``, ``elapsed_time`` in ms, raising when an
event is incomplete), stamped from a scripted device clock: each record takes
the next timestamp of a script, or the device's cursor. The device has run up
to ``progress``; a host clock and sleep are scripted too, so waits are exact.
"""

from __future__ import annotations

import logging
import queue

import pytest
import torch
import torch.distributed as dist
from rankscope.collectors import CollectorConfig, RankCollector
from rankscope.collectors.rank.device_timing import DeviceTiming
from rankscope.collectors.sinks.embedded import iter_channel, register_channel, unregister_channel


class Device:
    def __init__(self, script=()):
        self.script = list(script)  # timestamps the next records land at, in order
        self.cursor = 0.0
        self.progress = float("inf")  # the device has run everything up to here
        self.created = 0

    def event(self):
        self.created += 1
        return ScriptedEvent(self)


class ScriptedEvent:
    def __init__(self, dev: Device) -> None:
        self.dev, self.t = dev, None

    def record(self):
        self.t = self.dev.script.pop(0) if self.dev.script else self.dev.cursor

    def query(self):
        return self.t is not None and self.dev.progress >= self.t

    def elapsed_time(self, end):
        if not (self.query() and end.query()):
            raise RuntimeError("elapsed_time on an incomplete event")
        return (end.t - self.t) * 1e3


class Host:
    """A host clock that only moves when the resolver sleeps (and lets the device run)."""

    def __init__(self, dev: Device, device_speed: float = 0.0) -> None:
        self.now, self.dev, self.speed, self.sleeps = 100.0, dev, device_speed, 0

    def clock(self):
        return self.now

    def sleep(self, dt):
        self.sleeps += 1
        self.now += dt
        self.dev.progress += dt * self.speed


def _timing(dev, host=None, **kw):
    host = host or Host(dev)
    return DeviceTiming(events=dev.event, clock=host.clock, sleep=host.sleep, **kw), host


def _step(tm, stamps, dev):
    """One step: begin, then (begin, end) blocked pairs, then the end."""
    dev.script = list(stamps)
    tm.step_begin()
    for _ in range((len(stamps) - 2) // 2):
        tm.blocked_end(tm.blocked_begin())
    return tm.step_end()


def test_span_minus_blocked_intervals_in_record_order():
    dev = Device()
    tm, _ = _timing(dev)
    ev = _step(tm, [0.0, 0.030, 0.050, 0.060, 0.065, 0.100], dev)
    compute, comm = tm.resolve(ev)
    assert comm == pytest.approx(0.025) and compute == pytest.approx(0.075)
    assert tm.stats.resolved == 1 and tm.stats.fallback == tm.stats.dropped == 0


def test_ddp_tail_from_last_launch_to_latest_completion():
    dev = Device([0.0, 0.040, 0.055, 0.060, 0.090, 0.080, 0.100])
    tm, _ = _timing(dev)
    tm.step_begin()  # 0.0
    tm.bucket_launched()  # 0.040
    tm.bucket_done()  # 0.055
    tm.bucket_launched()  # 0.060: the last launch
    tm.bucket_done()  # 0.090: the latest completion
    tm.bucket_done()  # 0.080
    compute, comm = tm.resolve(tm.step_end())  # 0.100
    assert comm == pytest.approx(0.030) and compute == pytest.approx(0.070)


def test_blocked_time_never_exceeds_the_span():
    dev = Device()
    tm, _ = _timing(dev)
    # a wait whose end lands after the step's end event (another stream): clamped
    compute, comm = tm.resolve(_step(tm, [0.0, 0.01, 0.5, 0.1], dev))
    assert comm == pytest.approx(0.1) and compute == 0.0


def test_incomplete_events_resolve_once_the_device_gets_there():
    dev = Device()
    tm, host = _timing(dev, Host(dev, device_speed=1.0), wait_s=2.0)
    dev.progress = 0.0  # the device has not run the step yet; it runs at host speed
    ev = _step(tm, [0.0, 0.2, 0.3, 0.5], dev)
    t0 = host.now
    compute, comm = tm.resolve(ev)
    assert comm == pytest.approx(0.1) and compute == pytest.approx(0.4)
    assert 0.49 < host.now - t0 < 0.6 and host.sleeps > 1  # polled, not blocked
    assert tm.stats.resolved == 1 and tm.stats.fallback == 0


def test_a_step_never_completing_goes_out_with_cpu_times_after_a_bounded_wait(caplog):
    dev = Device()
    tm, host = _timing(dev, wait_s=1.5)
    dev.progress = 0.0  # a hung device: nothing ever completes
    with caplog.at_level(logging.WARNING, logger="rankscope.collectors"):
        first = _step(tm, [0.0, 0.1], dev)
        t0 = host.now
        assert tm.resolve(first) is None
        assert host.now - t0 == pytest.approx(1.5, abs=0.01)  # bounded: wait_s
        host.now += 10.0  # the next step closes long after: its wait is its own
        assert tm.resolve(_step(tm, [1.0, 1.1], dev)) is None
    assert tm.stats.fallback == 2 and tm.stats.resolved == 0
    said = [r for r in caplog.records if "did not complete" in r.getMessage()]
    assert len(said) == 1  # once


def test_steps_past_max_pending_are_dropped_and_counted_then_accepted_again():
    dev = Device()
    tm, _ = _timing(dev, max_pending=2)
    a, b = _step(tm, [0.0, 0.1], dev), _step(tm, [0.1, 0.2], dev)
    assert _step(tm, [0.2, 0.3], dev) is None and tm.stats.dropped == 1
    tm.resolve(a)
    c = _step(tm, [0.3, 0.4], dev)  # a finished: room again
    assert c is not None
    assert tm.resolve(b) == pytest.approx((0.1, 0.0))
    assert tm.resolve(c) == pytest.approx((0.1, 0.0))


def test_events_are_reused_once_resolved():
    dev = Device()
    tm, _ = _timing(dev)
    for i in range(10):
        tm.resolve(_step(tm, [i, i + 0.01, i + 0.02, i + 0.05], dev))
    assert dev.created == 4 and tm.stats.resolved == 10


def test_a_failing_event_costs_the_step_its_device_times_never_raises(caplog):
    calls = {"n": 0}
    dev = Device()

    def flaky():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("CUDA error: out of memory")
        return dev.event()

    tm = DeviceTiming(events=flaky)
    with caplog.at_level(logging.WARNING, logger="rankscope.collectors"):
        assert _step(tm, [0.0, 0.1, 0.2, 0.3], dev) is None
    assert tm.stats.dropped == 1 and "recording a device timing event failed" in caplog.text
    assert tm.resolve(_step(tm, [0.0, 0.1, 0.2, 0.3], dev)) == pytest.approx((0.2, 0.1))


def test_config_checks_device_timing_settings():
    with pytest.raises(ValueError, match="device_timing_wait_s"):
        CollectorConfig(device_timing_wait_s=-1)
    with pytest.raises(ValueError, match="device_timing_max_pending"):
        CollectorConfig(device_timing_max_pending=0)
    with pytest.raises(ValueError, match="device_events"):
        CollectorConfig(device_events=3)


def test_collector_writes_device_times_for_sync_and_async_collectives(tmp_path):
    """The attached collector's events, in the order the loop makes them: forward,
    the synchronous all-reduce, the async one's wait, the boundary."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1
    )  # fmt: skip
    q: queue.Queue = queue.Queue()
    register_channel("dev-timing", q)
    dev = Device()
    per_step = [0.0, 0.040, 0.050, 0.060, 0.075, 0.100]  # 10 ms + 15 ms blocked
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = CollectorConfig(device_events=dev.event, digest_every_steps=0)
    rc = RankCollector.attach(model, opt, job="d", sink="embedded://dev-timing", config=cfg)
    try:
        for i in range(4):
            dev.script = [i + t for t in per_step]
            loss = model(torch.randn(4, 8)).square().mean()
            loss.backward()
            dist.all_reduce(model.weight.grad)
            work = dist.all_reduce(model.bias.grad, async_op=True)
            work.wait()
            rc.loss(loss)
            opt.step()
            opt.zero_grad()
    finally:
        rc.close()
        unregister_channel("dev-timing")
        dist.destroy_process_group()
    steps = [r for r in iter_channel(q) if r["type"] == "step"]
    assert [r["step"] for r in steps] == [0, 1, 2, 3]
    for r in steps:
        assert r["compute_s"] == pytest.approx(0.075) and r["comm_s"] == pytest.approx(0.025)
        assert [c["op"] for c in r["collectives"]] == ["allreduce", "allreduce"]
        assert all(c["s"] >= 0 for c in r["collectives"])
    assert rc.device_timing.resolved == 4 and not rc.faults
    assert not dev.script  # every scripted stamp was taken: no event more, none less
