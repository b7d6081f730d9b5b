"""The Kafka bus: topics, their creation, and thin producer/consumer wrappers.

Topics (``<prefix>`` from the URL, default ``rankscope``):

- ``<prefix>.telemetry``: ``step``, ``beat`` and ``check`` records, key = job,
  so one job's records stay in order in one partition and are assembled by
  one ``serve`` process;
- ``<prefix>.gpu``: ``gpu`` samples, key = job as well. It must have as many
  partitions as the telemetry topic: the consumer group's range assignment
  then gives partition *i* of both topics to the same ``serve`` process, so a
  job's GPU readings reach the process assembling its steps;
- ``<prefix>.findings``: one finding (JSON, trace format plus ``finding_id``)
  a message, key = job;
- ``<prefix>.control``: signed evict/recover messages (``rankscope.pipeline.serve.control``);
- ``<prefix>.deadletter``: messages the service could not use, with the
  reason, source topic, partition and offset in the headers and the original
  bytes as the value.

Message values on the telemetry and gpu topics are a JSON record or a JSON
array of records (one producer's records of one job, e.g. all ranks of one
step from ``rankscope publish``): batching is what lets one consumer reach
100,000 records a second, since the per-message cost of the Python client is
far larger than the per-record cost of decoding JSON.

Security options (SASL, SSL) come from the URL or the environment
(``rankscope.collectors.schema.kafka``) and pass through to every client.
"""

from __future__ import annotations

import logging

import orjson
from rankscope.collectors.schema.kafka import (
    DEFAULT_COMPRESSION,
    TOPIC_KINDS,
    KafkaUrl,
    compression_type,
    idempotence_kwargs,
)
from rankscope.pipeline.traces.validate import parse_json

__all__ = ["KafkaBus", "encode_records", "decode_value"]

log = logging.getLogger("rankscope.bus")


def encode_records(records: list[dict]) -> bytes:
    """One message value: the record itself when alone, else a JSON array."""
    body = records[0] if len(records) == 1 else records
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


def decode_value(value: bytes | None) -> list:
    """The elements of one message value (a record, or an array whose elements the
    caller judges one by one, so one bad element costs only itself); raises ValueError
    saying what is wrong with the value as a whole. ``NaN``/``Infinity`` tokens are
    accepted (``rankscope.pipeline.traces.validate.parse_json``)."""
    if value is None:
        raise ValueError("empty message (null value)")
    try:
        body = parse_json(value)
    except ValueError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if isinstance(body, dict):
        return [body]
    if isinstance(body, list):
        return body
    raise ValueError(f"a JSON {type(body).__name__}, neither a record nor an array of records")


class KafkaBus:
    """One Kafka cluster as rankscope uses it."""

    def __init__(self, url: str | KafkaUrl) -> None:
        self.url = url if isinstance(url, KafkaUrl) else KafkaUrl.parse(url)

    def topic(self, kind: str) -> str:
        return self.url.topic(kind)

    def ensure_topics(self, partitions: int = 4, kinds=TOPIC_KINDS, timeout_s=30.0) -> list[str]:
        """Create the missing topics (``partitions`` each, replication 1 on a single
        broker, else 3 or the broker count); returns the names created."""
        from kafka import KafkaAdminClient
        from kafka.admin import NewTopic
        from kafka.errors import TopicAlreadyExistsError

        if partitions < 1:
            raise ValueError(f"partitions must be >= 1, got {partitions}")
        admin = KafkaAdminClient(
            **self.url.client_kwargs(), request_timeout_ms=int(timeout_s * 1000)
        )
        try:
            existing = set(admin.list_topics())
            brokers = max(1, len(admin.describe_cluster().get("brokers", [])))
            replication = min(3, brokers)
            wanted = [self.topic(k) for k in kinds]
            new = [
                NewTopic(name, partitions, replication) for name in wanted if name not in existing
            ]
            created = []
            for nt in new:  # one at a time: a racing creator must not fail the others
                try:
                    admin.create_topics([nt], timeout_ms=int(timeout_s * 1000))
                    created.append(nt.name)
                except TopicAlreadyExistsError:
                    pass
            if created:
                log.info("created topics %s (%d partitions)", created, partitions)
            return created
        finally:
            admin.close()

    def delete_topics(self, kinds=TOPIC_KINDS, timeout_s: float = 30.0) -> None:
        """Delete this prefix's topics (tests and benchmarks clean up after themselves)."""
        from kafka import KafkaAdminClient
        from kafka.errors import UnknownTopicOrPartitionError

        admin = KafkaAdminClient(
            **self.url.client_kwargs(), request_timeout_ms=int(timeout_s * 1000)
        )
        try:
            existing = set(admin.list_topics())
            names = [self.topic(k) for k in kinds if self.topic(k) in existing]
            if names:
                try:
                    admin.delete_topics(names, timeout_ms=int(timeout_s * 1000))
                except UnknownTopicOrPartitionError:
                    pass
        finally:
            admin.close()

    def producer(self, **overrides):
        from kafka import KafkaProducer

        kw = {
            "linger_ms": 20,
            "compression_type": compression_type(
                self.url.option("compression", DEFAULT_COMPRESSION)
            ),  # fmt: skip
            "batch_size": 1 << 20,
            "max_request_size": 8 << 20,
            "acks": 1,
            "reconnect_backoff_max_ms": 1000,
        }
        kw.update(overrides)
        kw.update(idempotence_kwargs(kw["acks"], KafkaProducer.DEFAULT_CONFIG))
        return KafkaProducer(**self.url.client_kwargs(), **kw)

    def consumer(self, kinds, *, group: str | None, **overrides):
        """A consumer of ``kinds`` topics; in ``group`` (subscribed, offsets committed
        by the caller) or, with ``group=None``, unassigned for the caller to assign."""
        from kafka import KafkaConsumer

        kw = {
            "group_id": group,
            "enable_auto_commit": False,
            "auto_offset_reset": "earliest",
            "max_poll_records": 5000,
            "fetch_max_bytes": 64 << 20,
            "max_partition_fetch_bytes": 16 << 20,
            "reconnect_backoff_max_ms": 1000,
        }
        kw.update(overrides)
        consumer = KafkaConsumer(**self.url.client_kwargs(), **kw)
        if group is not None and kinds:
            consumer.subscribe([self.topic(k) for k in kinds])
        return consumer
