"""Sink objects for tests: each has the sink protocol (send, flush, close) and one behaviour."""

from __future__ import annotations

import threading

__all__ = ["ListSink", "NullSink", "StalledSink", "FailingSink"]


class ListSink:
    """Keeps what it was sent (the sender calls it from its own thread)."""

    def __init__(self) -> None:
        self.records: list[dict] = []

    def send(self, records) -> None:
        self.records.extend(records)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class NullSink(ListSink):
    """Forgets what it was sent; also takes single records (``put``)."""

    def send(self, records) -> None:
        pass

    def put(self, rec) -> None:
        pass


class StalledSink(ListSink):
    """A send that blocks until released: a hung network, a full disk."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()

    def send(self, records) -> None:
        self.entered.set()
        self.release.wait(60)
        self.records.extend(records)


class FailingSink(ListSink):
    """The first ``failures`` sends raise (a broker down); every flush raises."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    def send(self, records) -> None:
        if self.failures:
            self.failures -= 1
            raise ConnectionError("broker unreachable")
        self.records.extend(records)

    def flush(self) -> None:
        raise OSError("flush failed")
