"""Control messages from findings: what the service tells the trainers.

For every finding whose action is ``evict`` or ``recover`` the service
publishes one signed message to ``<prefix>.control``::

    {"job", "action", "ranks", "hosts", "step", "finding_id", "reason",
     "issued_t", "nonce", "sig"}

``hosts`` is empty when the finding's evidence says ``evict_scope: ranks``
(an evict on every host of the job: the ranks go, the host cannot).
``step`` is the finding's ``first_step`` (the first step the fault showed;
a rollback goes to ``step - 1``). The signature and the receiver's checks live
in ``rankscope.collectors.schema.control`` (re-exported here) so that training processes
verify with the standard library alone; the receiver is
``rankscope.collectors.control.listener``. A finding is announced once per action: an
incident that escalates from ``recover`` to ``evict`` gets a second message,
later updates of the same verdict do not. After a service restart the same
verdict may be announced again (at least once); receivers drop it as a replay
of ``(finding_id, action)``.
"""

from __future__ import annotations

import time

from rankscope.collectors.schema.control import (
    CONTROL_ACTIONS,
    ControlAuthConfig,
    Verifier,
    canonical,
    load_secret,
    sign,
)

__all__ = [
    "control_message",
    "ControlAnnouncer",
    "ControlAuthConfig",
    "Verifier",
    "canonical",
    "load_secret",
    "sign",
]


def control_message(finding, *, now: float | None = None) -> dict | None:
    """The unsigned control message for a finding (a ``Finding`` or its dict), or
    ``None`` when its action asks nothing of the trainers."""
    d = finding if isinstance(finding, dict) else finding.to_dict()
    if d.get("action") not in CONTROL_ACTIONS:
        return None
    kind, detector = d.get("kind", "?"), d.get("detector", "?")
    ev = d.get("evidence") or {}
    reason = f"{kind} on ranks {d.get('ranks')} since step {d['first_step']} ({detector})"
    hosts = [str(h) for h in d.get("hosts") or []]
    if d["action"] == "evict" and ev.get("evict_scope") == "ranks":  # the job's only host(s)
        hosts = []
        reason += f"; {ev.get('host_note', 'evict the ranks, not the host')}"
    return {
        "job": str(d["job"]),
        "action": d["action"],
        "ranks": [int(r) for r in d.get("ranks") or []],
        "hosts": hosts,
        "step": int(d["first_step"]),
        "finding_id": str(d["finding_id"]),
        "reason": reason,
        "issued_t": time.time() if now is None else now,
    }


class ControlAnnouncer:
    """Turns findings into signed control messages, once per (finding, action)."""

    def __init__(self, secret: bytes, *, announced: set[tuple[str, str]] | None = None) -> None:
        self._secret = secret
        self._announced: set[tuple[str, str]] = set(announced or ())

    def messages(self, findings, *, now: float | None = None) -> list[dict]:
        out = []
        for f in findings:
            msg = control_message(f, now=now)
            if msg is None:
                continue
            key = (msg["finding_id"], msg["action"])
            if key in self._announced:
                continue
            self._announced.add(key)
            out.append(sign(msg, self._secret, now=now))
        return out
