"""GPU health (fatal) and GPU throttle (consensus) detectors on assembled steps.

Frames get their GPU columns through the engine's own join (pipeline/gpu_join)
from real ``gpu`` records, so the detectors are tested on what they will see.
"""

from __future__ import annotations

import numpy as np
import pytest
from rankscope.collectors.schema.records import GpuRecord, validate_record
from rankscope.detectors.gpu import health as gpu_health
from rankscope.detectors.gpu import throttle as gpu_throttle
from rankscope.detectors.gpu.health import CRITICAL_XIDS, GpuHealthConfig, GpuHealthState
from rankscope.detectors.gpu.readings import clock_events, gpu_context
from rankscope.detectors.gpu.throttle import GpuThrottleConfig, GpuThrottleState
from rankscope.pipeline.engine.gpu_join import GpuJoin
from support.synth import layout, make_frame

LAY = layout(dp=8, ranks_per_host=4)


def healthy(rank, t, **kw):
    base = dict(job="j", host=f"h{rank // 4}", gpu=rank % 4, t=t, rank=rank, util_pct=97.0,
                temp_c=64.0, power_w=650.0, sm_clock_mhz=1980.0, clock_events=["sw_power_cap"],
                ecc_sbe=0, ecc_dbe=0, remap_pending=False, remap_failed=False,
                nvlink_errors=0)
    base.update(kw)
    return validate_record(GpuRecord(**base).to_dict())


class Run:
    """Feeds per-rank GPU overrides step by step through GpuJoin into detector states."""

    def __init__(self, module, cfg=None, compute=None):
        self.mod = module
        self.cfg = cfg or module.CONFIG()
        self.state = module.STATE(self.cfg)
        self.join = GpuJoin()
        self.compute = compute

    def step(self, step, overrides=None, t=None, new_sample=True):
        t = 1000.0 + step if t is None else t
        if new_sample:
            for r in range(8):
                self.join.observe(healthy(r, t, **(overrides or {}).get(r, {})))
        metrics = {"t": np.full(8, t)}
        if self.compute is not None:
            metrics["compute_s"] = self.compute(step)
        frame = make_frame(LAY, step, metrics)
        advance = getattr(self.join, "advance", None)  # as the assembler does for each step
        if advance is not None:
            advance(t)
        frame.gpu = self.join.columns(frame.rank)
        out = self.mod.detect(frame, self.state, self.cfg)
        named = {r for s in out.signals for r in s.ranks}
        clean = np.array([int(r) not in named for r in frame.rank])
        self.state.learn(frame, clean)
        return out


# ---- gpu_health ---------------------------------------------------------------------


def test_every_documented_critical_xid_is_fatal_at_once_with_its_reason():
    assert {48, 63, 64, 74, 79, 92, 94, 95, 119, 120} <= set(CRITICAL_XIDS)
    for xid in CRITICAL_XIDS:
        run = Run(gpu_health)
        run.step(0)
        out = run.step(1, {5: {"xid": [xid]}})
        (sig,) = out.signals
        assert (sig.kind, sig.ranks, sig.severity, sig.detector) == ("gpu", (5,), "fatal",
                                                                     "gpu_health")
        assert sig.evidence["causes"][0]["xid"] == xid
        assert sig.evidence["causes"][0]["reason"] == CRITICAL_XIDS[xid]
        assert sig.evidence["gpu"] == 1


def test_non_critical_xid_is_ignored():
    run = Run(gpu_health)
    run.step(0)
    assert run.step(1, {2: {"xid": [13, 31, 43]}}).signals == []  # application errors


def test_xid_between_steps_is_not_lost_to_a_later_sample():
    run = Run(gpu_health)
    run.step(0)
    run.join.observe(healthy(3, 1000.5, xid=[79]))  # XID sample, then a plain one
    out = run.step(1)
    assert [s.ranks for s in out.signals] == [(3,)]


def test_ecc_dbe_rise_is_fatal_and_keeps_the_incident_open():
    run = Run(gpu_health)
    for s in range(3):
        assert run.step(s, {6: {"ecc_dbe": 2}}).signals == []  # volatile count seen at start
    out = run.step(3, {6: {"ecc_dbe": 3}})
    (sig,) = out.signals
    assert sig.ranks == (6,)
    assert sig.evidence["causes"] == [{"cause": "ecc_dbe_growth", "before": 2.0, "now": 3.0}]
    assert run.step(4, {6: {"ecc_dbe": 3}}).signals[0].ranks == (6,)  # baseline not taught


