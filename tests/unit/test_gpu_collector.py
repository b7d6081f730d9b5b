"""GPU collector against the fake NVML: readings, unsupported functions, lost GPUs, XIDs."""

from __future__ import annotations

import logging
import queue
import time

import pytest
from rankscope.collectors.gpu.collector import GpuCollector, GpuCollectorConfig
from rankscope.collectors.gpu.nvml import NVML_FUNCTIONS, NvmlBackend, clock_event_names
from rankscope.collectors.schema.records import validate_record
from rankscope.collectors.sinks.embedded import register_channel, unregister_channel
from support.fake_nvml import FakeNvml, install
from support.sinks import ListSink

FAST = GpuCollectorConfig(interval_s=0.05, counters_interval_s=0.05, event_wait_s=0.02,
                          flush_interval_s=0.05, close_timeout_s=2.0)


def wait_for(pred, timeout_s=5.0):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return False


def collector(fake, **kw):
    kw.setdefault("sink", ListSink())
    kw.setdefault("config", FAST)
    return GpuCollector("job-g", host="gpuhost", nvml=fake, **kw)


def test_readings_become_valid_gpu_records_in_trace_units():
    fake = FakeNvml(2)
    g = fake.gpus[1]
    g.power_mw, g.temp_c, g.sm_clock_mhz, g.util_pct = 412_500, 71, 1410, 88
    g.mem_used_bytes = 3 * 2**30
    g.clock_event_mask = 0x20 | 0x8  # sw_thermal + hw_slowdown
    g.ecc_sbe, g.ecc_dbe, g.pcie_replay, g.remap_failed = 5, 1, 7, 1
    g.nvlink_errors = {(0, 0): 2, (3, 2): 5, (9, 1): 100}  # link 9 inactive: not counted
    c = collector(fake, rank_map={0: 8, 1: 9})
    assert c.open()
    recs = c.collect(now=1000.0)
    assert [r["gpu"] for r in recs] == [0, 1]
    r = validate_record(recs[1])
    assert r["rank"] == 9 and r["host"] == "gpuhost" and r["t"] == 1000.0
    assert r["power_w"] == 412.5 and r["temp_c"] == 71.0 and r["sm_clock_mhz"] == 1410.0
    assert r["util_pct"] == 88.0 and r["mem_used_mb"] == 3072.0
    assert r["clock_events"] == ["hw_slowdown", "sw_thermal"]
    assert (r["ecc_sbe"], r["ecc_dbe"], r["pcie_replay"]) == (5, 1, 7)
    assert r["remap_failed"] is True and r["remap_pending"] is False
    assert r["nvlink_errors"] == 7
    assert r["temp_slowdown_c"] == 87.0 and r["temp_shutdown_c"] == 92.0
    assert "xid" not in r
    c.close()


def test_unsupported_readings_are_absent_never_errors():
    fake = FakeNvml(1)
    fake.gpus[0].unsupported = {
        "nvmlDeviceGetPowerUsage", "nvmlDeviceGetRemappedRows", "nvmlDeviceGetNvLinkState",
        "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetTotalEccErrors",
        "nvmlDeviceGetTemperatureThreshold", "nvmlDeviceGetSupportedEventTypes",
    }
    c = collector(fake)
    assert c.open()
    (r,) = c.collect()
    validate_record(r)
    for gone in ("power_w", "remap_failed", "remap_pending", "clock_events", "ecc_sbe",
                 "ecc_dbe", "nvlink_errors", "temp_slowdown_c"):
        assert gone not in r
    assert r["temp_c"] == 62.0 and r["pcie_replay"] == 0
    assert fake.calls["nvmlDeviceGetNvLinkErrorCounter"] == 0  # no links found, none read
    c.close()


def test_old_driver_without_clock_event_reasons_uses_the_throttle_name():
    fake = FakeNvml(1)
    fake.missing = {"nvmlDeviceGetCurrentClocksEventReasons"}
    fake.gpus[0].clock_event_mask = 0x40
    c = collector(fake)
    assert c.open()
    assert c.collect()[0]["clock_events"] == ["hw_thermal"]
    assert fake.calls["nvmlDeviceGetCurrentClocksThrottleReasons"] == 1
    assert fake.calls["nvmlDeviceGetCurrentClocksEventReasons"] == 1  # the probe only
    c.close()


def test_clock_event_names_cover_known_and_unknown_bits():
    assert clock_event_names(0) == []
    assert clock_event_names(None) is None
    assert clock_event_names(0x4 | 0x80 | 0x40) == ["sw_power_cap", "hw_thermal", "hw_power_brake"]
    assert clock_event_names(0x1000) == ["0x1000"]


def test_thread_samples_every_gpu_and_maps_ranks():
    fake = FakeNvml(8)
    sink = ListSink()
    c = collector(fake, sink=sink, rank_map={i: 16 + i for i in range(8)}).start()
    assert wait_for(lambda: len(sink.records) >= 24)
    c.close()
    assert c.notice is None
    assert {r["gpu"] for r in sink.records} == set(range(8))
    assert all(r["rank"] == 16 + r["gpu"] for r in sink.records)
    assert c.stats.samples >= 3


def test_devices_subset_samples_only_those():
    fake = FakeNvml(4)
    c = collector(fake, devices=[2], rank_map={2: 5})
    assert c.open()
    recs = c.collect()
    assert [(r["gpu"], r["rank"]) for r in recs] == [(2, 5)]
    c.close()


