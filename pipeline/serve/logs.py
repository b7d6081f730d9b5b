"""What ``serve`` says, as text for people or one JSON object a line for log shippers.

Every line the service means for an operator is an *event*: a name (``start``,
``assigned``, ``finding``, ``action``, ``progress``, ...) and fields, logged
with ``event(...)``. The text format prints the message; the JSON format
prints ``ts``, ``level``, ``logger``, ``event`` and ``msg`` on every line (a
plain log call has ``event: "log"``), then the event's own fields, so a
shipper can index them without parsing prose. The keys are listed in
docs/kafka.md ("Logs"). Formatting happens only when a line is written.
"""

from __future__ import annotations

import logging
import sys
import time

import orjson
from rankscope.collectors.schema.kafka import is_slow_client_loop

__all__ = ["LOG_FORMATS", "JsonFormatter", "configure_logging", "event"]

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def event(log: logging.Logger, name: str, msg: str, /, *args, level: int = logging.INFO,
          **fields) -> None:  # fmt: skip
    """Log ``msg % args`` as event ``name`` with ``fields`` (kept for the JSON format)."""
    if log.isEnabledFor(level):
        log.log(level, msg, *args, extra={"event": name, "fields": fields})


class JsonFormatter(logging.Formatter):
    """One JSON object a line: stable keys first, then the event's fields."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        out = {
            "ts": f"{ts}.{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "event": getattr(record, "event", "log"),
            "msg": record.getMessage(),
        }
        for key, value in (getattr(record, "fields", None) or {}).items():
            out.setdefault(key, value)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str, option=orjson.OPT_NON_STR_KEYS).decode()


def _not_a_slow_client_loop(record: logging.LogRecord) -> bool:
    """Drops kafka-python 3's warning that one step of its event loop took over 0.1 s.

    In ``serve`` the detectors share the process, and the GIL, with the clients, so on
    a busy host a step often takes that long: that is load, not a client fault.
    Consumer lag and the progress line say when the service falls behind.
    """
    return not is_slow_client_loop(record)


def configure_logging(fmt: str = "text", verbose: int = 0, stream=None) -> None:
    """One handler on stderr for everything; rankscope at INFO (DEBUG with ``-v``).

    The Kafka client stays at WARNING (its INFO is a line per connection and
    rebalance step), less its slow-loop warning, unless ``-vv``."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format {fmt!r}: want one of {', '.join(LOG_FORMATS)}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    if verbose < 2:  # -vv shows the Kafka client's own chatter, this too
        handler.addFilter(_not_a_slow_client_loop)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    logging.getLogger("rankscope").setLevel(logging.DEBUG if verbose else logging.INFO)
    logging.getLogger("kafka").setLevel(logging.INFO if verbose > 1 else logging.WARNING)
