"""The GPU collector against a real NVIDIA driver: readings must be sane.

Marked ``gpu``; skipped with the reason where no driver or GPU is present.
Run on a GPU machine with ``pytest -m gpu -s tests/test_gpu_real_nvml.py``;
the readings are printed so they can be quoted.
"""

from __future__ import annotations

import time

import pytest
from rankscope.collectors.gpu.collector import GpuCollector, GpuCollectorConfig
from rankscope.collectors.gpu.nvml import NvmlBackend, NvmlUnavailable
from rankscope.collectors.schema.records import validate_record
from support.sinks import ListSink

pytestmark = pytest.mark.gpu


def _gpu_count() -> tuple[int, str]:
    backend = NvmlBackend()
    try:
        return len(backend.open()), ""
    except NvmlUnavailable as exc:
        return 0, str(exc)
    finally:
        backend.close()


_COUNT, _WHY = _gpu_count()
needs_gpu = pytest.mark.skipif(_COUNT == 0, reason=f"no NVIDIA GPU here: {_WHY or 'none found'}")


@needs_gpu
def test_real_readings_are_sane():
    sink = ListSink()
    coll = GpuCollector("real", sink=sink, rank_map={0: 0})
    assert coll.open(), coll.notice
    recs = coll.collect()
    coll.close()
    assert len(recs) == _COUNT
    for r in recs:
        validate_record(r)
        print("\nNVML reading:", {k: v for k, v in r.items() if k not in ("v", "type", "job")})
        assert 0 <= r["util_pct"] <= 100
        assert 0 < r["mem_used_mb"] < 4 * 2**20
        assert 0 < r["temp_c"] < 120
        if "power_w" in r:
            assert 0 < r["power_w"] < 2000
        assert 0 < r["sm_clock_mhz"] < 5000
        assert all(isinstance(e, str) for e in r.get("clock_events", []))
        for counter in ("ecc_sbe", "ecc_dbe", "pcie_replay", "nvlink_errors"):
            assert r.get(counter, 0) >= 0
        if "temp_slowdown_c" in r:
            assert r["temp_c"] < r["temp_slowdown_c"] <= r.get("temp_shutdown_c", 1e9)


@needs_gpu
def test_real_thread_samples_and_closes_promptly():
    sink = ListSink()
    cfg = GpuCollectorConfig(interval_s=0.25, counters_interval_s=1.0)
    coll = GpuCollector("real", sink=sink, config=cfg).start()
    time.sleep(1.3)
    t0 = time.monotonic()
    coll.close()
    closed_s = time.monotonic() - t0
    print(f"\nclose took {closed_s:.3f}s; XID events watched: {coll._watching}; "
          f"samples {coll.stats.samples}; driver {coll.driver_version}")
    assert coll.notice is None
    assert coll.stats.samples >= 3
    assert len(sink.records) >= 3 * _COUNT
