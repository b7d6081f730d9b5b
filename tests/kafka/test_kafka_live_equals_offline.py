"""Live equals offline: every sample trace through the real broker gives `serve` the
findings `replay` gives, whether `publish` sends in time order (the default) or one
file after the other (`--file-order`: each rank's whole history before the next rank's,
the worst disorder a trace can arrive in)."""

from __future__ import annotations

import pytest
from rankscope.pipeline.offline.replay import replay_trace
from support.kafka import findings_in, rankscope
from support.paths import SAMPLE_TRACES

pytestmark = pytest.mark.kafka

TRACES = sorted(d for d in SAMPLE_TRACES.iterdir() if d.is_dir())


def _key(job, kind, ranks, first, detected, action):
    return (job, kind, tuple(ranks), int(first), int(detected), action)


@pytest.fixture(scope="module")
def replayed():
    out = set()
    for d in TRACES:
        for f in replay_trace(d).findings:
            out.add(_key(f.job, f.kind, f.ranks, f.first_step, f.detected_step, f.action))
    return out


@pytest.mark.parametrize("order", ["time", "file"])
def test_every_sample_trace_serves_as_it_replays(order, replayed, kafka_url, procs, tmp_path):
    extra = ["--file-order"] if order == "file" else []
    pub = rankscope("publish", *map(str, TRACES), "--bus", kafka_url, *extra)
    procs.append(pub)
    out, err = pub.communicate(timeout=120)
    assert pub.returncode == 0, err
    assert "0 malformed skipped" in out
    db = tmp_path / "live.duckdb"
    group = kafka_url.rsplit("=", 1)[1] + "-serve"
    serve = rankscope("serve", "--bus", kafka_url, "--db", str(db), "--exit-when-idle", "3",
                      "--group", group)  # fmt: skip
    procs.append(serve)
    _, err = serve.communicate(timeout=180)
    assert serve.returncode == 0, err
    live = {_key(f["job"], f["kind"], f["ranks"], f["first_step"], f["detected_step"],
                 f["action"]) for f in findings_in(db)}  # fmt: skip
    # the test can fail: every faulty trace has a finding, the clean ones none
    assert len({k[0] for k in replayed}) == len(TRACES) - 2
    assert live == replayed, (sorted(live ^ replayed), err[-3000:])


def test_findings_reads_the_store_serve_holds(kafka_url, procs, tmp_path):
    """`rankscope findings --db D` while `serve` (holding D for its whole life) runs."""
    from support.kafka import wait_for

    trace = SAMPLE_TRACES / "straggler-1.6x"
    db = tmp_path / "held.duckdb"
    group = kafka_url.rsplit("=", 1)[1] + "-serve"
    serve = rankscope("serve", "--bus", kafka_url, "--db", str(db), "--group", group)
    procs.append(serve)
    pub = rankscope("publish", str(trace), "--bus", kafka_url)
    procs.append(pub)
    assert pub.wait(timeout=60) == 0

    def listed():
        p = rankscope("findings", "--db", str(db), "--json")
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err  # never the raw lock error
        return (out, err) if '"straggler"' in out else None

    out, err = wait_for(listed, 60, "the straggler listed while serve holds the store")
    assert serve.poll() is None, "serve must still be running (and holding the file)"
    assert "snapshot" in err
    serve.terminate()
    serve.communicate(timeout=60)
