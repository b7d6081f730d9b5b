"""End to end: `rankscope dashboard` serves the demo job's findings to a real headless Chromium.

Streamlit draws its page over a websocket after the HTML loads, so a one-shot
`--dump-dom` sees an empty shell as often as not. The test drives Chromium
through the DevTools protocol instead (the `websockets` client Streamlit
already depends on): navigate, poll the page's text until the findings are
there, then take a screenshot. The screenshot is kept under tmp_path and, when
RANKSCOPE_SCREENSHOT_DIR is set, copied there for a person to look at.
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

import pytest
from support.dashboard_store import shared_demo_store

pytestmark = pytest.mark.browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


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


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium not installed (make browser)")
@pytest.mark.timeout(180)
def test_dashboard_serves_demo_findings_to_chromium(tmp_path, tmp_path_factory):
    db, expected = shared_demo_store(tmp_path_factory)
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "rankscope.pipeline.cli", "dashboard", "--db", str(db),
         "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    browser = None
    try:
        _wait_http(f"http://localhost:{port}/_stcore/health", timeout_s=60)
        browser = DevTools(tmp_path / "chromium-profile")
        browser.call("Page.enable")
        browser.call("Page.navigate", url=f"http://localhost:{port}/")
        deadline = time.monotonic() + 60
        text = ""
        while time.monotonic() < deadline:
            text = browser.text()
            if all(s in text for s in expected["page_text"]):
                break
            time.sleep(0.5)
        missing = [s for s in expected["page_text"] if s not in text]
        assert not missing, f"not on the page: {missing}\n--- page text ---\n{text[:3000]}"
        time.sleep(2.0)  # let the charts finish drawing before the picture
        shot = base64.b64decode(browser.call("Page.captureScreenshot", format="png")["data"])
        out = tmp_path / "dashboard.png"
        out.write_bytes(shot)
        assert shot[:8] == b"\x89PNG\r\n\x1a\n" and len(shot) > 20_000
        keep = os.environ.get("RANKSCOPE_SCREENSHOT_DIR")
        if keep:
            Path(keep).mkdir(parents=True, exist_ok=True)
            shutil.copy(out, Path(keep) / "dashboard.png")
    finally:
        if browser is not None:
            browser.close()
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