def test_counter_reset_becomes_the_new_baseline():
    run = Run(gpu_health)
    run.step(0, {1: {"nvlink_errors": 50}})
    assert run.step(1, {1: {"nvlink_errors": 0}}).signals == []
    out = run.step(2, {1: {"nvlink_errors": 4}})
    assert out.signals[0].evidence["causes"][0]["cause"] == "nvlink_errors_growth"


def test_remap_failure_and_temperature_thresholds():
    run = Run(gpu_health)
    run.step(0)
    out = run.step(1, {0: {"remap_failed": True}, 4: {"temp_c": 88.0}, 7: {"temp_c": 95.0}})
    by_rank = {s.ranks[0]: s.evidence["causes"][0]["cause"] for s in out.signals}
    assert by_rank == {0: "remap_failed", 4: "temp_at_slowdown", 7: "temp_at_shutdown"}
    assert all(s.severity == "fatal" for s in out.signals)


def test_healthy_and_unsupported_readings_give_nothing():
    run = Run(gpu_health)
    gone = dict(ecc_dbe=None, nvlink_errors=None, remap_failed=None, temp_c=None)
    for s in range(5):
        assert run.step(s, {r: gone for r in range(0, 8, 2)}).signals == []


def test_no_gpu_columns_is_a_no_op():
    frame = make_frame(LAY, 0, {})
    assert gpu_health.detect(frame, GpuHealthState(), GpuHealthConfig()).signals == []
    assert gpu_throttle.detect(frame, GpuThrottleState(), GpuThrottleConfig()).signals == []


def test_health_state_round_trip():
    run = Run(gpu_health)
    run.step(0, {2: {"ecc_dbe": 1}})
    st = GpuHealthState()
    st.load_state_dict(run.state.state_dict())
    run.state = st
    assert run.step(1, {2: {"ecc_dbe": 2}}).signals[0].ranks == (2,)


# ---- gpu_throttle -------------------------------------------------------------------


THROTTLED = {"sm_clock_mhz": 1350.0, "power_w": 420.0, "temp_c": 86.0,
             "clock_events": ["sw_thermal", "hw_slowdown"]}


def slow_compute(rank, factor=1.4):
    return lambda step: np.where(np.arange(8) == rank, 0.1 * factor, 0.1)


def test_thermal_throttle_against_peers_confirmed_and_joined_to_compute_time():
    run = Run(gpu_throttle, compute=slow_compute(3))
    for s in range(3):
        assert run.step(s).signals == []
    outs = [run.step(s, {3: THROTTLED}) for s in range(3, 7)]
    assert [len(o.signals) for o in outs[:2]] == [0, 0]  # two samples: not yet confirmed
    sig = outs[2].signals[0]
    assert (sig.kind, sig.ranks, sig.severity) == ("gpu", (3,), "persistent")
    ev = sig.evidence
    assert ev["metric"] == "sm_clock_mhz" and ev["value"] == 1350.0 and ev["peer_median"] == 1980
    assert "clock_below_peers" in ev["reasons"] and "thermal_throttle" in ev["reasons"]
    assert ev["clock_events"] == ["hw_slowdown", "sw_thermal"]
    assert ev["straggler"] is True and ev["compute_ratio_step"] == pytest.approx(1.4)
    assert ev["compute_ratio"] == pytest.approx(1.4)
    assert ev["compute_ratio_steps"] == 3  # since the onset: steps 3..5
    assert sig.score == pytest.approx(1 - 1350 / 1980)
    assert ev["onset_step"] == 3 and ev["streak_samples"] == 3
    assert outs[3].scores["gpu_sm_clock_mhz"][3] < -3


def test_confirmation_counts_gpu_samples_not_steps():
    run = Run(gpu_throttle)
    run.step(0)
    for s in range(1, 10):  # nine fast steps, one stale sample
        out = run.step(s, {3: THROTTLED}, t=2000.0 + s, new_sample=(s == 1))
        assert out.signals == []


def test_whole_host_overheating_is_seen_against_own_history():
    cfg = GpuThrottleConfig(history_min_samples=4)
    run = Run(gpu_throttle, cfg)
    for s in range(6):
        assert run.step(s).signals == []
    hot = {r: THROTTLED for r in range(8)}  # every peer at once: peers see nothing
    outs = [run.step(s, hot) for s in range(6, 9)]
    sig_ranks = sorted(r for s in outs[-1].signals for r in s.ranks)
    assert sig_ranks == list(range(8))
    assert outs[-1].signals[0].evidence["reasons"][0] == "clock_below_own_history"


def test_power_cap_alone_at_peer_level_is_not_a_fault():
    run = Run(gpu_throttle)
    for s in range(10):
        assert run.step(s, {r: {"clock_events": ["sw_power_cap"]} for r in range(8)}).signals == []


