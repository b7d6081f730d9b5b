"""Heatmap scores: bucketed by job size, the largest magnitude in a bucket kept."""

from __future__ import annotations

import numpy as np
from rankscope.pipeline.engine.assemble import AssemblerConfig
from rankscope.pipeline.engine.engine import Engine, EngineConfig
from rankscope.pipeline.engine.scores import ScoreBuckets
from support.engine_synth import make_records


def test_small_jobs_keep_every_step_and_big_jobs_bucket():
    small = ScoreBuckets("j", cells_per_step=1024)
    small.add(0, 8, np.arange(8), {"compute_s": np.zeros(8), "data_s": np.ones(8)})
    assert small.bucket_steps == 1
    big = ScoreBuckets("j", cells_per_step=1024)
    rank = np.arange(4096)
    big.add(0, 4096, rank, {m: np.zeros(4096) for m in ("a", "b", "c", "d", "e")})
    assert big.bucket_steps == 20  # 4096 x 5 / 1024


def test_a_bucket_keeps_the_score_of_largest_magnitude_and_skips_nan():
    b = ScoreBuckets("j", cells_per_step=1)  # 4 ranks x 1 metric: 4 steps a bucket
    rank = np.arange(4)
    b.add(0, 4, rank, {"m": np.array([1.0, -5.0, np.nan, 0.5])})
    b.add(1, 4, rank, {"m": np.array([3.0, 2.0, np.nan, -0.1])})
    assert b.drain() is None  # bucket (steps 0..3) still open
    b.add(4, 4, rank, {"m": np.array([0.0, 0.0, 0.0, 0.0])})
    rows = b.drain()
    assert rows["step"].tolist() == [0, 0, 0] and rows["steps"].tolist() == [4, 4, 4]
    assert rows["rank"].tolist() == [0, 1, 3]
    assert rows["score"].tolist() == [3.0, -5.0, 0.5]
    assert b.drain(final=True)["step"].tolist() == [4] * 4


def test_engine_scores_cover_every_rank_and_step_of_a_small_job():
    engine = Engine(EngineConfig(strict=True))
    engine.feed(make_records(steps=10))
    engine.flush()
    (cols,) = engine.drain_scores(final=True)
    metrics = set(cols["metric"].tolist())
    assert {"compute_s"} <= metrics
    sel = cols["metric"] == "compute_s"
    assert sorted(set(cols["step"][sel].tolist())) == list(range(10))
    assert sorted(set(cols["rank"][sel].tolist())) == list(range(8))


def test_wall_clock_engine_uses_time_when_now_is_omitted():
    engine = Engine(EngineConfig(assembler=AssemblerConfig(clock="wall"), strict=True))
    recs = make_records(steps=3)
    assert engine.feed(recs) == []
    assert engine.stats("job-a")["detected_frames"] == 3
