"""``embedded`` / ``embedded://NAME``: records into a queue the pipeline reads.

A channel is a ``queue.Queue`` (same process) or a ``multiprocessing`` queue
(the service runs in a parent process and spawned rank processes send to it).
The reading side registers the queue with ``register_channel(name, q)``; a
spawned rank process registers the queue it was handed the same way before
attaching. ``embedded`` with no name means channel ``"default"``, created on
first use as an in-process ``queue.Queue`` when nobody registered one.

Each queue item is one batch: a ``list`` of record dicts (one put per batch
keeps cross-process traffic cheap). ``iter_channel`` flattens batches back
into records for readers.
"""

from __future__ import annotations

import queue as queue_mod
import threading
from collections.abc import Iterator
from typing import Any

__all__ = [
    "EmbeddedSink",
    "register_channel",
    "unregister_channel",
    "get_channel",
    "iter_channel",
]

_channels: dict[str, Any] = {}
_lock = threading.Lock()
DEFAULT_CHANNEL = "default"


def register_channel(name: str, q: Any) -> None:
    """Make ``q`` (anything with ``put`` and ``get``) the channel called ``name``."""
    if not name:
        raise ValueError("channel name must be non-empty")
    if not callable(getattr(q, "put", None)):
        raise ValueError(f"channel {name!r}: {q!r} has no put()")
    with _lock:
        _channels[name] = q


def unregister_channel(name: str) -> None:
    with _lock:
        _channels.pop(name, None)


def get_channel(name: str = DEFAULT_CHANNEL, *, create: bool = True) -> Any:
    """The queue behind ``name``; an in-process queue is created when missing and allowed."""
    with _lock:
        q = _channels.get(name)
        if q is None and create:
            q = _channels[name] = queue_mod.Queue()
        return q


def iter_channel(q: Any, *, timeout_s: float = 0.0) -> Iterator[dict]:
    """Yield the records waiting in ``q`` (batches flattened), waiting at most ``timeout_s``
    for the first one; stops when the queue is empty."""
    wait = timeout_s
    while True:
        try:
            item = q.get(timeout=wait) if wait > 0 else q.get_nowait()
        except queue_mod.Empty:
            return
        wait = 0.0
        if isinstance(item, list):
            yield from item
        elif isinstance(item, dict):
            yield item


class EmbeddedSink:
    """Puts each batch into a registered channel without blocking."""

    def __init__(self, name: str, q: Any) -> None:
        self.name = name
        self._q = q

    @classmethod
    def from_url(cls, url: str) -> EmbeddedSink:
        low = url.lower()
        if low == "embedded":
            name = DEFAULT_CHANNEL
        elif low.startswith("embedded://"):
            name = url[len("embedded://") :]
            if not name or "/" in name or "?" in name:
                raise ValueError(f"embedded sink URL {url!r}: expected embedded://NAME")
        else:
            raise ValueError(
                f"embedded sink URL must be 'embedded' or embedded://NAME, got {url!r}"
            )
        if name == DEFAULT_CHANNEL:
            return cls(name, get_channel(name, create=True))
        q = get_channel(name, create=False)
        if q is None:
            raise ValueError(
                f"embedded sink URL {url!r}: no channel {name!r} registered in this process; "
                "call rankscope.collectors.sinks.embedded.register_channel(name, queue) first"
            )
        return cls(name, q)

    def send(self, records: list[dict]) -> None:
        # put_nowait: a full bounded channel raises queue.Full, which the
        # sender counts as a failed send instead of blocking.
        put = getattr(self._q, "put_nowait", None) or self._q.put
        put(list(records))

    def flush(self) -> None:
        return None

    def close(self) -> None:
        return None
