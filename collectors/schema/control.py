"""Signing and checking evict/recover control messages (HMAC-SHA256, shared secret).

Nobody may evict a node by writing to the control topic, so every message
carries ``sig``: HMAC-SHA256, keyed by a secret the service and the
collectors share, over the message's *canonical encoding*: the message
without ``sig`` as JSON with keys sorted, no whitespace, ASCII only
(``json.dumps(m, sort_keys=True, separators=(",", ":"), ensure_ascii=True)``).
Any tool in any language can produce the same bytes from the same values.

``Verifier.check`` rejects, with the reason, a message that is unsigned,
whose signature does not match (forged or altered), that is older than
``max_age_s`` or dated in the future beyond ``clock_skew_s`` (expired
or not yet valid), or that repeats a ``nonce`` or a ``(finding_id, action)``
already accepted (replayed; the service may re-publish after a restart, the
ranks act once). Lives in ``collectors`` so a training process can check
messages with the standard library alone; ``rankscope.pipeline.serve.control`` re-exports it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import time
from dataclasses import dataclass

__all__ = [
    "ControlAuthConfig",
    "Verifier",
    "sign",
    "canonical",
    "load_secret",
    "CONTROL_FIELDS",
    "CONTROL_ACTIONS",
]

CONTROL_FIELDS = ("job", "action", "ranks", "hosts", "step", "finding_id", "reason", "issued_t")
CONTROL_ACTIONS = ("evict", "recover")
MIN_SECRET_BYTES = 16


def canonical(msg: dict) -> bytes:
    """The bytes that are signed: ``msg`` minus ``sig``, sorted keys, compact, ASCII."""
    body = {k: v for k, v in msg.items() if k != "sig"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _mac(secret: bytes, msg: dict) -> str:
    return hmac.new(secret, canonical(msg), hashlib.sha256).hexdigest()


def load_secret(value: str | bytes | None = None, *, env: dict | None = None) -> bytes:
    """The shared secret: the argument, else ``$RANKSCOPE_CONTROL_SECRET``, else the file
    named by ``$RANKSCOPE_CONTROL_SECRET_FILE``. At least 16 bytes; raises ValueError."""
    env = os.environ if env is None else env
    if value is None:
        if env.get("RANKSCOPE_CONTROL_SECRET"):
            value = env["RANKSCOPE_CONTROL_SECRET"]
        elif env.get("RANKSCOPE_CONTROL_SECRET_FILE"):
            path = env["RANKSCOPE_CONTROL_SECRET_FILE"]
            try:
                with open(path, "rb") as fh:
                    value = fh.read().strip()
            except OSError as exc:
                raise ValueError(f"control secret file {path!r}: {exc.strerror}") from None
        else:
            raise ValueError(
                "no control secret: set RANKSCOPE_CONTROL_SECRET or RANKSCOPE_CONTROL_SECRET_FILE"
            )
    secret = value.encode() if isinstance(value, str) else bytes(value)
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"control secret is {len(secret)} bytes; use at least {MIN_SECRET_BYTES}")
    return secret


def sign(msg: dict, secret: bytes, *, now: float | None = None) -> dict:
    """A signed copy of ``msg``: adds ``issued_t`` (if absent), a fresh ``nonce`` and ``sig``."""
    out = {k: v for k, v in msg.items() if k != "sig"}
    out.setdefault("issued_t", time.time() if now is None else now)
    out["nonce"] = secrets.token_hex(16)
    out["sig"] = _mac(secret, out)
    return out


@dataclass(kw_only=True, slots=True)
class ControlAuthConfig:
    """How strictly a receiver checks control messages."""

    max_age_s: float = 300.0
    """Messages issued longer ago than this are expired."""
    clock_skew_s: float = 30.0
    """Tolerated lead of the issuer's clock over ours."""

    def __post_init__(self) -> None:
        if self.max_age_s <= 0:
            raise ValueError(f"max_age_s must be > 0, got {self.max_age_s}")
        if self.clock_skew_s < 0:
            raise ValueError(f"clock_skew_s must be >= 0, got {self.clock_skew_s}")


def _shape_error(msg) -> str | None:
    if not isinstance(msg, dict):
        return "not a JSON object"
    for name in CONTROL_FIELDS:
        if name not in msg:
            return f"missing field {name!r}"
    if msg["action"] not in CONTROL_ACTIONS:
        return f"unknown action {msg['action']!r}"
    if not isinstance(msg["ranks"], list) or not all(
        isinstance(r, int) and not isinstance(r, bool) for r in msg["ranks"]
    ):
        return "ranks is not a list of ints"
    if not isinstance(msg["hosts"], list) or not all(isinstance(h, str) for h in msg["hosts"]):
        return "hosts is not a list of strings"
    if not isinstance(msg["issued_t"], (int, float)) or isinstance(msg["issued_t"], bool):
        return "issued_t is not a number"
    if not isinstance(msg.get("nonce"), str) or not msg["nonce"]:
        return "missing nonce"
    return None


class Verifier:
    """Stateful check of incoming control messages (one per receiver)."""

    def __init__(self, secret: bytes, cfg: ControlAuthConfig | None = None) -> None:
        self._secret = secret
        self.cfg = cfg or ControlAuthConfig()
        self._nonces: dict[str, float] = {}  # nonce -> issued_t, pruned after max_age_s
        self._acted: set[tuple[str, str]] = set()  # (finding_id, action) accepted

    def check(self, msg, *, now: float | None = None) -> str | None:
        """``None`` when ``msg`` is authentic, fresh and new (and remember it), else the reason."""
        now = time.time() if now is None else now
        if not isinstance(msg, dict) or not isinstance(msg.get("sig"), str):
            return "unsigned"
        reason = _shape_error(msg)
        if reason:
            return f"malformed: {reason}"
        if not hmac.compare_digest(_mac(self._secret, msg), msg["sig"]):
            return "bad signature (forged or altered)"
        issued = float(msg["issued_t"])
        if now - issued > self.cfg.max_age_s:
            return f"expired: issued {now - issued:.0f} s ago (max {self.cfg.max_age_s:.0f} s)"
        if issued - now > self.cfg.clock_skew_s:
            return f"not yet valid: issued {issued - now:.0f} s in the future"
        self._prune(now)
        if msg["nonce"] in self._nonces:
            return "replayed: nonce seen before"
        key = (str(msg["finding_id"]), msg["action"])
        if key in self._acted:
            return f"replayed: {msg['action']} for finding {msg['finding_id']} already accepted"
        self._nonces[msg["nonce"]] = issued
        self._acted.add(key)
        return None

    def seed(self, nonces: dict[str, float]) -> None:
        """Remember nonces accepted before (``nonce -> issued_t``), e.g. by this rank before
        a restart, so a captured message cannot be replayed to the new process."""
        self._nonces.update(nonces)

    def _prune(self, now: float) -> None:
        # A nonce older than max_age_s can never come back valid: it would be expired.
        if len(self._nonces) > 1024:
            horizon = now - self.cfg.max_age_s - self.cfg.clock_skew_s
            self._nonces = {n: t for n, t in self._nonces.items() if t >= horizon}
