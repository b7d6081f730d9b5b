"""One factory from a sink URL to a sink object.

The table maps URL schemes to ``module:Class`` strings and imports lazily, so
a training process that writes files never imports the Kafka client. Every
sink class has ``from_url(url)`` (raises ``ValueError`` that says what is
wrong with the URL), ``send(records)``, ``flush()`` and ``close()``.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

__all__ = ["SINKS", "Sink", "make_sink"]

SINKS: dict[str, str] = {
    "file": "rankscope.collectors.sinks.file:FileSink",
    "embedded": "rankscope.collectors.sinks.embedded:EmbeddedSink",
    "kafka": "rankscope.collectors.sinks.kafka:KafkaSink",
}


class Sink(Protocol):
    """What the background sender needs from a sink."""

    def send(self, records: list[dict]) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


def _scheme(url: str) -> str:
    if "://" in url:
        return url.split("://", 1)[0].lower()
    return url.lower()  # a bare scheme such as "embedded"


def make_sink(url: str | Any) -> Sink:
    """Build the sink a URL names, or pass through an object that already is a sink.

    Raises ``ValueError`` with the reason when the URL cannot be used.
    """
    if not isinstance(url, str):
        missing = [m for m in ("send", "flush", "close") if not callable(getattr(url, m, None))]
        if missing:
            raise ValueError(
                f"sink object {url!r} lacks method(s) {', '.join(missing)}; "
                "pass a URL such as file://DIR, embedded or kafka://HOST:PORT/TOPIC"
            )
        return url
    if not url.strip():
        raise ValueError("empty sink URL; expected file://DIR, embedded[://NAME] or kafka://...")
    scheme = _scheme(url)
    target = SINKS.get(scheme)
    if target is None:
        known = ", ".join(f"{s}://" for s in SINKS)
        raise ValueError(f"unknown sink URL scheme {scheme!r} in {url!r}; known: {known}")
    module_name, cls_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"sink {scheme!r} is not available here: {exc}") from exc
    return getattr(module, cls_name).from_url(url)