def test_xid_event_is_reported_at_once_on_its_gpu():
    fake = FakeNvml(4)
    sink = ListSink()
    cfg = GpuCollectorConfig(interval_s=30.0, counters_interval_s=30.0, event_wait_s=0.05,
                             flush_interval_s=0.05)
    c = collector(fake, sink=sink, config=cfg).start()
    assert wait_for(lambda: len(sink.records) >= 4)  # the first sample
    fake.inject_xid(2, 79)
    assert wait_for(lambda: any(r.get("xid") for r in sink.records), timeout_s=3.0)
    c.close()
    with_xid = [r for r in sink.records if r.get("xid")]
    assert [(r["gpu"], r["xid"]) for r in with_xid] == [(2, [79])]
    assert c.stats.xids == 1


def test_an_event_wait_that_returns_at_once_does_not_spin():
    import pynvml

    fake = FakeNvml(1)
    waits = []

    def impatient_wait(event_set, timeout_ms):
        waits.append(timeout_ms)
        raise pynvml.NVMLError_Timeout()

    fake.nvmlEventSetWait = impatient_wait
    cfg = GpuCollectorConfig(interval_s=0.5, counters_interval_s=0.5, event_wait_s=0.05)
    c = collector(fake, config=cfg).start()
    time.sleep(0.5)
    c.close()
    assert c.notice is None and c.stats.samples >= 1
    assert 3 <= len(waits) <= 30  # about one per event_wait_s, not a busy loop


def test_no_driver_gives_one_notice_and_stays_idle(caplog):
    fake = FakeNvml(2, driver=False)
    sink = ListSink()
    with caplog.at_level(logging.WARNING, logger="rankscope.collectors"):
        c = collector(fake, sink=sink).start()
        assert c.ready.wait(5)
        time.sleep(0.1)
        c.close()
    assert c.idle and "no usable NVIDIA driver" in c.notice
    assert sink.records == []
    notices = [m for m in caplog.messages if "GPU telemetry is off" in m]
    assert len(notices) == 1


def test_no_gpu_on_host_is_idle():
    c = collector(FakeNvml(0))
    assert not c.open() and "no GPU" in c.notice
    c.close()


def test_driver_vanishing_mid_run_stops_quietly(caplog):
    fake = FakeNvml(2)
    sink = ListSink()
    with caplog.at_level(logging.WARNING, logger="rankscope.collectors"):
        c = collector(fake, sink=sink).start()
        assert wait_for(lambda: len(sink.records) >= 4)
        fake.vanish()
        assert wait_for(lambda: c.idle)
        n = c.stats.records
        time.sleep(0.2)
        assert c.stats.records == n  # nothing more sampled after the driver left
        assert not c._thread.is_alive()
        c.close()
    assert "went away" in c.notice
    assert sum("GPU telemetry is off" in m for m in caplog.messages) == 1


def test_lost_gpu_is_dropped_and_the_others_go_on():
    fake = FakeNvml(3)
    c = collector(fake)
    assert c.open()
    assert len(c.collect()) == 3
    fake.gpus[1].lost = True
    recs = c.collect()
    assert [r["gpu"] for r in recs] == [0, 2]
    assert c.devices == [0, 2] and c.stats.lost_gpus == [1]
    assert not c.idle
    c._pending_xids[2] = [94]
    fake.gpus[2].lost = True
    assert [r["gpu"] for r in c.collect()] == [0]
    assert c._pending_xids == {}  # an XID of a lost GPU cannot keep the loop sampling
    c.close()


def test_counters_are_read_on_their_own_interval():
    fake = FakeNvml(1)
    cfg = GpuCollectorConfig(interval_s=0.01, counters_interval_s=60.0)
    c = collector(fake, config=cfg)
    assert c.open()
    c.collect()
    fake.gpus[0].ecc_dbe = 3
    recs = [c.collect() for _ in range(3)]
    assert fake.calls["nvmlDeviceGetTotalEccErrors"] == 2  # sbe + dbe, read once
    assert all(r[0]["ecc_dbe"] == 0 for r in recs)  # last value read is repeated
    c.close()


def test_records_reach_an_embedded_sink_through_the_sender():
    q: queue.Queue = queue.Queue()
    register_channel("gpu-test", q)
    try:
        c = collector(FakeNvml(2), sink="embedded://gpu-test").start()
        got = []
        assert wait_for(lambda: got.extend(_drain(q)) or len(got) >= 2)
        c.close()
    finally:
        unregister_channel("gpu-test")
    assert all(validate_record(r)["type"] == "gpu" for r in got)


def _drain(q):
    out = []
    while True:
        try:
            item = q.get_nowait()
        except queue.Empty:
            return out
        out.extend(item if isinstance(item, list) else [item])


def test_fake_is_found_where_pynvml_is_imported(monkeypatch):
    fake = install(monkeypatch, FakeNvml(1))
    backend = NvmlBackend()
    assert [d.index for d in backend.open()] == [0]
    assert fake.calls["nvmlInit"] == 1
    backend.close()
    assert set(NVML_FUNCTIONS) <= set(dir(FakeNvml))


def test_bad_sink_url_fails_at_construction():
    with pytest.raises(ValueError, match="scheme"):
        GpuCollector("j", "nope://x", nvml=FakeNvml(1))
    with pytest.raises(ValueError, match="exactly one"):
        GpuCollector("j", nvml=FakeNvml(1))


@pytest.mark.parametrize("bad", [
    dict(interval_s=0), dict(counters_interval_s=-1), dict(event_wait_s=0),
    dict(interval_s=2.0, counters_interval_s=1.0), dict(queue_size=0),
    dict(batch_max_records=0), dict(flush_interval_s=0), dict(close_timeout_s=-1),
])
def test_config_checks(bad):
    with pytest.raises(ValueError):
        GpuCollectorConfig(**bad)
