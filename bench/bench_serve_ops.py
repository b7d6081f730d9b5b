"""What serve's logs, metrics and alerts cost the consumer loop, per call and per record.

Side by side in one run, on the real objects (``ServeStats``, ``ServeObserver``,
the real metrics endpoint scraped over HTTP):

- counting a fed batch: ``ServeStats.count_records`` against the two counters
  the loop bumped before (records, per partition), inline;
- ``ServeObserver.turn`` on a turn with nothing due (every loop turn) and on a
  turn that refreshes the snapshot (once a second);
- ``ServeObserver.found`` on a re-report of a known finding (every step of an
  open incident) and the loop's old first-seen check it replaced;
- one scrape of the endpoint (off the loop, but it holds the GIL meanwhile).

Per-record figures divide a per-batch cost by ``--feed`` records (the loop's
``feed_records``, 4096) against the loop's ~5 µs a record (docs/kafka.md,
"Measured"). Asserts nothing about time.

    .venv/bin/python bench/bench_serve_ops.py [--n 200000] [--feed 4096]
"""

from __future__ import annotations

import argparse
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _per_call(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--feed", type=int, default=4096)
    args = ap.parse_args()

    from rankscope.pipeline.engine.engine import Engine
    from rankscope.pipeline.engine.findings import Finding
    from rankscope.pipeline.serve.config import ServeConfig, ServeStats
    from rankscope.pipeline.serve.metrics import MetricsEndpoint
    from rankscope.pipeline.serve.observe import ServeObserver
    from rankscope.pipeline.serve.partition import PartitionState

    n = args.n
    stats = ServeStats()
    old_counts: dict[int, int] = {}
    old = {"records": 0}

    def old_count():  # what _feed did inline before
        old["records"] += 4096
        old_counts[1] = old_counts.get(1, 0) + 4096

    new = _per_call(lambda: stats.count_records("p.telemetry", 1, 4096, "columns"), n)
    before = _per_call(old_count, n)

    obs = ServeObserver(ServeConfig(bus="kafka://127.0.0.1:9", db_path="x"), stats)
    part = PartitionState(Engine)
    parts = {p: part for p in range(4)}
    lag = {(f"p.{t}", p): 0 for t in ("telemetry", "gpu") for p in range(4)}
    obs.turn(lag, parts)
    idle_turn = _per_call(lambda: obs.turn(lag, parts), n)

    def refresh():
        obs._next_snapshot = 0.0
        obs.turn(lag, parts)

    snap_turn = _per_call(refresh, max(1, n // 100))

    f = Finding(job="j", kind="straggler", ranks=[5], hosts=["h"], first_step=1, last_step=9,
                detected_step=3, detected_t=time.time(), score=4.0, detector="straggler",
                action="observe")  # fmt: skip
    obs.found(part, [f])
    rereport = _per_call(lambda: obs.found(part, [f]), n)
    seen = {f.finding_id}
    old_seen = _per_call(lambda: [None for g in [f] if g.finding_id in seen], n)

    ep = MetricsEndpoint("127.0.0.1", 0, obs, group="bench")
    url = f"http://127.0.0.1:{ep.port}/metrics"
    try:
        urllib.request.urlopen(url, timeout=10).read()
        scrape = _per_call(lambda: urllib.request.urlopen(url, timeout=10).read(), 200)
    finally:
        ep.close()

    per_rec = 5e-6
    rows = [
        ("count a fed batch (new)", new, new / args.feed),
        ("count a fed batch (before, inline)", before, before / args.feed),
        ("turn, nothing due", idle_turn, None),
        ("turn, snapshot refresh (1/s)", snap_turn, None),
        ("found, re-report (new)", rereport, None),
        ("found, first-seen check (before)", old_seen, None),
        ("one scrape over HTTP (endpoint thread)", scrape, None),
    ]
    print(f"{'what':42s} {'per call':>12s} {'per record':>12s} {'share of 5 us/rec':>18s}")
    for what, call, rec in rows:
        share = f"{rec / per_rec:.4%}" if rec is not None else ""
        per = f"{rec * 1e9:.2f} ns" if rec is not None else ""
        print(f"{what:42s} {call * 1e6:10.3f} us {per:>12s} {share:>18s}")
    print(f"count_records / inline: {new / before:.2f}x; scraped every 15 s, the endpoint "
          f"takes {scrape / 15:.4%} of one core")  # fmt: skip


if __name__ == "__main__":
    main()
