"""The nonces a rank has accepted, kept on disk so a restarted rank still refuses replays.

The verifier remembers nonces in memory, so a rank restarted by its launcher
accepted a captured genuine ``evict`` again for up to ``max_age_s``. This file
holds the accepted nonces of one job and rank (``nonce -> issued_t``); the
listener seeds its verifier from it at start and adds each accepted nonce
before acting on the message. Entries older than ``max_age_s`` plus the clock
skew are pruned (such a message is refused as expired anyway), so the file
stays a few lines long. A file that cannot be read or written is said once at
WARNING and replay protection falls back to memory: training never stops for it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import time
from pathlib import Path

__all__ = ["SeenNonces", "default_state_file"]

log = logging.getLogger("rankscope.control")
_MAX_BYTES = 1 << 20


def default_state_file(job: str, rank: int) -> Path:
    """``$RANKSCOPE_CONTROL_STATE_DIR`` (else the temp dir)/``rankscope-control/<job>.<rank>``."""
    base = os.environ.get("RANKSCOPE_CONTROL_STATE_DIR") or tempfile.gettempdir()
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", job)[:100] or "job"
    return Path(base) / "rankscope-control" / f"{safe}.rank{rank}.nonces.json"


class SeenNonces:
    """Accepted nonces of one rank, persisted in ``path`` (see the module docstring)."""

    def __init__(self, path: str | os.PathLike, horizon_s: float) -> None:
        self.path = Path(path)
        self.horizon_s = horizon_s
        self._warned = False

    def load(self, now: float | None = None) -> dict[str, float]:
        """The nonces still within the horizon; {} when there is no usable file."""
        now = time.time() if now is None else now
        try:
            if self.path.stat().st_size > _MAX_BYTES:
                raise ValueError(f"larger than {_MAX_BYTES} bytes")
            raw = json.loads(self.path.read_bytes())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, RecursionError) as exc:
            self._warn(f"unreadable ({exc})")
            return {}
        if not isinstance(raw, dict):
            self._warn("not a JSON object")
            return {}
        return {n: float(t) for n, t in raw.items() if isinstance(n, str)
                and isinstance(t, (int, float)) and not isinstance(t, bool)
                and now - t <= self.horizon_s}  # fmt: skip

    def add(self, nonce: str, issued_t: float, now: float | None = None) -> None:
        """Persist one more accepted nonce (atomically: a crash leaves the old file)."""
        kept = self.load(now)
        kept[nonce] = float(issued_t)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(self.path.name + f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(kept))
            os.replace(tmp, self.path)
        except OSError as exc:
            self._warn(f"cannot be written ({exc})")

    def _warn(self, what: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("control replay state %s %s: replay protection is per process now",
                        self.path, what)  # fmt: skip
