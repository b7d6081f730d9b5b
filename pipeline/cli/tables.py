"""Plain-text tables and a progress bar for the command line (no dependencies).

Findings print the same way from ``replay`` and ``findings``; the progress
bar draws on stderr only when it is a terminal (or when forced), so piped
output and logs stay clean.
"""

from __future__ import annotations

import sys
import time

__all__ = ["render_table", "findings_rows", "FINDING_HEADER", "ProgressBar", "fmt_ranks"]

FINDING_HEADER = ("job", "kind", "ranks", "hosts", "steps", "detected", "score", "action",
                  "detector")  # fmt: skip


def fmt_ranks(values, cap: int = 8) -> str:
    """``3,5,7`` or ``0,1,...(+30)`` for long lists."""
    values = [str(v) for v in values]
    if len(values) > cap:
        return ",".join(values[:cap]) + f",...(+{len(values) - cap})"
    return ",".join(values)


def findings_rows(findings: list[dict]) -> list[tuple]:
    """Table rows of findings given in their JSON shape."""
    rows = []
    for f in findings:
        score = f.get("score")
        action = f["action"] + (" (unattributed)" if f.get("unattributed") else "") + _sent(f)
        rows.append(
            (
                f["job"],
                f["kind"],
                fmt_ranks(f["ranks"]),
                fmt_ranks(f["hosts"], cap=4),
                f"{f['first_step']}-{f['last_step']}",
                str(f["detected_step"]),
                f"{score:.2f}" if isinstance(score, int | float) else "-",
                action,
                f["detector"],
            )
        )
    return rows


_STRENGTH = {"observe": 0, "recover": 1, "evict": 2}


def _sent(f: dict) -> str:
    """`` (evict sent at 55)`` when an action stronger than the finding's current one was
    issued while it was open (a straggler whose job then stopped slowing is only worth
    watching now, but the trainer was told to evict): the reader must see both."""
    sent = (f.get("evidence") or {}).get("actions") or {}
    now = _STRENGTH.get(f["action"], 0)
    done = [(a, w) for a, w in sent.items() if _STRENGTH.get(a, 0) > now]
    if not done:
        return ""
    a, w = max(done, key=lambda aw: _STRENGTH[aw[0]])
    step = w.get("step") if isinstance(w, dict) else None
    return f" ({a} sent" + (f" at {step})" if step is not None else ")")


def render_table(header: tuple, rows: list[tuple]) -> str:
    """Columns padded to their widest cell; numbers right-aligned."""
    cells = [tuple(str(c) for c in header)] + [tuple(str(c) for c in r) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def numeric(s: str) -> bool:
        return s.replace(".", "", 1).replace("-", "", 1).isdigit()

    lines = []
    for r in cells:
        parts = [c.rjust(w) if numeric(c) else c.ljust(w) for c, w in zip(r, widths, strict=True)]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


class ProgressBar:
    """``[#####.....] 52% 1.2M/2.3M records`` redrawn on stderr at most 5 times a second."""

    def __init__(self, enabled: bool | None = None, stream=None, min_total: int = 20000) -> None:
        self.stream = stream or sys.stderr
        if enabled is None:
            enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled = enabled
        self.min_total = min_total
        self._last = 0.0
        self._drawn = False

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or total < self.min_total:
            return
        now = time.monotonic()
        if now - self._last < 0.2 and done < total:
            return
        self._last = now
        frac = done / total if total else 1.0
        bar = "#" * int(frac * 30)
        self.stream.write(f"\r[{bar:<30}] {frac:4.0%} {done}/{total} records")
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
