"""End to end: `rankscope dashboard` over the replayed demo store, in a real headless Chromium.

Each view is opened by its URL (the deep links the pages write), checked for
what it must say, and photographed (browser_support.py says how, and where
the screenshots go). A second store with hostile job and host names checks
that they are shown as written and that the browser fetches nothing they name.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest
from browser_support import (
    CHROMIUM,
    Dashboard,
    DevTools,
    evaluate,
    keep_screenshots,
    open_page,
    shot,
)
from support.dashboard_store import SDC_JOB, SYNTH_JOB, shared_demo_store

pytestmark = pytest.mark.browser

STRAGGLER_JOB = "sample-straggler-1.6x"
EVIL_URL = "http://127.0.0.1:9/evil.png"
HOSTILE_JOB = f"job![x]({EVIL_URL})**bold**"
HOSTILE_HOST = f'<img src="{EVIL_URL}" onerror="window.__pwned=1">node'


def _pages(db: Path) -> list[tuple[str, dict, list[str]]]:
    """(screenshot name, query parameters, text that must be on the page) for every view."""
    import duckdb

    con = duckdb.connect(str(db), read_only=True)
    try:
        fid, first = con.execute(
            "SELECT finding_id, first_step FROM findings WHERE job = ? AND kind = 'straggler'",
            [STRAGGLER_JOB]).fetchone()  # fmt: skip
        sdc = con.execute("SELECT finding_id FROM findings WHERE job = ? AND kind = 'sdc'",
                          [SDC_JOB]).fetchone()[0]  # fmt: skip
    finally:
        con.close()
    return [
        ("1-jobs", {}, ["Jobs", f"{STRAGGLER_JOB}: rank 5 on host node01: straggler since step "
                                f"{first}", "What to do: drain host node01"]),
        ("2-findings", {"view": "Findings", "job": SYNTH_JOB}, [f"Findings of {SYNTH_JOB}"]),
        ("3-heatmap", {"view": "Heatmap", "job": STRAGGLER_JOB},
         ["Ranks longest away from their peers"]),
        ("4-finding-straggler", {"view": "Finding", "job": STRAGGLER_JOB, "finding": fid},
         ["straggler on ranks 5", "has no control channel"]),
        ("5-finding-sdc", {"view": "Finding", "job": SDC_JOB, "finding": sdc},
         ["parameters differ from the 7 other replicas", "Replica vote"]),
        ("6-finding-hang", {"view": "Finding", "job": "sample-hang"},
         ["hang on ranks 3", "never entered it", "Who waits for whom"]),
        ("7-rank", {"view": "Rank", "job": SYNTH_JOB, "rank": "5"},
         [f"Rank 5 of {SYNTH_JOB} on host gpuhost1", "GPU"]),
        ("8-host", {"view": "Host", "job": "sample-gpu-thermal", "host": "node01"},
         ["Host node01", "GPU health"]),
        ("9-triage", {"view": "Triage", "job": SDC_JOB}, [f"Triage of {SDC_JOB}"]),
    ]


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium not installed (make browser)")
@pytest.mark.timeout(420)
def test_every_view_in_chromium_with_a_screenshot(tmp_path, tmp_path_factory):
    db, expected = shared_demo_store(tmp_path_factory)
    out = tmp_path / "screens"
    out.mkdir()
    server = Dashboard(db)
    browser = None
    shots = []
    try:
        browser = DevTools(tmp_path / "chromium-profile")
        browser.call("Page.enable")
        browser.call("Emulation.setDeviceMetricsOverride", width=1400, height=2400,
                     deviceScaleFactor=1, mobile=False)  # fmt: skip
        for name, params, want in _pages(db):
            if name == "1-jobs":  # every job's banner: wait for all of them, not the first
                want = [*want, *expected["page_text"]]
            open_page(browser, server.url(**params), want)
            shots.append(shot(browser, out, name))
            # The address bar carries the page: a copied link opens the same view.
            search = evaluate(browser, "window.location.search")
            assert f"view={params.get('view', 'Jobs')}" in search, search
        # A banner's link opens its finding (a new session seeded from the URL).
        open_page(browser, server.url(), ["Open this finding"])
        evaluate(browser, "[...document.querySelectorAll('a')].find(a => a.textContent === "
                       "'Open this finding').click()")  # fmt: skip
        deadline = time.monotonic() + 30
        href = ""
        while "view=Finding" not in href:
            assert time.monotonic() < deadline, "the banner's link did not open a finding"
            time.sleep(0.3)
            with contextlib.suppress(AssertionError):  # "target navigated" while it loads
                href = evaluate(browser, "window.location.href") or ""
        open_page(browser, href, ["What to do:", "Evidence"])
    finally:
        keep_screenshots(shots)
        if browser is not None:
            browser.close()
        server.stop()
    assert len(shots) == len(_pages(db))


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium not installed (make browser)")
@pytest.mark.timeout(240)
def test_hostile_names_are_text_and_fetch_nothing(tmp_path):
    from rankscope.pipeline.engine.findings import Finding
    from rankscope.pipeline.store import Store

    db = tmp_path / "hostile.duckdb"
    with Store(db) as store:
        store.record_job({"job": HOSTILE_JOB, "world": 4, "hosts": 1, "last_step": 50,
                          "frames": 51, "last_t": 1.0e9}, source="kafka")  # fmt: skip
        store.upsert_findings([Finding(
            job=HOSTILE_JOB, kind="straggler", ranks=[1], hosts=[HOSTILE_HOST], first_step=10,
            last_step=50, detected_step=12, detected_t=1.0e9, score=9.0,
            detector=f"![d]({EVIL_URL}d)", action="evict",
            evidence={"metric": "compute_s", "value": 0.3, "peer_median": 0.2, "ratio": 1.5},
        )])  # fmt: skip
    server = Dashboard(db)
    browser = None
    shots = []
    try:
        browser = DevTools(tmp_path / "chromium-profile")
        browser.call("Page.enable")
        for name, params, want in (
            ("hostile-jobs", {}, [HOSTILE_JOB, "rank 1 on host"]),
            ("hostile-host", {"view": "Host", "job": HOSTILE_JOB, "host": HOSTILE_HOST},
             ["GPU health"]),
            ("hostile-finding", {"view": "Finding", "job": HOSTILE_JOB}, ["rank 1 on host"]),
        ):  # fmt: skip
            text = open_page(browser, server.url(**params), want)
            assert f"Host {HOSTILE_HOST}" in text or name != "hostile-host"
            assert HOSTILE_HOST in text  # the name as written, not an image
            shots.append(shot(browser, tmp_path, name))
            fetched = evaluate(browser, "performance.getEntriesByType('resource')"
                                     ".map(e => e.name).filter(n => n.includes('evil'))")
            assert fetched == [], fetched
            assert evaluate(browser, "document.querySelectorAll('img[src*=evil]').length") == 0
            assert evaluate(browser, "window.__pwned === undefined") is True
    finally:
        keep_screenshots(shots)
        if browser is not None:
            browser.close()
        server.stop()
