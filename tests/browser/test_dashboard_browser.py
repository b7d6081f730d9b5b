"""End to end: `rankscope dashboard` serves the demo job's findings to a real headless Chromium.

Streamlit draws its page over a websocket after the HTML loads, so a one-shot
`--dump-dom` sees an empty shell as often as not. The test drives Chromium
through the DevTools protocol instead (the `websockets` client Streamlit
already depends on): open each view by its URL, poll the page's text until
what it must say is there, then take a screenshot. Screenshots are kept under
tmp_path and, when RANKSCOPE_SCREENSHOT_DIR is set, copied there for a person
to look at. A second store with hostile job and host names checks that they
are shown as written and that the browser fetches nothing they name.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlencode

import pytest
from support.dashboard_store import SDC_JOB, SYNTH_JOB, shared_demo_store

pytestmark = pytest.mark.browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
STRAGGLER_JOB = "sample-straggler-1.6x"
EVIL_URL = "http://127.0.0.1:9/evil.png"
HOSTILE_JOB = f"job![x]({EVIL_URL})**bold**"
HOSTILE_HOST = f'<img src="{EVIL_URL}" onerror="window.__pwned=1">node'



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"{url} did not answer within {timeout_s} s")


class DevTools:
    """The few DevTools protocol calls the test needs, over one page's websocket."""

    def __init__(self, profile: Path) -> None:
        from websockets.sync.client import connect

        self.proc = subprocess.Popen(
            [
                CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                "--disable-dev-shm-usage", "--no-first-run", "--remote-debugging-port=0",
                f"--user-data-dir={profile}", "--window-size=1400,1100", "about:blank",
            ],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        browser_ws = None
        for line in self.proc.stderr:  # Chromium prints its DevTools address on start
            m = re.search(r"DevTools listening on (ws://\S+)", line)
            if m:
                browser_ws = m.group(1)
                break
        assert browser_ws, "Chromium did not print its DevTools address"
        port = browser_ws.split("//", 1)[1].split("/", 1)[0]
        with urllib.request.urlopen(f"http://{port}/json/list", timeout=5) as resp:
            targets = json.load(resp)
        page = next(t for t in targets if t["type"] == "page")
        self._stack = contextlib.ExitStack()
        self.ws = self._stack.enter_context(
            connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=10)
        )
        self._ids = itertools.count(1)

    def call(self, method: str, **params) -> dict:
        msg_id = next(self._ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=30))
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise AssertionError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def text(self) -> str:
        r = self.call("Runtime.evaluate", expression="document.body ? document.body.innerText : ''",
                      returnByValue=True)
        return r.get("result", {}).get("value") or ""

    def close(self) -> None:
        try:
            self._stack.close()
        finally:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class Dashboard:
    """`rankscope dashboard` on a free port over one store, stopped with its process group."""

    def __init__(self, db: Path) -> None:
        self.port = _free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rankscope.pipeline.cli", "dashboard", "--db", str(db),
             "--port", str(self.port)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        _wait_http(f"http://localhost:{self.port}/_stcore/health", timeout_s=60)

    def url(self, **params) -> str:
        return f"http://localhost:{self.port}/" + (f"?{urlencode(params)}" if params else "")

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _open(browser: DevTools, url: str, want: list[str], timeout_s: float = 60) -> str:
    """Navigate and poll the page text until every string in ``want`` is on it."""
    browser.call("Page.navigate", url=url)
    deadline = time.monotonic() + timeout_s
    text = ""
    while time.monotonic() < deadline:
        text = browser.text()
        if all(s in text for s in want) and "Running..." not in text:
            return text
        time.sleep(0.5)
    missing = [s for s in want if s not in text]
    raise AssertionError(f"{url}: not on the page: {missing}\n--- page text ---\n{text[:3000]}")


def _shot(browser: DevTools, out: Path, name: str) -> Path:
    time.sleep(2.0)  # let the charts finish drawing before the picture
    shot = base64.b64decode(browser.call("Page.captureScreenshot", format="png")["data"])
    assert shot[:8] == b"\x89PNG\r\n\x1a\n" and len(shot) > 20_000
    path = out / f"{name}.png"
    path.write_bytes(shot)
    return path


def _eval(browser: DevTools, js: str):
    r = browser.call("Runtime.evaluate", expression=js, returnByValue=True)
    return r["result"].get("value")


def _keep(paths: list[Path]) -> None:
    keep = os.environ.get("RANKSCOPE_SCREENSHOT_DIR")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        for p in paths:
            shutil.copy(p, Path(keep) / p.name)


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
            text = _open(browser, server.url(**params), want)
            if name == "1-jobs":
                assert all(s in text for s in expected["page_text"])
            shots.append(_shot(browser, out, name))
            # The address bar carries the page: a copied link opens the same view.
            search = _eval(browser, "window.location.search")
            assert f"view={params.get('view', 'Jobs')}" in search, search
        # A banner's link opens its finding (a new session seeded from the URL).
        _open(browser, server.url(), ["Open this finding"])
        _eval(browser, "[...document.querySelectorAll('a')].find(a => a.textContent === "
                       "'Open this finding').click()")  # fmt: skip
        deadline = time.monotonic() + 30
        while "view=Finding" not in (_eval(browser, "window.location.search") or ""):
            assert time.monotonic() < deadline, "the banner's link did not open a finding"
            time.sleep(0.3)
        _open(browser, _eval(browser, "window.location.href"), ["What to do:", "Evidence"])
    finally:
        _keep(shots)
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
            text = _open(browser, server.url(**params), want)
            assert f"Host {HOSTILE_HOST}" in text or name != "hostile-host"
            assert HOSTILE_HOST in text  # the name as written, not an image
            shots.append(_shot(browser, tmp_path, name))
            fetched = _eval(browser, "performance.getEntriesByType('resource')"
                                     ".map(e => e.name).filter(n => n.includes('evil'))")
            assert fetched == [], fetched
            assert _eval(browser, "document.querySelectorAll('img[src*=evil]').length") == 0
            assert _eval(browser, "window.__pwned === undefined") is True
    finally:
        _keep(shots)
        if browser is not None:
            browser.close()
        server.stop()
