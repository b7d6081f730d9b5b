"""Fixtures of the tests against the real broker: a topic prefix per test, started processes."""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest
from support.kafka import bootstrap


@pytest.fixture
def procs():
    """Processes a test starts; any still running at teardown are killed."""
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)


@pytest.fixture
def kafka_url():
    """A kafka:// URL with a topic prefix of its own; the topics are deleted afterwards."""
    from rankscope.pipeline.bus.kafka import KafkaBus

    url = f"kafka://{bootstrap()}?topic_prefix=t{uuid.uuid4().hex[:10]}"
    yield url
    try:
        KafkaBus(url).delete_topics()
    except Exception as exc:  # the broker may be gone after a failure; do not mask it
        print(f"topic cleanup failed: {exc}", file=sys.stderr)
