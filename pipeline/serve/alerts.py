"""Webhook alerts: every evict/recover finding posted once to each configured URL.

The consumer loop only offers findings (``AlertSender.offer``: a set lookup and,
once per finding, a non-blocking put); each webhook has its own thread and
bounded queue, so a receiver that is slow, failing or never answers delays
neither the loop nor the other webhooks. A full queue drops the alert,
counted and said once at WARNING.

Delivery: POST with retries and exponential backoff (``backoff_s`` doubling up
to ``backoff_max_s``, ``attempts`` tries) on a connection error, a timeout, a
5xx, 408 or 429; any other 4xx is the receiver refusing, given up at once.
Each finding is posted once per webhook, whatever its later re-reports or
escalation (recover to evict) say: ``finding_id`` is the key, in memory and,
after a 2xx, in the store's ``serve_alerts`` table (``alert_ledger``), so a
restarted ``serve`` does not post again. A retried POST after a timeout may
reach the receiver twice; every try carries the same ``X-Rankscope-Alert-Id``
(the finding id) for the receiver to drop the repeat. With a secret,
``X-Rankscope-Signature: sha256=HMAC(secret, "<timestamp>.<body>")`` and
``X-Rankscope-Timestamp`` let it check the sender.

Bodies: ``slack`` is ``{"text": ...}`` (Slack and most chat webhooks);
``json`` is the finding's fields plus ``text``, ``source`` and ``alerted_t``.
Webhook URLs often hold a token (Slack's do): logs name a webhook by its
number and host only.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import queue
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from urllib.parse import urlsplit

import orjson

__all__ = ["ALERT_ACTIONS", "ALERT_BODIES", "AlertConfig", "AlertSender", "alert_body",
           "alert_text", "webhook_key"]  # fmt: skip

log = logging.getLogger("rankscope.serve.alerts")

ALERT_ACTIONS = ("evict", "recover")
ALERT_BODIES = ("json", "slack")
_RETRY_STATUS = frozenset({408, 429})


@dataclass(kw_only=True, slots=True)
class AlertConfig:
    """The webhooks of one ``serve`` and how hard to try them."""

    urls: tuple[str, ...]
    """``http(s)://`` URLs, each posted every alert."""
    body: str = "json"
    """``json`` (the finding's fields) or ``slack`` (``{"text": ...}``), for every URL."""
    secret: bytes | None = None
    """Signs each body (``X-Rankscope-Signature``); None: unsigned."""
    timeout_s: float = 5.0
    """Longest one try waits for the receiver's answer."""
    attempts: int = 6
    """Tries per alert and webhook before it is given up (logged)."""
    backoff_s: float = 1.0
    """Wait before the second try; doubled before each further one."""
    backoff_max_s: float = 60.0
    """Longest wait between two tries."""
    queue_size: int = 1000
    """Alerts waiting per webhook; more are dropped (counted, logged once)."""
    drain_s: float = 5.0
    """At shutdown, how long queued alerts may still be tried."""

    def __post_init__(self) -> None:
        self.urls = tuple(self.urls)
        if not self.urls:
            raise ValueError("alerts: at least one webhook URL")
        for url in self.urls:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"alerts: webhook {_name(url)!r} is not an http(s):// URL")
        if self.body not in ALERT_BODIES:
            raise ValueError(f"alerts: body {self.body!r}; want one of {', '.join(ALERT_BODIES)}")
        if self.secret is not None and len(self.secret) < 16:
            raise ValueError("alerts: secret must be at least 16 bytes")
        if self.timeout_s <= 0 or self.backoff_s <= 0 or self.drain_s < 0:
            raise ValueError("alerts: timeout_s and backoff_s must be > 0, drain_s >= 0")
        if self.backoff_max_s < self.backoff_s:
            raise ValueError("alerts: backoff_max_s must be >= backoff_s")
        if self.attempts < 1 or self.queue_size < 1:
            raise ValueError("alerts: attempts and queue_size must be >= 1")


