"""The wait-for graph itself, on hand-made rank views (no clocks, no beats)."""

from __future__ import annotations

from rankscope.detectors.hang.wait_graph import RankView, localize


def waiting(rank, group, seq, **kw):
    return RankView(rank=rank, blocked=True, head_group=group, head_seq=seq, **kw)


def running(rank, **kw):
    return RankView(rank=rank, **kw)


def test_ranks_that_never_entered_are_the_culprits():
    views = {0: waiting(0, "g", 7), 1: waiting(1, "g", 7), 2: running(2, entered={"g": 6})}
    loc = localize(views, {"g": [0, 1, 2]})
    assert loc.hang == [2] and loc.crash == [] and loc.waiting == {0: [2], 1: [2]}


def test_intermediate_waiter_is_not_blamed_and_chain_ends_in_sink():
    views = {
        0: waiting(0, "tp0", 20, entered={"tp0": 20}),
        1: waiting(1, "dp1", 10, entered={"tp0": 19, "dp1": 10}),
        3: running(3, entered={"dp1": 9}),
    }
    loc = localize(views, {"tp0": [0, 1], "dp1": [1, 3]})
    assert loc.culprits == [3] and loc.waiting == {0: [1], 1: [3]}


def test_unreported_and_silent_sinks_are_crashes():
    views = {
        0: waiting(0, "g", 3),
        1: RankView(rank=1, seen=False, alive=False),
        2: running(2, alive=False, entered={"g": 2}),
    }
    loc = localize(views, {"g": [0, 1, 2]})
    assert loc.crash == [1, 2] and loc.hang == []
    assert "never reported" in loc.reasons[1] and "stopped" in loc.reasons[2]


def test_rank_whose_peers_finished_its_head_is_locally_stuck():
    views = {
        0: running(0, entered={"g": 9}, done={"g": 9}),
        1: running(1, entered={"g": 9}, done={"g": 9}),
        2: waiting(2, "g", 8, entered={"g": 8}, done={"g": 7}),
    }
    loc = localize(views, {"g": [0, 1, 2]})
    assert loc.hang == [2] and "already finished" in loc.reasons[2]


def test_member_blocked_on_an_older_op_holds_the_collective_up():
    # All of tp entered tp#5; rank 1 is blocked on an earlier pp transfer to 2.
    views = {
        0: waiting(0, "tp", 5),
        1: RankView(rank=1, blocked=True, head_group="pp", head_peer=2, entered={"tp": 5}),
        2: running(2),
    }
    loc = localize(views, {"tp": [0, 1], "pp": [1, 2]})
    assert loc.waiting == {0: [1], 1: [2]} and loc.hang == [2]


def test_deadlock_cycle_and_stuck_transfer_are_unattributed():
    cycle = {0: waiting(0, "a", 4, entered={"b": 3}), 1: waiting(1, "b", 4, entered={"a": 3})}
    loc = localize(cycle, {"a": [0, 1], "b": [0, 1]})
    assert loc.culprits == [] and loc.unattributed == [0, 1]
    both = {0: waiting(0, "g", 4), 1: waiting(1, "g", 4)}
    loc = localize(both, {"g": [0, 1]})
    assert loc.culprits == [] and loc.unattributed == [0, 1]
    assert "none finished" in loc.reasons[0]
    p2p = {
        0: RankView(rank=0, blocked=True, head_group="pp", head_peer=1),
        1: RankView(rank=1, blocked=True, head_group="pp", head_peer=0),
    }
    assert localize(p2p, {}).unattributed == [0, 1]


def test_membership_falls_back_to_ranks_seen_in_the_group():
    views = {0: waiting(0, "g", 2), 1: running(1, entered={"g": 1}), 2: running(2)}
    loc = localize(views, {})
    assert loc.hang == [1]  # 2 never touched g: not a member as far as anyone knows


def test_waiting_on_a_stuck_collective_is_not_blaming_its_members():
    # tp=[0, 1] both inside tp#3 and nobody finishes; 2 waits in dp for 0 (stuck in tp).
    views = {
        0: waiting(0, "tp", 3, entered={"dp": 4}),
        1: waiting(1, "tp", 3),
        2: waiting(2, "dp", 5),
    }
    loc = localize(views, {"tp": [0, 1], "dp": [0, 2]})
    assert loc.culprits == [] and loc.unattributed == [0, 1]
    assert loc.waiting == {2: [0]}
