"""How fast each dashboard view renders over a big store: 4,096 ranks x 5,000 steps, 1,000 findings.

The store is filled the way the engine fills it, but without running 20
million rank-steps through the detectors first (that is bench_engine's job):
the schema comes from ``pipeline.store.Store``, findings go in through
``Store.upsert_findings`` as ``Finding`` objects, and the scores table gets
what ``pipeline/engine/scores.py`` would keep for this job: 5 metrics, step buckets
of ceil(4096 x 5 / 1024) = 20 steps, i.e. 250 buckets x 4,096 ranks x 5
metrics = 5.1 million rows, with a few slow ranks and replicas in them.

Every view is then rendered with Streamlit's AppTest (the same code path as a
browser session, minus the browser) and the time of each render is printed:
the first render of a fresh session and the median of 3 more. The target is
at most 2 s per view. Nothing is asserted about time.

    .venv/bin/python bench/bench_dashboard.py [--db PATH] [--keep]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rankscope.pipeline.engine.findings import Finding  # noqa: E402
from rankscope.pipeline.store import Store  # noqa: E402

JOB = "llm-4k"
WORLD = 4096
STEPS = 5000
PER_HOST = 8
BUCKET = 20
METRICS = ("compute_s", "comm_s", "data_s", "grad_norm", "loss")
N_FINDINGS = 1000
KINDS = ("straggler", "network", "sdc", "nonfinite", "hang", "crash", "gpu")
SLOW_RANKS = (77, 1234, 3001)  # get high compute_s scores from step 2000 on


def fill(path: Path) -> None:
    """Create the store and fill it as the engine would for a job this size."""
    t0 = time.perf_counter()
    rng = random.Random(5)
    with Store(path) as store:
        store.record_job({"job": JOB, "world": WORLD, "hosts": WORLD // PER_HOST,
                          "last_step": STEPS - 1, "frames": STEPS,
                          "last_t": time.time()}, source="bench")  # fmt: skip
        metric_rows = ", ".join(f"('{m}', {i})" for i, m in enumerate(METRICS))
        slow = ", ".join(str(r) for r in SLOW_RANKS)
        store.con.execute(
            # Peer-relative noise from a hash (deterministic, no Python loop), plus slow ranks.
            "INSERT INTO scores SELECT ?, b * ?, ?, r, m.metric, "  # noqa: S608 - constants only
            "CASE WHEN m.metric = 'compute_s' AND r IN (" + slow + ") AND b * ? >= 2000 "
            "THEN 8.0 + (hash(b, r) % 100)::INTEGER / 50.0 "
            "ELSE ((hash(b, r, m.i) % 2001)::INTEGER - 1000) / 1000.0 END "
            "FROM range(?) t(b), range(?) u(r), (VALUES " + metric_rows + ") m(metric, i)",
            [JOB, BUCKET, BUCKET, BUCKET, STEPS // BUCKET, WORLD],
        )
        t_scores = time.perf_counter() - t0
        findings = []
        t_base = time.time() - 4 * 3600
        for i in range(N_FINDINGS):
            kind = rng.choice(KINDS)
            n_ranks = 1 if kind != "network" else rng.randint(1, 3)
            ranks = sorted(rng.sample(range(WORLD), n_ranks))
            first = rng.randrange(0, STEPS - 10)
            last = min(STEPS - 1, first + rng.randint(0, 300))
            peers = [round(0.2 + rng.gauss(0, 0.004), 4) for _ in range(15)]
            findings.append(Finding(
                job=JOB, kind=kind, ranks=ranks,
                hosts=sorted({f"node{r // PER_HOST:04d}" for r in ranks}),
                first_step=first, last_step=last, detected_step=first + rng.randint(0, 3),
                detected_t=t_base + first * 3.0 + i, score=round(rng.uniform(3, 40), 2),
                detector=f"bench_{kind}", action=rng.choice(("evict", "recover", "observe")),
                evidence={"metric": "compute_s", "value": 0.31, "peer_median": 0.2,
                          "peers": peers, "history_median": 0.201,
                          "actions": {"evict": {"step": first + 5, "t": t_base + first * 3.0}}},
            ))  # fmt: skip
        store.upsert_findings(findings)
        for f in findings[:50]:
            store.set_triage(f.finding_id, "confirmed", "bench", t=t_base)
        rows = store.count("scores")
    print(f"filled {path}: {rows:,} score rows in {t_scores:.1f} s, {N_FINDINGS} findings, "
          f"{path.stat().st_size / 1e6:.0f} MB, {time.perf_counter() - t0:.1f} s in all")


def views(store_path: Path) -> list[tuple[str, dict]]:
    import duckdb

    con = duckdb.connect(str(store_path), read_only=True)
    try:
        strag = con.execute("SELECT finding_id, hosts[1] FROM findings WHERE job = ? AND "
                            "kind = 'straggler' ORDER BY detected_t DESC LIMIT 1",
                            [JOB]).fetchone()  # fmt: skip
    finally:
        con.close()
    return [
        ("Jobs", {}),
        ("Findings", {"job": JOB}),
        ("Findings (filtered: kind, triage)", {"job": JOB, "f_kind": ["straggler"],
                                               "f_triage": ["open"]}),  # fmt: skip
        ("Heatmap (all steps)", {"job": JOB}),
        ("Heatmap (steps 1000-1999)", {"job": JOB, "hm_steps": (1000, 1999)}),
        ("Finding", {"job": JOB, "finding": strag[0]}),
        ("Rank (scores, no trace)", {"job": JOB, "rank": SLOW_RANKS[0]}),
        ("Host", {"job": JOB, "host": strag[1]}),
        ("Triage", {"job": JOB, "finding": strag[0]}),
    ]


def render(view: str, state: dict):
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(ROOT / "dashboard" / "app.py"), default_timeout=120)
    at.session_state["view"] = view.split(" (")[0]
    for k, v in state.items():
        at.session_state[k] = v
    t0 = time.perf_counter()
    at.run()
    dt = time.perf_counter() - t0
    if at.exception:
        raise RuntimeError(f"{view}: {at.exception[0].value}")
    return at, dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", help="reuse (or create) the big store here")
    ap.add_argument("--keep", action="store_true", help="keep the store afterwards")
    args = ap.parse_args()
    path = Path(args.db) if args.db else Path(
        tempfile.mkdtemp(prefix="rankscope-bench-dash-")) / "big.duckdb"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fill(path)
    os.environ["RANKSCOPE_DB"] = str(path)
    render("Jobs", {})  # import Streamlit, Altair and the app once, outside the timings
    print(f"\n{'view':<36} {'first':>8} {'median of 3':>12}")
    worst = 0.0
    for view, state in views(path):
        _, first = render(view, state)
        again = statistics.median(render(view, state)[1] for _ in range(3))
        worst = max(worst, first, again)
        print(f"{view:<36} {first:>7.2f}s {again:>11.2f}s")
    print(f"\nslowest view render: {worst:.2f} s (target <= 2 s) for {WORLD} ranks x {STEPS} "
          f"steps, {N_FINDINGS} findings")
    if args.db or args.keep:
        print(f"store kept at {path}")
    else:
        shutil.rmtree(path.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
