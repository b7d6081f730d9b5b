"""The clock `serve` gives a partition's engine (pipeline/serve/align.py StreamClock):
wall time, held while a backlog is read, and never advanced by more than a turn's
share while the service itself was busy."""

from __future__ import annotations

from rankscope.pipeline.serve.align import TURN_S, StreamClock


def test_caught_up_and_idle_the_clock_is_the_wall():
    """Polls every 0.1 s with nothing behind: a rank that stopped beating 10 s ago
    has been silent 10 s on this clock too (crashes are named on time)."""
    clock = StreamClock()
    start = clock(1000.0, 0)
    now = start
    for k in range(1, 101):
        now = clock(1000.0 + 0.1 * k, 0)
    assert abs(now - start - 10.0) < 1e-9


def test_a_backlog_holds_the_clock_still():
    clock = StreamClock()
    clock(1000.0, 0)
    held = [clock(1000.0 + 0.1 * k, 50) for k in range(1, 40)]
    assert max(held) - min(held) < 1e-9
    resumed = clock(1004.1, 0)
    assert abs(resumed - held[-1]) < 1e-9  # no jump when the backlog is read
    assert abs(clock(1004.2, 0) - resumed - 0.1) < 1e-9


def test_a_busy_turn_counts_only_a_turn():
    """The last two messages of a published trace read 4 s apart because serve was busy
    (a checkpoint, a loaded host): the ranks whose last beats came first have not been
    silent 4 s, and were named crashed when the clock said so."""
    clock = StreamClock()
    before = clock(1000.0, 1)
    after = clock(1004.0, 0)
    assert abs(after - before - TURN_S) < 1e-9
    assert abs(clock(1004.1, 0) - after - 0.1) < 1e-9  # then the wall again
