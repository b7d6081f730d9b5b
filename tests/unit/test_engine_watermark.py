"""The event clock (``serve``): steps built by the event-time watermark, not by arrival."""

from __future__ import annotations

import pytest
from rankscope.pipeline.engine.assemble import AssemblerConfig, StepAssembler
from rankscope.pipeline.engine.engine import Engine, EngineConfig
from support.engine_synth import make_records

NOW = 1000.0


def _event(**over) -> StepAssembler:
    return StepAssembler(AssemblerConfig(clock="event", max_pending_steps=256, **over))


def _by_rank(recs):
    return sorted(recs, key=lambda r: (r["rank"], r["step"]))


def test_records_rank_by_rank_build_whole_steps():
    """The worst legal order, one rank's whole history after another's, at one instant:
    the wall clock would expire every step with ranks missing; the watermark waits."""
    recs = _by_rank(make_records(steps=30))
    asm = _event()
    frames = []
    for i in range(0, len(recs), 16):
        asm.add_records(recs[i : i + 16], NOW)
        frames.extend(asm.ready(NOW))
    assert [f.step for f in frames] == list(range(30))
    assert all(f.missing.size == 0 for f in frames)
    assert asm.stats("job-a").get("partial_frames", 0) == 0


def test_wall_clock_expires_the_same_stream_with_ranks_missing():
    """The control: the same stream on the wall clock, arriving 2 s apart per rank."""
    recs = _by_rank(make_records(steps=30))
    asm = StepAssembler(AssemblerConfig(clock="wall", max_pending_steps=256,
                                        initial_deadline_s=1.0))  # fmt: skip
    for r in range(8):
        asm.add_records([x for x in recs if x["rank"] == r], NOW + 2 * r)
        asm.ready(NOW + 2 * r)
    assert asm.stats("job-a")["partial_frames"] > 0


def test_a_step_missing_a_rank_waits_for_the_watermark_not_for_arrival():
    recs = make_records(steps=40, vanish=(3, 20))  # rank 3 stops at step 20
    asm = _event(stall_s=5.0)
    frames = []
    for i in range(0, len(recs), 8):
        asm.add_records(recs[i : i + 8], NOW)
        frames.extend(asm.ready(NOW))
    # rank 3 is still live (heard from within stall_s): its last time holds the watermark
    assert max(f.step for f in frames) == 19
    # once it has been silent for stall_s, the others' times carry the watermark on
    frames = asm.ready(NOW + 6.0)
    assert frames and frames[0].step == 20 and 3 in frames[0].missing.tolist()
    # steps whose deadline the other ranks have not yet passed stay open
    assert asm.pending_steps("job-a")


def test_a_rank_not_heard_from_yet_holds_the_watermark_while_the_job_is_young():
    recs = [r for r in make_records(steps=20) if r["rank"] != 7]
    asm = _event(stall_s=5.0, initial_deadline_s=1.0)  # no step time known yet
    asm.add_records(recs, NOW)
    assert asm.ready(NOW + 1.0) == []
    assert asm.ready(NOW + 6.0)  # never came: no longer waited for


def test_a_quiet_job_has_delivered_everything():
    recs = make_records(steps=30, vanish=(2, 5))  # 0.2 s steps, deadline floor 2 s
    asm = _event(stall_s=2.0)
    asm.add_records(recs, NOW)
    got = asm.ready(NOW + 0.5)
    assert [f.step for f in got] == list(range(5))
    got = asm.ready(NOW + 3.0)  # nothing at all for stall_s: the latest t is the watermark
    assert [f.step for f in got] == list(range(5, 20))  # opened 2 s or more before step 29
    assert all(f.missing.tolist() == [2] for f in got)
    assert asm.pending_steps("job-a") == list(range(20, 30))


def test_complete_steps_of_a_gpu_job_wait_for_the_samples_up_to_their_time():
    recs = make_records(steps=6, dp=2, tp=1)
    asm = _event()
    sample = {"v": 1, "type": "gpu", "job": "job-a", "host": "h0", "gpu": 0, "rank": 0,
              "t": recs[0]["t"] - 0.01, "temp_c": 60.0}  # fmt: skip
    asm.add_records([sample], NOW)
    asm.add_records(recs, NOW)
    assert asm.ready(NOW) == []  # the GPU source has not reached step 0's time
    later = {**sample, "t": recs[-1]["t"] + 0.5, "temp_c": 90.0}
    asm.add_records([later], NOW)
    frames = asm.ready(NOW)
    assert [f.step for f in frames] == list(range(6))
    assert frames[0].gpu["temp_c"][0] == 60.0  # each step joins the sample of its time


