"""Driving headless Chromium over the DevTools protocol, and `rankscope dashboard` under it.

Streamlit draws its page over a websocket after the HTML loads, so a one-shot
`--dump-dom` sees an empty shell as often as not. These helpers drive
Chromium through the DevTools protocol instead (the `websockets` client
Streamlit already depends on): open a page by its URL, poll its text until
what it must say is there, take a screenshot. Screenshots are copied to
RANKSCOPE_SCREENSHOT_DIR when it is set, for a person to look at.
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

__all__ = ["CHROMIUM", "DevTools", "Dashboard", "open_page", "shot", "evaluate",
           "keep_screenshots"]

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


def open_page(browser: DevTools, url: str, want: list[str], timeout_s: float = 60) -> str:
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


def shot(browser: DevTools, out: Path, name: str) -> Path:
    time.sleep(2.0)  # let the charts finish drawing before the picture
    shot = base64.b64decode(browser.call("Page.captureScreenshot", format="png")["data"])
    assert shot[:8] == b"\x89PNG\r\n\x1a\n" and len(shot) > 20_000
    path = out / f"{name}.png"
    path.write_bytes(shot)
    return path


def evaluate(browser: DevTools, js: str):
    r = browser.call("Runtime.evaluate", expression=js, returnByValue=True)
    return r["result"].get("value")


def keep_screenshots(paths: list[Path]) -> None:
    keep = os.environ.get("RANKSCOPE_SCREENSHOT_DIR")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        for p in paths:
            shutil.copy(p, Path(keep) / p.name)
