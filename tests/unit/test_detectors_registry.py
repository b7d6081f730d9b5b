"""Every registered detector keeps the protocol, survives bad input and restores its state."""

from __future__ import annotations

import math

import numpy as np
import orjson
import pytest
from rankscope.collectors.schema.records import LABEL_KINDS
from rankscope.detectors.registry import DETECTORS, default_configs, spec_by_name
from rankscope.detectors.signal import SEVERITIES, DetectorOutput
from support.synth import layout, make_frame

LAY = layout(4, 2, 2)
W = 16


def messy_frames():
    """Steps with NaN and inf readings, ranks that arrive late or vanish, duplicates, nothing."""
    rng = np.random.default_rng(31)
    frames = []
    for step in range(14):
        m = {
            "t": np.full(W, 1.7e9 + step),
            "compute_s": 0.2 * (1 + 0.02 * rng.standard_normal(W)),
            "comm_s": 0.05 + 0.01 * rng.random(W),
            "data_s": np.full(W, 0.002),
            "loss": 2.0 + 0.1 * rng.standard_normal(W),
            "grad_norm": 1.0 + 0.1 * rng.standard_normal(W),
            "grad_norm_reduced": np.repeat([1.0, 2.0, 3.0, 4.0], 4),
            "nonfinite": np.zeros(W),
        }
        m["step_s"] = m["compute_s"] + m["comm_s"] + m["data_s"]
        if step == 4:
            for col in m:
                m[col][[1, 7]] = np.nan
        if step == 5:
            m["grad_norm"][2] = np.inf
            m["loss"][:] = np.nan
        if step >= 8:
            m["compute_s"][9] *= 1.6
        rows = None
        if step in (2, 3):
            rows = np.arange(0, W, 2)  # half the ranks late
        if step == 6:
            rows = np.array([], dtype=np.int64)
        if step >= 10:
            rows = np.array([r for r in range(W) if r != 3])  # rank 3 vanished
        digest = np.array([f"d{g}" for g in LAY["group"]], dtype=object)
        colls = [[{"op": "allreduce", "group": "dp", "seq": step, "s": float(m["comm_s"][r])},
                  {"op": "bogus"}] for r in range(W)]
        frames.append(make_frame(LAY, step, m, rows=rows, digest=digest, collectives=colls,
                                 checks=[{"rank": 0, "check": "c", "group": "g",
                                          "signature": "s"}]))
    garbage = make_frame(LAY, 14, {"compute_s": np.full(W, 0.2), "grad_norm": np.ones(W)})
    garbage.rank = garbage.rank.copy()
    garbage.rank[[0, 5]] = [-7, 2**40]  # a broken writer's rank ids: no giant allocations
    frames.append(garbage)
    return frames


def test_registry_lists_unique_names_with_default_configs():
    names = [s.name for s in DETECTORS]
    assert len(names) == len(set(names))
    assert {"straggler", "network", "metric_outlier", "digest_vote", "reduced_grad",
            "check_vote", "nonfinite_origin"} <= set(names)
    cfgs = default_configs()
    assert set(cfgs) == set(names)
    assert all(isinstance(cfgs[s.name], s.config_cls) for s in DETECTORS)
    assert spec_by_name("straggler").name == "straggler"
    with pytest.raises(KeyError, match="known"):
        spec_by_name("nope")


@pytest.mark.parametrize("spec", DETECTORS, ids=lambda s: s.name)
def test_protocol_on_messy_input_and_state_roundtrip(spec):
    cfg = spec.config_cls()
    state = spec.make_state(cfg)
    kinds = set()
    for frame in messy_frames():
        out = spec.detect(frame, state, cfg)
        assert isinstance(out, DetectorOutput)
        for metric, z in out.scores.items():
            assert isinstance(metric, str) and np.asarray(z).shape == (frame.n,)
        for sig in out.signals:
            assert sig.kind in LABEL_KINDS and sig.severity in SEVERITIES
            assert sig.detector == spec.name and math.isfinite(sig.score)
            assert set(sig.ranks) <= set(frame.rank.tolist()) and sig.ranks
            orjson.dumps(sig.evidence)  # evidence must be storable as JSON
            assert {"metric", "value", "peer_median", "peers", "history_median"} <= set(
                sig.evidence
            ), sig.evidence
            kinds.add(sig.kind)
        named = [r for s in out.signals for r in s.ranks]
        clean = ~np.isin(frame.rank, named) & np.isfinite(frame.m["compute_s"])
        state.learn(frame, clean)
    saved = orjson.loads(orjson.dumps(state.state_dict()))
    restored = spec.make_state(cfg)
    restored.load_state_dict(saved)
    assert orjson.dumps(restored.state_dict()) == orjson.dumps(state.state_dict())
    if spec.name == "straggler":
        assert kinds == {"straggler"}  # rank 9's slowdown survives the mess


def test_learning_is_separate_from_detecting():
    """detect never teaches the baseline: the same step scored twice scores the same."""
    frames = messy_frames()
    for spec in DETECTORS:
        cfg = spec.config_cls()
        state = spec.make_state(cfg)
        for f in frames[:8]:
            spec.detect(f, state, cfg)
            state.learn(f, np.ones(f.n, dtype=bool))
        before = orjson.dumps(state.state_dict(), option=orjson.OPT_SERIALIZE_NUMPY)
        a = spec.detect(frames[8], state, cfg)
        b = spec.detect(frames[8], state, cfg)
        for metric in a.scores:
            np.testing.assert_array_equal(a.scores[metric], b.scores[metric])
        after = orjson.dumps(state.state_dict(), option=orjson.OPT_SERIALIZE_NUMPY)
        if spec.name in ("straggler", "metric_outlier"):
            assert orjson.loads(before)["history"] == orjson.loads(after)["history"]


def test_the_hang_monitor_is_registered_and_the_engine_knows_it_only_through_the_registry():
    from rankscope.detectors.hang.monitor import HangMonitor
    from rankscope.detectors.registry import BEAT_DETECTORS, beat_monitor_factory
    from rankscope.pipeline.engine.assemble import AssemblerConfig
    from rankscope.pipeline.engine.engine import Engine, EngineConfig
    from support.paths import ROOT

    assert [s.name for s in BEAT_DETECTORS] == ["hang"]
    live = beat_monitor_factory(True)("job")
    assert isinstance(live, HangMonitor) and live.cfg.stamp_at_check
    assert not beat_monitor_factory(False)("job").cfg.stamp_at_check
    replay = Engine(EngineConfig()).beat_monitor_factory("j")
    wall = Engine(EngineConfig(assembler=AssemblerConfig(clock="wall"))).beat_monitor_factory("j")
    assert isinstance(replay, HangMonitor) and not replay.cfg.stamp_at_check
    assert wall.cfg.stamp_at_check
    assert "detectors.hang" not in (ROOT / "pipeline/engine/engine.py").read_text()
