"""Kafka path throughput and detection latency, against the embedded bus, in one run.

Through the real broker (started with ``scripts/kafka up`` when none runs):
a publisher process sends a synthetic job (``--world`` ranks x ``--steps``
steps of ``step`` records, one rank a straggler from the middle on) to the
telemetry topic, ``--batch`` records a message, while one ``serve`` loop
(``rankscope.pipeline.serve.loop.Service``, in this process) consumes, validates,
assembles, detects and stores into DuckDB; then again with the topic filled
first and ``serve`` draining it alone (on two cores the live publisher takes
one of them). Printed: publish rate, records per second
consumed+detected+stored (from the first message received to the last one
processed), median and p90 detection latency per step in the live run (last
record of the step received -> step detected), and the same records through
the embedded bus (an in-process queue of record batches into the same
validate -> engine -> store path) for the ratio. Asserts nothing about time.

``--baseline REV`` measures side by side, in the same run and the same
conditions: the code of git revision REV (``git archive`` into a temporary
folder, nothing in the repository changes) and this checkout's code take
turns, ``--rounds`` times each, every measurement in a fresh process (the
publisher is this checkout's in both), and the table gives the median rates
of each and their ratio.

    .venv/bin/python bench/bench_kafka.py [--world 2048] [--steps 100] [--batch 1024]
    .venv/bin/python bench/bench_kafka.py --baseline fc8f0cc [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def make_step(world: int, step: int, rng: random.Random, *, job: str, slow_from: int):
    """One step of every rank; rank world // 3 computes 0.25 s longer from ``slow_from`` on."""
    out = []
    slow_rank, t0 = world // 3, 1.7e9
    slow = step >= slow_from
    for r in range(world):
        compute = 0.30 * (1 + rng.gauss(0, 0.02)) + (0.25 if slow and r == slow_rank else 0.0)
        comm = 0.05 * (1 + rng.gauss(0, 0.05))
        out.append({
            "v": 1, "type": "step", "job": job, "rank": r, "step": step, "world": world,
            "host": f"node{r // 8:04d}", "t": t0 + step * 0.4, "step_s": compute + comm,
            "compute_s": compute, "comm_s": comm, "data_s": 0.01, "loss": 2.0 + rng.gauss(0, 0.01),
            "grad_norm": 1.0 + rng.gauss(0, 0.01), "grad_norm_reduced": 1.0,
            "param_digest": f"{step:016x}",
        })  # fmt: skip
    return out


