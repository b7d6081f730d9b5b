"""The beat-based hang monitor on hand-made beat sequences.

Each scenario trains healthily for a while (every rank beats, enters its
groups' collectives and advances steps), then freezes into a hang: the
healthy ranks keep beating from inside a collective, the culprit keeps
beating from somewhere else (or stops). The monitor must name exactly the
culprit, only after the stall deadline, with the right kind.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from rankscope.detectors.hang.monitor import Config, HangMonitor

JOB = "j"


def beat(rank, t, step, phase, group=None, seq=None, done=None, host=None, **extra):
    rec = {"v": 1, "type": "beat", "job": JOB, "rank": rank, "t": t, "step": step, "phase": phase}
    rec["host"] = host or f"h{rank // 2}"
    if group is not None:
        rec.update(coll_group=group, coll_seq=seq, coll_op="allreduce", coll_done=done)
    rec.update(extra)
    return rec


def train(mon, groups, steps=20, step_s=1.0, skew=None, t0=1000.0, stamp=True):
    """Healthy steps: every rank beats at each step boundary after finishing its groups'
    collective of that step. Feeds with ``now`` = true time; ``skew`` shifts record times."""
    skew = skew or {}
    ranks = sorted({r for m in groups.values() for r in m})
    for k in range(steps):
        now = t0 + k * step_s
        batch = []
        for r in ranks:
            mine = [g for g, m in groups.items() if r in m]
            for g in mine:
                batch.append(beat(r, now + skew.get(r, 0.0), k, "collective", g, k, True))
        mon.observe_beats(batch, now=now if stamp else None)
    return t0 + steps * step_s


def freeze(mon, states, t_start, seconds, step, skew=None, stamp=True, dead=()):
    """Every rank beats once a second in its frozen state; returns (signals, first time)."""
    skew = skew or {}
    found, first = [], None
    for i in range(int(seconds)):
        now = t_start + i
        batch = [
            beat(r, now + skew.get(r, 0.0), step, **st) for r, st in states.items() if r not in dead
        ]
        mon.observe_beats(batch, now=now if stamp else None)
        sig = mon.check(now)
        if sig and first is None:
            first = now
        found.extend(sig)
    return found, first


def blocked(group, seq):
    return {"phase": "collective", "group": group, "seq": seq, "done": False}


def by_kind(signals):
    out = {}
    for s in signals:
        key = s.kind if not s.unattributed else "unattributed"
        out.setdefault(key, set()).update(s.ranks)
    return out


def test_single_culprit_named_after_deadline_with_evidence():
    mon = HangMonitor(Config(stall_min_s=30.0))
    groups = {"dp": [0, 1, 2, 3]}
    t = train(mon, groups)
    states = {r: blocked("dp", 20) for r in (0, 1, 3)}
    states[2] = {"phase": "backward", "group": "dp", "seq": 19, "done": True}
    signals, first = freeze(mon, states, t, 60, step=20)
    assert by_kind(signals) == {"hang": {2}}
    assert 30 <= first - (t - 1) <= 32  # last progress was the final healthy step
    (sig,) = signals  # reported once, not again while the verdict stays the same
    assert sig.severity == "fatal" and sig.detector == "hang" and not sig.unattributed
    ev = sig.evidence
    assert ev["job"] == JOB and ev["step"] == 20 and ev["hosts"] == ["h1"]
    assert ev["ranks"]["2"]["phase"] == "backward"
    assert (ev["ranks"]["2"]["group"], ev["ranks"]["2"]["seq"]) == ("dp", 19)
    assert ev["waiting"] == {"0": [2], "1": [2], "3": [2]}
    json.dumps(ev)  # evidence goes to DuckDB as JSON


def test_no_signal_while_steps_progress_or_before_deadline():
    mon = HangMonitor(Config(stall_min_s=30.0))
    t = train(mon, {"dp": [0, 1, 2, 3]}, steps=60)
    assert mon.check(t) == []
    states = {r: blocked("dp", 60) for r in (0, 1, 3)}
    states[2] = {"phase": "forward"}
    signals, _ = freeze(mon, states, t, 25, step=60)
    assert signals == []


def test_deadline_scales_with_median_step_time():
    mon = HangMonitor(Config(stall_min_s=30.0, stall_step_factor=10.0))
    t = train(mon, {"dp": [0, 1]}, steps=12, step_s=5.0)
    assert mon.deadline_s(JOB) == pytest.approx(50.0)
    states = {0: blocked("dp", 12), 1: {"phase": "data"}}
    signals, first = freeze(mon, states, t, 70, step=12)
    assert by_kind(signals) == {"hang": {1}}
    assert first - (t - 5.0) >= 50.0


def test_two_groups_stuck_at_different_seqs():
    mon = HangMonitor()
    groups = {"tp0": [0, 1, 2, 3], "tp1": [4, 5, 6, 7]}
    t = train(mon, groups)
    states = {r: blocked("tp0", 50) for r in (0, 2, 3)}
    states |= {r: blocked("tp1", 70) for r in (4, 5, 7)}
    states[1] = {"phase": "forward", "group": "tp0", "seq": 49, "done": True}
    states[6] = {"phase": "optimizer", "group": "tp1", "seq": 69, "done": True}
    signals, _ = freeze(mon, states, t, 40, step=20)
    assert by_kind(signals) == {"hang": {1, 6}}


def test_rank_stuck_in_another_groups_collective_is_not_blamed():
    # 2x2 grid: dp groups are columns, tp groups rows. Rank 3 hangs computing.
    mon = HangMonitor()
    groups = {"dp0": [0, 2], "dp1": [1, 3], "tp0": [0, 1], "tp1": [2, 3]}
    t = train(mon, groups)
    states = {
        1: blocked("dp1", 20),  # waits for 3
        0: blocked("tp0", 20),  # waits for 1, which is stuck in dp1
        2: blocked("tp1", 20),  # waits for 3
        3: {"phase": "backward", "group": "tp1", "seq": 19, "done": True},
    }
    signals, _ = freeze(mon, states, t, 40, step=20)
    assert by_kind(signals) == {"hang": {3}}
    ev = signals[0].evidence
    assert ev["waiting"]["0"] == [1] and ev["waiting"]["1"] == [3]


def test_crashed_rank_is_named_within_crash_s_of_its_last_beat():
    mon = HangMonitor()
    t = train(mon, {"dp": [0, 1, 2, 3]})  # rank 3's last beat: t - 1
    states = {r: blocked("dp", 20) for r in (0, 1, 2)}
    states[3] = {"phase": "forward"}
    signals, first = freeze(mon, states, t, 45, step=20, dead=(3,))
    assert by_kind(signals) == {"crash": {3}}
    assert 3.0 <= first - (t - 1) <= 5.0  # crash_s = 5: not before 3 s of silence
    assert 3.0 <= signals[0].evidence["ranks"]["3"]["silent_s"] <= 5.0
    assert signals[0].severity == "fatal"


@pytest.mark.parametrize("crash_s, margin", [(10.0, 2.0), (4.0, 1.0)])
def test_the_crash_bound_is_configurable(crash_s, margin):
    mon = HangMonitor(Config(crash_s=crash_s, crash_margin_s=margin, stall_min_s=60.0))
    t = train(mon, {"dp": [0, 1, 2, 3]})
    states = {r: blocked("dp", 20) for r in (0, 1, 2)}
    states[3] = {"phase": "forward"}
    signals, first = freeze(mon, states, t, 30, step=20, dead=(3,))
    assert by_kind(signals) == {"crash": {3}}
    assert crash_s - margin <= first - (t - 1) <= crash_s


def test_a_silent_rank_is_no_early_crash_while_its_peers_compute():
    """Long steps: peers computing (not waiting for it) while one rank's beats pause
    is no evidence of a crash; only the stall deadline may speak."""
    mon = HangMonitor()
    t = train(mon, {"dp": [0, 1, 2, 3]})
    states = {r: {"phase": "forward"} for r in (0, 1, 2)}
    states[3] = {"phase": "forward"}
    signals, _ = freeze(mon, states, t, 9, step=20, dead=(3,))
    assert signals == []


def test_a_job_falling_silent_together_is_a_stall_of_the_whole_job():
    """Every rank stops at once (the job killed whole, or its link to rankscope lost):
    the last beats show 0-2 waiting for 3, as at any instant of healthy training, so
    no rank is blamed; the stall is reported at the deadline, unattributed."""
    mon = HangMonitor()
    t = train(mon, {"dp": [0, 1, 2, 3]})
    last = [beat(r, t, 20, **blocked("dp", 20)) for r in (0, 1, 2)]
    last.append(beat(3, t - 0.5, 20, "forward"))
    mon.observe_beats(last, now=t)
    signals, first = [], None
    for i in range(1, 60):
        got = mon.check(t + i)
        first = first if first is not None or not got else t + i
        signals += got
    assert by_kind(signals) == {"unattributed": {0, 1, 2, 3}}
    assert first - t == pytest.approx(mon.deadline_s(JOB))
    (sig,) = signals
    assert sig.severity == "transient" and "whole job went silent" in sig.evidence["reasons"]["3"]
    assert sig.evidence["waiting"] == {"0": [3], "1": [3], "2": [3]}  # said, never blamed


def test_a_crash_named_before_the_job_fell_silent_stays_the_verdict():
    # gloo: the survivors error out a few seconds after a peer dies.
    mon = HangMonitor()
    t = train(mon, {"dp": [0, 1, 2, 3]})
    signals, _ = freeze(mon, {r: blocked("dp", 20) for r in (0, 1, 2)}, t, 5, step=20)
    for i in range(5, 60):
        signals += mon.check(t + i)
    assert by_kind(signals) == {"crash": {3}}


def test_job_that_closed_while_blocked_is_localized_without_a_deadline():
    # gloo: a rank dies without a final beat, the others fail and close (final idle
    # beat) while still inside the collective: no stall deadline to wait for, only
    # the crash limit (3 s of silence): a rank not closed yet may have its close beat
    # on the way (serve's clock on real ranks blamed one whose close came 50 ms later).
    mon = HangMonitor()
    t = train(mon, {"dp": [0, 1, 2, 3]})
    mon.observe_beats([beat(1, t, 20, "backward")], now=t)
    closing = [beat(r, t + 0.3, 20, "idle", "dp", 20, False) for r in (0, 2, 3)]
    mon.observe_beats(closing, now=t + 0.3)
    assert mon.check(t + 0.3) == []
    signals = mon.check(t + 3.0)
    assert by_kind(signals) == {"crash": {1}}
    assert signals[0].evidence["step"] == 20
    assert signals[0].evidence["ranks"]["1"]["busy_phase"] == "backward"


def test_hung_rank_that_closed_is_a_hang_not_a_crash():
    mon = HangMonitor()
    t = train(mon, {"dp": [0, 1, 2, 3]})
    frozen = [beat(r, t + 4, 20, **blocked("dp", 20)) for r in (0, 1, 3)]
    mon.observe_beats(frozen + [beat(2, t + 4, 20, "forward", "dp", 19, True)], now=t + 4)
    assert mon.check(t + 4) == []  # before the deadline, everyone still beating
    closing = [beat(r, t + 5, 20, "idle", "dp", 20, False) for r in (0, 1, 3)]
    closing.append(beat(2, t + 5, 20, "idle", "dp", 19, True))
    mon.observe_beats(closing, now=t + 5)
    signals = mon.check(t + 5)
    assert by_kind(signals) == {"hang": {2}}
    assert signals[0].evidence["ranks"]["2"]["busy_phase"] == "forward"


def test_job_that_ended_is_not_a_crash():
    mon = HangMonitor()
    t = train(mon, {"dp": [0, 1, 2, 3]})
    mon.observe_beats([beat(r, t, 20, "idle") for r in range(4)], now=t)
    assert all(mon.check(t + i) == [] for i in range(1, 120))


@pytest.mark.parametrize("skew_s", [-400.0, 250.0])
def test_clock_skew_between_hosts(skew_s):
    # Host h1 (ranks 2, 3) has a clock far off. Live: arrivals are stamped by the
    # service. Replay: only record times exist; the step boundaries give the offset.
    for stamp in (True, False):
        mon = HangMonitor()
        skew = {2: skew_s, 3: skew_s}
        t = train(mon, {"dp": [0, 1, 2, 3]}, skew=skew, stamp=stamp)
        states = {r: blocked("dp", 20) for r in (0, 2, 3)}
        states[1] = {"phase": "backward"}
        signals, first = freeze(mon, states, t, 60, step=20, skew=skew, stamp=stamp)
        assert by_kind(signals) == {"hang": {1}}, (stamp, signals)
        assert 10 <= first - (t - 1) <= 13
        if not stamp:
            off = mon.offsets(JOB)
            assert off[2] - off[0] == pytest.approx(skew_s, abs=1.0)


def test_live_beats_are_stamped_with_the_service_clock_at_check():
    # The service's clock is 500 s ahead of every host: beats fed without `now`
    # take the time of the next check, so nothing looks silent or stalled early.
    mon = HangMonitor(Config(stamp_at_check=True))
    ahead = 500.0
    for k in range(20):
        mon.observe_beats([beat(r, 1000.0 + k, k, "collective", "dp", k, True) for r in range(4)])
        assert mon.check(1000.0 + k + ahead) == []
    t = 1020.0
    states = {r: blocked("dp", 20) for r in (0, 1, 3)}
    states[2] = {"phase": "data"}
    first = None
    for i in range(40):
        mon.observe_beats([beat(r, t + i, 20, **st) for r, st in states.items()])
        sig = mon.check(t + i + ahead)
        if sig:
            assert by_kind(sig) == {"hang": {2}} and first is None
            first = i
    assert first is not None and 9 <= first <= 11


def test_skewed_host_culprit_and_no_false_crash_in_replay():
    mon = HangMonitor()
    skew = {2: -300.0, 3: -300.0}
    t = train(mon, {"dp": [0, 1, 2, 3]}, skew=skew, stamp=False)
    states = {r: blocked("dp", 20) for r in (0, 1, 2)}
    states[3] = {"phase": "optimizer"}
    signals, _ = freeze(mon, states, t, 45, step=20, skew=skew, stamp=False)
    assert by_kind(signals) == {"hang": {3}}


def test_cycle_is_reported_unattributed():
    # 0 waits in a (0,1) while 1 waits in b (0,1): called in different orders.
    mon = HangMonitor()
    t = train(mon, {"a": [0, 1], "b": [0, 1]})
    states = {0: blocked("a", 20), 1: blocked("b", 20)}
    signals, _ = freeze(mon, states, t, 40, step=20)
    assert by_kind(signals) == {"unattributed": {0, 1}}
    assert all(s.severity == "transient" for s in signals)


def test_never_seen_member_is_crash_when_waited_for():
    mon = HangMonitor()
    mon.set_job_info(JOB, world=4, groups={"dp": [0, 1, 2, 3]})
    t = train(mon, {"dp": [0, 1, 2]}, steps=5)
    states = {r: blocked("dp", 5) for r in (0, 1, 2)}
    signals, _ = freeze(mon, states, t, 40, step=5)
    assert by_kind(signals) == {"crash": {3}}
    assert signals[0].evidence["ranks"]["3"] == {"host": None, "reported": False}


def test_state_dict_round_trip_keeps_the_verdict():
    mon = HangMonitor()
    t = train(mon, {"dp": [0, 1, 2, 3]})
    states = {r: blocked("dp", 20) for r in (0, 1, 3)}
    states[2] = {"phase": "forward"}
    freeze(mon, states, t, 10, step=20)
    saved = json.loads(json.dumps(mon.state_dict()))
    again = HangMonitor()
    again.load_state_dict(saved)
    signals, _ = freeze(again, states, t + 10, 30, step=20)
    assert by_kind(signals) == {"hang": {2}}
    with pytest.raises(ValueError):
        again.load_state_dict({"version": 99})


def test_columns_and_malformed_beats():
    mon = HangMonitor()
    cols = {"type": ["beat", "beat", "step"], "job": [JOB] * 3, "rank": np.array([0, 1, 0])}
    cols |= {"t": np.ones(3), "step": [0, 0, 0], "phase": ["forward"] * 3}
    cols |= {"coll_group": ["dp"] * 3, "coll_seq": [4, 4, 4], "coll_done": np.array([1, 0, 0]) > 0}
    assert mon.observe_beats(cols, now=1.0) == 2
    json.dumps(mon.state_dict())  # plain Python values, not numpy scalars
    import pyarrow as pa

    table = pa.table({"type": ["beat"], "job": [JOB], "rank": [2], "t": [2.0], "step": [1],
                      "phase": ["data"], "coll_seq": pa.array([None], pa.int64())})  # fmt: skip
    assert mon.observe_beats(table, now=2.0) == 1
    assert mon.observe_beats([{"type": "beat", "job": JOB, "rank": "x"}]) == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"stall_min_s": 0},
        {"stall_step_factor": 0.5},
        {"step_window": 0},
        {"beat_window": 0},
        {"offset_steps": 0},
        {"silence_min_s": -1},
        {"crash_s": 2.0, "crash_margin_s": 2.0},
        {"crash_margin_s": -0.5},
        {"crash_beat_factor": 0.5},
        {"silence_beat_factor": 0.9},
        {"evidence_ranks": 0},
    ],
)
def test_config_checks(kwargs):
    with pytest.raises(ValueError):
        Config(**kwargs)


def test_assembled_steps_are_progress_and_tell_the_world_size():
    mon = HangMonitor()
    for k in range(40):  # beats never show a step change; frames do
        frame = SimpleNamespace(job=JOB, step=k, world=4, t=1000.0 + k, coords={}, n=0)
        mon.observe_frame(frame)
        mon.observe_beats([beat(r, 1000.0 + k, 0, "forward") for r in range(3)], now=1000.0 + k)
        assert mon.check(1000.0 + k) == []
    assert mon.deadline_s(JOB) == 10.0
    signals, first = freeze(mon, {r: blocked("dp", 5) for r in range(3)}, 1040.0, 40, step=40)
    assert by_kind(signals) == {"crash": {3}}  # rank 3 of the world never reported
    assert first == 1040.0 + 10.0  # the beats' step moved to 40 at 1040: last progress


def train_on_grid(seq0: int) -> HangMonitor:
    """20 healthy steps of 4 ranks whose assembled steps give 2x2 (dp, tp) coordinates;
    every rank finishes "dp" seq ``seq0 + step`` in each."""
    mon = HangMonitor()
    rank = np.arange(4)
    coords = {"dp": rank // 2, "tp": rank % 2, "pp": np.zeros(4, dtype=np.int64)}
    for k in range(20):
        t = 1000.0 + k
        mon.observe_frame(SimpleNamespace(job=JOB, step=k, world=4, t=t, coords=coords, n=4,
                                          rank=rank))  # fmt: skip
        mon.observe_beats([beat(r, t, k, "collective", "dp", seq0 + k, True) for r in range(4)],
                          now=t)  # fmt: skip
    return mon


def test_axis_named_groups_are_told_apart_by_coordinates():
    # Collectors call every data-parallel group "dp". 2x2 grid: dp groups {0,2} and
    # {1,3}, tp groups {0,1} and {2,3}. {1,3} is stuck inside dp#50 together (a link
    # fault); {0,2} finished dp#50 and wait in tp#60 for 1 and 3. Nobody is to blame
    # alone -- lumping both dp groups into one would call 1 and 3 locally stuck.
    mon = train_on_grid(seq0=30)
    states = {
        0: blocked("tp", 60),
        2: blocked("tp", 60),
        1: {"phase": "collective", "group": "dp", "seq": 50, "done": False},
        3: {"phase": "collective", "group": "dp", "seq": 50, "done": False},
    }
    for r in (0, 2):  # they finished dp#50 before entering tp#60
        mon.observe_beats([beat(r, 1020.0, 20, "collective", "dp", 50, True)], now=1020.0)
    signals, _ = freeze(mon, states, 1020.0, 40, step=20)
    assert by_kind(signals) == {"unattributed": {1, 3}}


def test_coordinates_that_do_not_match_the_real_group_fall_back_to_the_name():
    # Plain data parallel over all 4 ranks ("dp"), but emulated coordinates claim
    # dp groups {0,2} and {1,3}: splitting would leave {0,2} "stuck together".
    mon = train_on_grid(seq0=0)
    states = {r: blocked("dp", 20) for r in (0, 1, 2)}
    states[3] = {"phase": "forward", "group": "dp", "seq": 19, "done": True}
    signals, _ = freeze(mon, states, 1020.0, 40, step=20)
    assert by_kind(signals) == {"hang": {3}}


def test_a_trace_that_ends_stalled_is_judged_by_the_end_deadline():
    """8 s inside a collective with rank 2 never entering it, then the trace ends
    (a watchdog killed the job): the live deadline (max(10 s, 10 x p99 step)) was
    never reached, the end-of-trace one (max(5 s, 10 x p99 step)) was."""
    mon = HangMonitor()
    t = train(mon, {"dp": [0, 1, 2, 3]}, step_s=0.5)
    assert mon.end_deadline_s(JOB) == pytest.approx(5.0)
    assert mon.deadline_s(JOB) == pytest.approx(10.0)
    states = {r: blocked("dp", 20) for r in (0, 1, 3)}
    states[2] = {"phase": "forward"}
    signals, _ = freeze(mon, states, t, 8, step=20)
    assert signals == []  # live: not yet
    assert by_kind(mon.check_end(t + 7)) == {"hang": {2}}


def test_the_hang_deadline_is_ten_p99_step_times_and_configurable():
    mon = HangMonitor()
    t = train(mon, {"dp": [0, 1, 2, 3]}, steps=40, step_s=0.5)
    slow = t - 0.5 + 2.5  # one slow step: step 40 begins 2.5 s after step 39
    mon.observe_beats([beat(r, slow, 40, "collective", "dp", 40, True) for r in range(4)], now=slow)
    assert mon.deadline_s(JOB) == pytest.approx(10 * 2.5)  # the p99, not the median
    assert HangMonitor(Config(stall_min_s=40.0)).deadline_s(JOB) == 40.0
    mon = HangMonitor(Config(stall_min_s=6.0))
    t = train(mon, {"dp": [0, 1, 2, 3]}, step_s=0.5)
    states = {r: blocked("dp", 20) for r in (0, 1, 3)}
    states[2] = {"phase": "forward"}
    signals, first = freeze(mon, states, t, 20, step=20)
    assert by_kind(signals) == {"hang": {2}} and first - t == pytest.approx(6.0)


def test_a_trace_that_ends_with_one_rank_silent_names_the_crash():
    states = {r: blocked("dp", 20) for r in (0, 1, 2)}
    states[3] = {"phase": "forward"}
    live = HangMonitor()
    t = train(live, {"dp": [0, 1, 2, 3]}, step_s=0.5)
    signals, first = freeze(live, states, t, 12, step=20, dead=(3,))
    assert by_kind(signals) == {"crash": {3}} and first - (t - 0.5) <= 5.0  # live, early
    assert live.check_end(t + 11) == []  # the same verdict, said once
    replay = HangMonitor()
    t = train(replay, {"dp": [0, 1, 2, 3]}, step_s=0.5, stamp=False)
    for i in range(12):
        replay.observe_beats([beat(r, t + i, 20, **states[r]) for r in (0, 1, 2)])
    assert by_kind(replay.check_end(t + 11)) == {"crash": {3}}


def test_a_trace_that_ends_soon_after_its_last_step_is_no_stall():
    mon = HangMonitor()
    t = train(mon, {"dp": [0, 1, 2, 3]}, step_s=0.5)
    states = {r: blocked("dp", 20) for r in range(4)}
    freeze(mon, states, t, 3, step=20)
    assert mon.check_end(t + 2) == []