def test_power_drop_against_peers():
    run = Run(gpu_throttle)
    for s in range(6):
        out = run.step(s, {5: {"power_w": 300.0, "clock_events": ["hw_power_brake"]}})
    sig = out.signals[0]
    assert sig.ranks == (5,) and sig.evidence["metric"] == "power_w"
    assert "power_below_peers" in sig.evidence["reasons"]


def test_two_slow_ranks_of_eight_still_attributed_but_half_is_not():
    run = Run(gpu_throttle)
    for s in range(4):
        out = run.step(s, {1: THROTTLED, 6: THROTTLED})
    assert sorted(sig.ranks[0] for sig in out.signals) == [1, 6]
    run = Run(gpu_throttle)
    for s in range(4):
        out = run.step(s, {r: THROTTLED for r in range(4)})
    assert out.signals == []  # no strict healthy majority among peers


def test_throttle_state_round_trip_and_config_checks():
    run = Run(gpu_throttle)
    for s in range(3):
        run.step(s, {2: THROTTLED})
    st = GpuThrottleState()
    st.load_state_dict(run.state.state_dict())
    assert st.streak.count[2] == 3 and st.onset[2] == 0
    for bad in (dict(clock_drop_frac=0), dict(power_drop_frac=1.5), dict(z_min=0),
                dict(confirm_samples=0), dict(history_min_samples=40), dict(straggler_ratio=0.5)):
        with pytest.raises(ValueError):
            GpuThrottleConfig(**bad)
    for bad in (dict(critical_xids=(0,)), dict(ecc_dbe_growth_min=0),
                dict(nvlink_error_growth_min=0), dict(temp_slowdown_c=95.0)):
        with pytest.raises(ValueError):
            GpuHealthConfig(**bad)


def test_readers_accept_lists_bitmask_and_per_reason_columns():
    frame = make_frame(LAY, 0, {})
    frame.gpu = {"clock_events": np.array([["sw_thermal"], None] + [[]] * 6, dtype=object)}
    assert clock_events(frame)[:3] == [frozenset({"sw_thermal"}), None, frozenset()]
    frame.gpu = {"clock_events": np.array([0x40 | 0x4] + [np.nan] * 7)}
    assert clock_events(frame)[0] == {"hw_thermal", "sw_power_cap"}
    frame.gpu = {"clock_hw_slowdown": np.array([1.0, 0.0] + [np.nan] * 6)}
    assert clock_events(frame)[:3] == [frozenset({"hw_slowdown"}), frozenset(), None]
    frame.gpu = {"sm_clock_mhz": np.full(8, 1400.0), "clock_events": np.full(8, 32.0)}
    assert gpu_context(frame, 0) == {"sm_clock_mhz": 1400.0, "clock_events": ["sw_thermal"]}


def test_replayed_in_one_batch_readings_stay_with_their_steps():
    """Replay feeds thousands of records at once: a step must see the GPU reading of its time."""
    from rankscope.collectors.schema.records import StepRecord
    from rankscope.pipeline.engine.engine import Engine

    recs = []
    for s in range(40):
        t = 1000.0 + 0.5 * s
        for r in range(8):
            slow = r == 3 and s >= 20
            recs.append(StepRecord(job="j", rank=r, step=s, world=8, host=f"h{r // 4}", t=t,
                                   compute_s=0.15 if slow else 0.1, step_s=0.2).to_dict())
            if s % 2 == 0:
                recs.append(healthy(r, t - 0.2, xid=[79] if (r == 6 and s == 30) else None,
                                    **(THROTTLED if slow else {})))
    eng = Engine()
    eng.feed(recs)
    eng.flush()
    found = {(f.kind, tuple(f.ranks), f.detector): f for f in eng.findings() if f.kind == "gpu"}
    xid = found[("gpu", (6,), "gpu_health")]
    assert (xid.first_step, xid.last_step) == (30, 30)
    thr = found[("gpu", (3,), "gpu_throttle")]
    assert thr.first_step == 20 and thr.detected_step <= 25
    assert thr.evidence["straggler"] is True
    assert thr.evidence["compute_ratio"] == pytest.approx(1.5)


def test_a_straggler_on_a_throttling_gpu_carries_the_gpu_reading():
    from rankscope.detectors.straggler import detector as straggler

    run = Run(straggler, compute=slow_compute(3, factor=1.6))
    for s in range(6):
        out = run.step(s, {3: THROTTLED})
    (sig,) = [s for s in out.signals if s.ranks == (3,)]
    assert sig.kind == "straggler"
    assert sig.evidence["gpu"] == {"sm_clock_mhz": 1350.0, "power_w": 420.0, "temp_c": 86.0,
                                   "util_pct": 97.0, "clock_events": ["hw_slowdown",
                                                                      "sw_thermal"]}