def publisher(bus_url: str, job: str, world: int, steps: int, batch: int, seed: int) -> None:
    """Child process: generate and send the job's records as fast as the broker takes them."""
    from rankscope.pipeline.bus.kafka import KafkaBus, encode_records

    bus = KafkaBus(bus_url)
    rng = random.Random(seed)
    payloads = []
    for s in range(steps):
        recs = make_step(world, s, rng, job=job, slow_from=steps // 2)
        payloads.extend(encode_records(recs[i : i + batch]) for i in range(0, world, batch))
    producer = bus.producer(linger_ms=5)
    print("READY", flush=True)
    t = time.monotonic()
    topic = bus.topic("telemetry")
    for p in payloads:
        producer.send(topic, key=job.encode(), value=p)
    producer.flush()
    dt = time.monotonic() - t
    producer.close()
    print(f"PUBLISHED {world * steps} {dt:.3f}", flush=True)


def kafka_run(bootstrap: str, args, db: Path, *, backlog: bool = False) -> dict:
    """``backlog``: the publisher finishes first, then ``serve`` drains the topic alone."""
    from rankscope.pipeline.bus.kafka import KafkaBus
    from rankscope.pipeline.serve.loop import ServeConfig, Service

    prefix = f"bench{int(time.time() * 1000)}"
    url = f"kafka://{bootstrap}?topic_prefix={prefix}"
    KafkaBus(url).ensure_topics(partitions=4)
    import dataclasses

    # the ops side on, as an operator runs it: a metrics endpoint (where the code has one)
    ops = {"metrics_port": 0} if "metrics_port" in {
        f.name for f in dataclasses.fields(ServeConfig)} else {}  # fmt: skip
    cfg = ServeConfig(
        bus=url, db_path=str(db), group=f"{prefix}-serve", idle_exit_s=3.0,
        control_secret=b"bench-secret-0123456789", measure_latency=True, **ops,
    )  # fmt: skip
    service = Service(cfg)
    pub = subprocess.Popen(
        [sys.executable, __file__, "--publisher", url, "--world", str(args.world),
         "--steps", str(args.steps), "--batch", str(args.batch)],
        stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    pub.stdout.readline()  # READY: records generated, sending starts now
    try:
        if backlog:
            out, _ = pub.communicate(timeout=120)
            stats = service.run()
        else:
            stats = service.run()
            out, _ = pub.communicate(timeout=120)
    finally:
        KafkaBus(url).delete_topics()
    published = [line for line in out.splitlines() if line.startswith("PUBLISHED")]
    n_pub, pub_s = 0, 0.0
    if published:
        n_pub, pub_s = int(published[0].split()[1]), float(published[0].split()[2])
    return {"stats": stats, "published": n_pub, "publish_s": pub_s}


def embedded_run(args, db: Path) -> dict:
    """The same records and the same validate -> columns -> engine -> store path as
    ``serve`` (less the JSON decode), over an in-process queue of record batches;
    findings stored every ``store_interval_s`` like ``serve``, scores at the end."""
    from rankscope.collectors.schema.records import validate_record
    from rankscope.pipeline.bus.decode import StepBatch, uniform_columns
    from rankscope.pipeline.serve.config import ServeConfig
    from rankscope.pipeline.serve.loop import default_engine_factory
    from rankscope.pipeline.store import Store

    job = "bench-embedded"
    rng = random.Random(1)
    batches = []
    for s in range(args.steps):
        recs = make_step(args.world, s, rng, job=job, slow_from=args.steps // 2)
        batches.extend(recs[i : i + args.batch] for i in range(0, args.world, args.batch))
    q: queue.Queue = queue.Queue(maxsize=64)

    def produce():
        for b in batches:
            q.put(b)
        q.put(None)

    engine = default_engine_factory()
    store = Store(db)
    interval = ServeConfig(bus="kafka://localhost:9092", db_path="x").store_interval_s
    findings, pending = {}, {}
    threading.Thread(target=produce, daemon=True).start()
    t0 = last_store = time.monotonic()
    n = 0
    while True:
        b = q.get()
        if b is None:
            break
        cols = uniform_columns(b)
        batch = StepBatch.of(cols, len(b)) if cols is not None else None
        if batch is not None:
            found = engine.feed_columns(batch.job, batch.step, batch.chunk, time.time())
        else:
            found = engine.feed([validate_record(r) for r in b], time.time())
        n += len(b)
        pending.update((f.finding_id, f) for f in found)
        if pending and time.monotonic() - last_store >= interval:
            store.upsert_findings(pending.values())
            findings.update(pending)
            pending, last_store = {}, time.monotonic()
    pending.update((f.finding_id, f) for f in engine.flush())
    store.upsert_findings(pending.values())
    findings.update(pending)
    for cols in engine.drain_scores(final=True):
        store.upsert_scores(cols)
    dt = time.monotonic() - t0
    store.close()
    return {"records": n, "seconds": dt, "findings": list(findings.values())}


def use_code(code: Path) -> None:
    """Import ``rankscope`` from ``code`` (a checkout's root) instead of the installed one."""
    sys.meta_path[:] = [f for f in sys.meta_path
                        if not getattr(f, "__module__", "").startswith("__editable___rankscope")]
    pkg = Path(tempfile.mkdtemp(prefix="rankscope-code-")) / "rankscope"
    pkg.mkdir()
    for name in ("collectors", "detectors", "pipeline", "dashboard"):
        (pkg / name).symlink_to(code / name)
    sys.path.insert(0, str(pkg.parent))


def child(args) -> int:
    """One measurement (``--child live|backlog|embedded``) with ``--code``'s rankscope; a JSON
    line on stdout."""
    use_code(Path(args.code))
    import logging

    import rankscope.pipeline

    # serve's own lines at INFO (written, to nowhere), as `rankscope serve` logs by default
    logging.basicConfig(level=logging.WARNING, stream=open(os.devnull, "w"))  # noqa: SIM115
    logging.getLogger("rankscope").setLevel(logging.INFO)

    assert Path(rankscope.pipeline.__file__).resolve().is_relative_to(Path(args.code).resolve())
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "bench.duckdb"
        if args.child == "embedded":
            e = embedded_run(args, db)
            out = {"records": e["records"], "seconds": e["seconds"],
                   "findings": sorted({f"{f.kind}{list(f.ranks)}" for f in e["findings"]})}
        else:
            k = kafka_run(args.bootstrap, args, db, backlog=args.child == "backlog")
            s = k["stats"]
            from rankscope.pipeline.store import Store

            with Store(db, read_only=True) as st:
                found = sorted({f"{f['kind']}{f['ranks']}" for f in st.list_findings()})
            lat = s.step_latency_s
            out = {"records": s.records, "seconds": s.busy_s, "findings": found,
                   "latency_median_s": statistics.median(lat) if lat else None}
    print("RESULT " + json.dumps(out), flush=True)
    return 0


def compare(args, bootstrap: str) -> int:
    """The baseline revision's code and this checkout's, turn about, in fresh processes."""
    import numpy as np

    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "baseline"
        base.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.baseline],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
        codes = {f"baseline {args.baseline}": base, "this checkout": ROOT}
        rates: dict[tuple[str, str], list[float]] = {}
        found: dict[tuple[str, str], set] = {}
        for r in range(args.rounds):
            for label, code in codes.items():
                for kind in ("live", "backlog", "embedded"):
                    cmd = [sys.executable, __file__, "--child", kind, "--code", str(code),
                           "--bootstrap", bootstrap, "--world", str(args.world),
                           "--steps", str(args.steps), "--batch", str(args.batch)]
                    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
                    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
                    if out.returncode != 0 or not line:
                        print(out.stdout[-2000:], out.stderr[-4000:], file=sys.stderr)
                        return 1
                    res = json.loads(line[0][7:])
                    rate = res["records"] / res["seconds"] if res["seconds"] > 0 else 0.0
                    rates.setdefault((label, kind), []).append(rate)
                    found.setdefault((label, kind), set()).update(res["findings"])
                    print(f"round {r + 1}: {label:>20} {kind:>8}: {rate:>9,.0f} records/s "
                          f"{res['findings']}", flush=True)  # fmt: skip
    print(f"\njob: {args.world} ranks x {args.steps} steps, {args.batch} records a message; "
          f"median of {args.rounds} round(s), records/s")  # fmt: skip
    labels = list(codes)
    med = {k: float(np.median(v)) for k, v in rates.items()}
    print(f"{'':>10} " + " ".join(f"{lab:>22}" for lab in labels) + f" {'this / baseline':>16}")
    for kind in ("live", "backlog", "embedded"):
        a, b = med[(labels[0], kind)], med[(labels[1], kind)]
        print(f"{kind:>10} {a:>22,.0f} {b:>22,.0f} {b / a if a else float('nan'):>16.2f}")
    for lab in labels:
        e = med[(lab, "embedded")]
        print(f"kafka / embedded, {lab}: live {med[(lab, 'live')] / e:.2f}, "
              f"backlog {med[(lab, 'backlog')] / e:.2f}")  # fmt: skip
    print("findings: " + "; ".join(f"{lab} {kind}: {sorted(found[(lab, kind)])}"
                                   for lab in labels for kind in ("live", "embedded")))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=1024, help="records per Kafka message")
    ap.add_argument("--baseline", metavar="REV",
                    help="also measure git revision REV's code, side by side (e.g. fc8f0cc)")
    ap.add_argument("--rounds", type=int, default=1, help="turns of each code with --baseline")
    ap.add_argument("--publisher", metavar="URL", help=argparse.SUPPRESS)
    ap.add_argument("--child", choices=("live", "backlog", "embedded"), help=argparse.SUPPRESS)
    ap.add_argument("--code", help=argparse.SUPPRESS)
    ap.add_argument("--bootstrap", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.publisher:
        publisher(args.publisher, "bench-kafka", args.world, args.steps, args.batch, seed=1)
        return 0
    if args.child:
        return child(args)

    started = False
    bootstrap = os.environ.get("RANKSCOPE_KAFKA_BOOTSTRAP")
    if not bootstrap:
        status = subprocess.run([str(ROOT / "scripts/kafka"), "status"], capture_output=True)
        if status.returncode != 0:
            subprocess.run([str(ROOT / "scripts/kafka"), "up"], check=True)
            started = True
        bootstrap = (ROOT / ".kafka/bootstrap").read_text().strip()
    if args.baseline:
        try:
            return compare(args, bootstrap)
        finally:
            if started:
                subprocess.run([str(ROOT / "scripts/kafka"), "down"], check=False)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            k = kafka_run(bootstrap, args, Path(tmp) / "kafka.duckdb")
            kb = kafka_run(bootstrap, args, Path(tmp) / "backlog.duckdb", backlog=True)
            e = embedded_run(args, Path(tmp) / "embedded.duckdb")
            from rankscope.pipeline.store import Store

            with Store(Path(tmp) / "kafka.duckdb", read_only=True) as st:
                stored = st.list_findings()
    finally:
        if started:
            subprocess.run([str(ROOT / "scripts/kafka"), "down"], check=False)

    s = k["stats"]
    total = args.world * args.steps
    krate = s.records / s.busy_s if s.busy_s > 0 else 0.0
    erate = e["records"] / e["seconds"] if e["seconds"] > 0 else 0.0
    lat = sorted(s.step_latency_s)
    med = statistics.median(lat) if lat else float("nan")
    p90 = lat[int(0.9 * (len(lat) - 1))] if lat else float("nan")
    print(f"job: {args.world} ranks x {args.steps} steps = {total:,} step records, "
          f"{args.batch} records a message")  # fmt: skip
    if k["publish_s"]:
        print(f"publish (separate process): {k['published']:,} records in {k['publish_s']:.2f} s "
              f"= {k['published'] / k['publish_s']:,.0f} records/s")  # fmt: skip
    print(f"kafka serve, live (publisher running beside it): {s.records:,} records "
          f"consumed+detected+stored in {s.busy_s:.2f} s = {krate:,.0f} records/s; "
          f"{s.deadletters} dead letters")  # fmt: skip
    b = kb["stats"]
    brate = b.records / b.busy_s if b.busy_s > 0 else 0.0
    print(f"kafka serve, backlog (topic full, serve alone): {b.records:,} records "
          f"consumed+detected+stored in {b.busy_s:.2f} s = {brate:,.0f} records/s")  # fmt: skip
    if s.store_lag_s is not None:
        print(f"kafka serve, live: everything read was stored {s.store_lag_s:.2f} s after the "
              f"last record was processed (writer thread; findings every store interval, "
              f"scores and state at checkpoints)")  # fmt: skip
    print(f"detection latency per step (last record received -> detected): "
          f"median {med * 1000:.0f} ms, p90 {p90 * 1000:.0f} ms over {len(lat)} steps")  # fmt: skip
    print(f"embedded bus: {e['records']:,} records in {e['seconds']:.2f} s "
          f"= {erate:,.0f} records/s")  # fmt: skip
    ratio = krate / erate if erate else float("nan")
    bratio = brate / erate if erate else float("nan")
    print(f"kafka / embedded throughput: live {ratio:.2f}, backlog {bratio:.2f}")
    kinds = sorted({(f["kind"], tuple(f["ranks"])) for f in stored})
    print(f"findings stored via kafka: {kinds}; via embedded: "
          f"{sorted({(f.kind, tuple(f.ranks)) for f in e['findings']})}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