def test_beats_reach_the_monitor_only_behind_the_watermark():
    """Beats of ranks 0-6 far ahead of rank 7's must not make rank 7 look silent."""
    seen = []

    class Monitor:
        def observe_beats(self, beats, now=None):
            seen.extend(beats)

        def observe_frame(self, frame):
            pass

        def check(self, now):
            return []

        def state_dict(self):
            return {}

        def load_state_dict(self, d):
            pass

    from rankscope.pipeline.engine.assemble import AssemblerConfig as AC

    cfg = EngineConfig(assembler=AC(clock="event"))
    eng = Engine(cfg, beat_monitor_factory=lambda j: Monitor())
    steps = make_records(steps=2, dp=8, tp=1)
    beats = [{"v": 1, "type": "beat", "job": "job-a", "rank": r, "host": "h", "t": t,
              "step": 1, "phase": "forward"}
             for r in range(8) for t in ((steps[0]["t"] + 50.0) if r < 7 else steps[0]["t"],)]
    eng.feed(steps + beats, NOW)
    assert {b["rank"] for b in seen} == {7}  # only rank 7's beat is behind the watermark
    eng.flush()
    assert len(seen) == 8  # end of stream: all of them


@pytest.mark.parametrize("bad", [0.0, -1.0])
def test_stall_must_be_positive(bad):
    with pytest.raises(ValueError, match="stall_s"):
        AssemblerConfig(clock="event", stall_s=bad)


def _serve_a_job(after_step_19: str, seconds: float, delay: float = 0.3, configs=None):
    """A 4-rank job (0.5 s steps, 1 s beats) fed to an event-clock engine as ``serve``
    feeds it: each record ``delay`` wall seconds after its time, a tick every 0.1 s.
    After step 19: ``crash`` (rank 3 stops, 0-2 beat on waiting in dp#20) or ``silent``
    (every rank stops). Returns [(wall time, finding)] and rank 3's last beat time."""
    from support.engine_synth import T0

    recs = make_records(steps=20, dp=4, tp=1, step_s=0.5)

    def beat(rank, t, step, **coll):
        return {"v": 1, "type": "beat", "job": "job-a", "rank": rank, "host": "h0", "t": t,
                "step": step, "phase": "collective", "coll_group": "dp", **coll}  # fmt: skip

    for step in range(20):
        t = T0 + 0.5 * step + 0.01
        recs += [beat(r, t, step, coll_seq=step, coll_done=True) for r in range(4)]
    last_beat_3 = T0 + 0.5 * 19 + 0.01
    if after_step_19 == "crash":
        for i in range(int(seconds)):
            t = T0 + 10.0 + i
            recs += [beat(r, t, 20, coll_seq=20, coll_done=False) for r in range(3)]
    recs.sort(key=lambda r: r["t"])
    eng = Engine(EngineConfig(assembler=AssemblerConfig(clock="event")), detector_configs=configs)
    out, i = [], 0
    for k in range(int((10.0 + seconds) / 0.1)):
        now = T0 + 0.1 * k
        batch = []
        while i < len(recs) and recs[i]["t"] + delay <= now:
            batch.append(recs[i])
            i += 1
        out += [(now, f) for f in (eng.feed(batch, now) if batch else eng.tick(now))]
    return out, last_beat_3


def test_serve_names_a_crashed_rank_within_5_s_of_its_last_beat():
    found, last = _serve_a_job("crash", seconds=20)
    hang = [(now, f) for now, f in found if f.detector == "hang"]
    assert [(f.kind, f.ranks, f.action) for _, f in hang][:1] == [("crash", [3], "evict")]
    assert 3.0 <= hang[0][0] - last <= 5.0  # wall time from its last beat to the finding
    assert not [f for _, f in found if f.action == "evict" and f.ranks != [3]]


def test_serve_catches_a_job_that_falls_wholly_silent_and_blames_no_rank():
    """Every rank stops at once: the watermark's clock stood still at the last record
    (nothing was ever said); now the silence is measured on the wall clock and, at the
    stall deadline, reported as a stall of the whole job, with no culprit."""
    found, last = _serve_a_job("silent", seconds=16)
    hang = [(now, f) for now, f in found if f.detector == "hang"]
    assert [(f.kind, f.ranks, f.unattributed, f.action) for _, f in hang] == [
        ("hang", [0, 1, 2, 3], True, "observe")
    ]
    assert 10.0 <= hang[0][0] - last <= 12.0  # the deadline: max(10 s, 10 x p99 step)
    assert not [f for _, f in found if f.action in ("evict", "recover")]


def test_the_crash_bound_follows_the_serve_flag():
    from argparse import Namespace

    from rankscope.pipeline.cli.verdict_flags import verdict_configs

    configs = verdict_configs(Namespace(crash_within=8.0, hang_within=None))
    found, last = _serve_a_job("crash", seconds=20, configs=configs)
    hang = [(now, f) for now, f in found if f.detector == "hang"]
    assert [(f.kind, f.ranks) for _, f in hang][:1] == [("crash", [3])]
    assert 6.0 <= hang[0][0] - last <= 8.0