def _name(url: str) -> str:
    """A URL for logs: scheme and host, never the path or query (tokens live there)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname or '?'}" + (f":{parts.port}" if parts.port else "")


def webhook_key(url: str) -> str:
    """What the ledger stores for a webhook: a hash, not the URL (it may hold a token)."""
    return hashlib.sha256(url.encode()).hexdigest()[:16]


def alert_text(f: dict) -> str:
    hosts = ", ".join(f.get("hosts") or []) or "?"
    return (
        f"rankscope: {f['action']} {f['kind']} on ranks {f['ranks']} (hosts {hosts}) of job "
        f"{f['job']}, since step {f['first_step']}, detected at step {f['detected_step']}; "
        f"finding {f['finding_id']} ({f['detector']})"
    )


def alert_body(f: dict, body: str, *, now: float | None = None) -> bytes:
    """The POST body for finding dict ``f`` (``Finding.to_dict()``)."""
    text = alert_text(f)
    if body == "slack":
        return orjson.dumps({"text": text})
    return orjson.dumps({**f, "text": text, "source": "rankscope",
                         "alerted_t": time.time() if now is None else now})  # fmt: skip


class _Webhook:
    """One URL: its queue, its thread, its counters."""

    def __init__(self, number: int, url: str, cfg: AlertConfig, done: set[str], mark) -> None:
        self.number, self.url, self.cfg = number, url, cfg
        self.name = f"webhook {number} ({_name(url)})"
        self.done = done  # finding ids offered (or delivered before a restart)
        self._mark = mark
        self.queue: queue.Queue = queue.Queue(maxsize=cfg.queue_size)
        self.sent = self.failed = self.retries = self.dropped = 0
        self._abort = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"rankscope-alerts-{number}",
                                        daemon=True)  # fmt: skip
        self._thread.start()

    def offer(self, fid: str, body: bytes) -> None:
        try:
            self.queue.put_nowait((fid, body))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                log.warning("%s: alert queue full (%d); dropping alerts (counted in "
                            "rankscope_alerts_dropped_total)", self.name, self.cfg.queue_size)

    def close(self, deadline: float) -> int:
        """Stop after what is queued or at ``deadline``; returns alerts left undelivered."""
        try:
            self.queue.put(None, timeout=max(0.0, deadline - time.monotonic()))
        except queue.Full:
            pass
        self._thread.join(max(0.0, deadline - time.monotonic()))
        self._abort.set()  # ends a backoff wait now, a try in flight at its timeout
        self._thread.join(self.cfg.timeout_s + 1.0)
        return sum(item is not None for item in list(self.queue.queue))

    def _run(self) -> None:
        while not self._abort.is_set():
            item = self.queue.get()
            if item is None:
                return
            self._deliver(*item)

    def _deliver(self, fid: str, body: bytes) -> None:
        wait = self.cfg.backoff_s
        for attempt in range(1, self.cfg.attempts + 1):
            retry, why = self._post(fid, body)
            if why is None:
                self.sent += 1
                self._mark(fid, self.url)
                return
            if not retry or attempt == self.cfg.attempts:
                break
            self.retries += 1
            log.debug("%s: try %d for finding %s failed (%s); again in %.1f s",
                      self.name, attempt, fid, why, wait)  # fmt: skip
            if self._abort.wait(wait):
                break
            wait = min(wait * 2, self.cfg.backoff_max_s)
        self.failed += 1
        log.warning("%s: alert for finding %s not delivered after %d tries: %s",
                    self.name, fid, attempt, why)  # fmt: skip

    def _post(self, fid: str, body: bytes) -> tuple[bool, str | None]:
        """One try: ``(worth retrying, None on success or why it failed)``."""
        headers = {"Content-Type": "application/json", "User-Agent": "rankscope-serve",
                   "X-Rankscope-Alert-Id": fid}  # fmt: skip
        if self.cfg.secret is not None:
            ts = f"{time.time():.0f}"
            mac = hmac.new(self.cfg.secret, ts.encode() + b"." + body, hashlib.sha256)
            headers["X-Rankscope-Timestamp"] = ts
            headers["X-Rankscope-Signature"] = "sha256=" + mac.hexdigest()
        req = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.cfg.timeout_s) as resp:
                resp.read(1 << 16)
                return False, None
        except urllib.error.HTTPError as exc:
            return exc.code >= 500 or exc.code in _RETRY_STATUS, f"HTTP {exc.code}"
        except (OSError, ValueError) as exc:  # refused, reset, timeout, TLS, bad address
            reason = getattr(exc, "reason", exc)
            return True, f"{type(reason).__name__}: {reason}"


class AlertSender:
    """Offers evict/recover findings to every webhook once (see the module docstring)."""

    def __init__(self, cfg: AlertConfig, *, delivered: dict[str, set[str]] | None = None,
                 mark=None) -> None:  # fmt: skip
        """``delivered``: webhook key -> finding ids posted before (the ledger);
        ``mark(finding_id, url)`` is called on the webhook's thread after each 2xx."""
        self.cfg = cfg
        delivered = delivered or {}
        self.webhooks = [
            _Webhook(i, url, cfg, set(delivered.get(webhook_key(url), ())), mark or _no_mark)
            for i, url in enumerate(cfg.urls)
        ]

    def offer(self, finding: dict) -> None:
        """Queue ``finding`` (a ``Finding.to_dict()``) to each webhook that has not had it.
        Never blocks; findings whose action is not evict/recover are ignored."""
        if finding.get("action") not in ALERT_ACTIONS:
            return
        fid = finding["finding_id"]
        body = None
        for hook in self.webhooks:
            if fid in hook.done:
                continue
            hook.done.add(fid)
            if body is None:
                body = alert_body(finding, self.cfg.body)
            hook.offer(fid, body)

    def counts(self) -> list[dict]:
        """Per webhook: number, sent, failed, retries, dropped, queued (for metrics, progress)."""
        return [{"webhook": str(h.number), "sent": h.sent, "failed": h.failed,
                 "retries": h.retries, "dropped": h.dropped, "queued": h.queue.qsize()}
                for h in self.webhooks]  # fmt: skip

    def close(self) -> None:
        """Deliver what is queued for up to ``drain_s``, then stop (what is left is logged)."""
        deadline = time.monotonic() + self.cfg.drain_s
        for hook in self.webhooks:
            left = hook.close(deadline)
            if left:
                log.warning("%s: %d alert(s) not delivered at shutdown", hook.name, left)


def _no_mark(_fid: str, _url: str) -> None:
    pass
