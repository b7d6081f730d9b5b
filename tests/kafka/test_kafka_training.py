"""End to end through the real broker: gloo training -> serve -> DuckDB, and evict back to
exactly the ranks of the straggler's host; forged control messages change nothing."""

from __future__ import annotations

import json
import signal
import time

import orjson
import pytest
import torch.multiprocessing as mp
from rankscope.collectors.schema.control import sign
from rankscope.pipeline.bus.kafka import KafkaBus
from support.kafka import (
    SECRET,
    findings_in,
    rankscope,
    wait_for,
)
from support.kafka_train_worker import train_rank

pytestmark = [pytest.mark.kafka, pytest.mark.multiproc]

# the straggler starts after 15 quiet steps: the job-slowdown baseline (pipeline/engine/pace.py)
# of 7 first steps under a loaded suite once gave z 2.71 for a 1.94x slower job (observe)
WORLD, STEPS, SLOW_RANK, SLOW_FROM, SLOW_S = 4, 80, 3, 16, 0.12


def test_straggler_found_stored_and_its_host_evicted(kafka_url, procs, tmp_path):
    db = tmp_path / "f.duckdb"
    group = kafka_url.rsplit("=", 1)[1]
    serve = rankscope("serve", "--bus", kafka_url, "--db", str(db), "--group", group)
    procs.append(serve)
    bus = KafkaBus(kafka_url)
    wait_for(lambda: _topic_exists(bus, "control"), 60, "serve to create the topics")

    ctx = mp.get_context("spawn")
    ranks = [
        ctx.Process(
            target=train_rank,
            args=(r, WORLD, str(tmp_path / "rdzv"), kafka_url, SECRET, str(tmp_path), STEPS,
                  SLOW_RANK, SLOW_FROM, SLOW_S),
        )  # fmt: skip
        for r in range(WORLD)
    ]
    for p in ranks:
        p.start()
    try:
        wait_for(lambda: all((tmp_path / f"ready{r}").exists() for r in range(WORLD)), 120,
                 "every rank's control listener")  # fmt: skip
        # an attacker writes to the topic: unsigned, and signed with the wrong secret
        forged = {"job": "train-e2e", "action": "evict", "ranks": [0, 1], "hosts": ["node00"],
                  "step": 1, "finding_id": "forged", "reason": "x", "issued_t": time.time()}
        producer = bus.producer()
        producer.send(bus.topic("control"), key=b"train-e2e", value=orjson.dumps(forged))
        bad = sign(forged, b"not-the-shared-secret-0123")
        producer.send(bus.topic("control"), key=b"train-e2e", value=orjson.dumps(bad))
        producer.flush()
        producer.close()
        for p in ranks:
            p.join(timeout=180)
    finally:
        for p in ranks:
            if p.is_alive():
                p.kill()
    results = {}
    for r in range(WORLD):
        f = tmp_path / f"rank{r}.json"
        assert f.exists(), f"rank {r} wrote no result (exit code {ranks[r].exitcode})"
        results[r] = json.loads(f.read_text())

    evicted = {r for r, res in results.items() if res["evicted"]}
    assert evicted == {2, 3}, results  # exactly the straggler's host, node01
    for r in (2, 3):
        ev = results[r]["evicted"]
        assert ev["hosts"] == ["node01"]
        assert SLOW_FROM < ev["step"] < SLOW_FROM + 40  # within a bounded number of steps
    for r in (0, 1):  # told, not affected: they saw it, and nobody evicted node00
        assert [s["affects_me"] for s in results[r]["seen"]] == [False], results[r]
    for r in range(WORLD):
        assert results[r]["rejected"].get("unsigned") == 1, results[r]
        assert results[r]["rejected"].get("bad signature (forged or altered)") == 1

    serve.send_signal(signal.SIGTERM)
    _, err = serve.communicate(timeout=60)
    assert serve.returncode == 0, err
    stored = [f for f in findings_in(db) if f["action"] == "evict"]
    assert any(f["kind"] == "straggler" and f["ranks"] == [SLOW_RANK] for f in stored), stored


def _topic_exists(bus: KafkaBus, kind: str) -> bool:
    from kafka import KafkaConsumer

    c = KafkaConsumer(**bus.url.client_kwargs())
    try:
        return bus.topic(kind) in c.topics()
    finally:
        c.close()
