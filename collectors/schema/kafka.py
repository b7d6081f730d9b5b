"""What a ``kafka://`` URL means, in one place for the sink, the bus and the service.

``kafka://host1:9092,host2:9092?acks=all&linger_ms=20&topic_prefix=rankscope``

- the netloc is the bootstrap server list; ``user:password@`` in front of it
  sets SASL/PLAIN-style credentials (``sasl_plain_username`` / ``_password``);
- ``topic_prefix`` (default ``rankscope``) names the topics
  ``<prefix>.telemetry``, ``.gpu``, ``.findings``, ``.control``, ``.deadletter``;
- the client options in ``PASSTHROUGH`` (security protocol, SASL mechanism,
  SSL files, client id, ...) go to kafka-python unchanged; each may also come
  from the environment as ``RANKSCOPE_KAFKA_<NAME>`` (e.g.
  ``RANKSCOPE_KAFKA_SASL_PLAIN_PASSWORD``) so secrets stay out of command lines;
- any other query key is kept in ``options`` for the component that reads the
  URL (the sink reads ``acks``, ``linger_ms``, ``compression``,
  ``buffer_records``; the service reads ``group``, ``partitions``).

Unknown keys are not errors here: each component checks the keys it owns.
This module imports only the standard library so a training process pays
nothing for it until it really uses Kafka.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, unquote, urlsplit

__all__ = [
    "KafkaUrl",
    "TOPIC_KINDS",
    "PASSTHROUGH",
    "topic_for_record",
    "idempotence_kwargs",
    "is_slow_client_loop",
]

TOPIC_KINDS = ("telemetry", "gpu", "findings", "control", "deadletter")

# kafka-python client settings that a cluster's security setup needs; they pass
# through to producers, consumers and the admin client alike.
PASSTHROUGH = {
    "security_protocol": str,
    "sasl_mechanism": str,
    "sasl_plain_username": str,
    "sasl_plain_password": str,
    "sasl_kerberos_service_name": str,
    "sasl_kerberos_domain_name": str,
    "ssl_cafile": str,
    "ssl_certfile": str,
    "ssl_keyfile": str,
    "ssl_password": str,
    "ssl_crlfile": str,
    "ssl_ciphers": str,
    "ssl_check_hostname": bool,
    "client_id": str,
    "request_timeout_ms": int,
    "api_version": str,
}

# kafka-python 3 warns when one step of its event loop took over 0.1 s. Beside a busy
# training loop or the service's detectors (one process, one GIL) that is load, not a
# client fault, and its guess ("a tight sync loop inside a coroutine") misleads.
SLOW_LOOP_MARK = "threshold). It is blocking the event loop"
SLOW_LOOP_LOGGER = "kafka.net.selector"


def is_slow_client_loop(record: logging.LogRecord) -> bool:
    """The record is kafka-python's slow event-loop warning."""
    return record.name.startswith("kafka") and SLOW_LOOP_MARK in record.getMessage()


_HOSTPORT = re.compile(r"^[A-Za-z0-9_.\-]+:\d{1,5}$|^\[[0-9A-Fa-f:]+\]:\d{1,5}$")
_PREFIX = re.compile(r"^[A-Za-z0-9._\-]{1,200}$")


def _convert(name: str, kind: type, raw: str):
    if kind is bool:
        low = raw.strip().lower()
        if low not in ("1", "0", "true", "false", "yes", "no"):
            raise ValueError(f"kafka URL: {name}={raw!r} is not a boolean")
        return low in ("1", "true", "yes")
    if kind is int:
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"kafka URL: {name}={raw!r} is not an integer") from None
    if name == "api_version":
        try:
            return tuple(int(p) for p in raw.split("."))
        except ValueError:
            raise ValueError(f"kafka URL: api_version={raw!r} is not like 2.8.0") from None
    return raw


@dataclass(kw_only=True, slots=True)
class KafkaUrl:
    """A parsed ``kafka://`` URL."""

    bootstrap: list[str]
    """``host:port`` strings, at least one."""
    topic_prefix: str = "rankscope"
    """Topics are ``<prefix>.<kind>``; a prefix per test or per tenant keeps them apart."""
    client: dict = field(default_factory=dict)
    """kafka-python keyword arguments shared by every client (security, client id)."""
    options: dict[str, str] = field(default_factory=dict)
    """The remaining query keys, raw strings, for the component reading the URL."""

    def __post_init__(self) -> None:
        if not self.bootstrap:
            raise ValueError("kafka URL: no bootstrap server (want kafka://host:port[,host:port])")
        for hp in self.bootstrap:
            if not _HOSTPORT.match(hp):
                raise ValueError(f"kafka URL: bootstrap server {hp!r} is not host:port")
        if not _PREFIX.match(self.topic_prefix):
            raise ValueError(f"kafka URL: topic_prefix {self.topic_prefix!r} has odd characters")

    @classmethod
    def parse(cls, url: str, *, env: dict[str, str] | None = None) -> KafkaUrl:
        env = os.environ if env is None else env
        parts = urlsplit(url)
        if parts.scheme != "kafka":
            raise ValueError(f"not a kafka:// URL: {url!r}")
        netloc = parts.netloc
        client: dict = {}
        if "@" in netloc:
            userinfo, netloc = netloc.rsplit("@", 1)
            user, _, password = userinfo.partition(":")
            client["sasl_plain_username"] = unquote(user)
            if password:
                client["sasl_plain_password"] = unquote(password)
        bootstrap = [hp.strip() for hp in netloc.split(",") if hp.strip()]
        for name, kind in PASSTHROUGH.items():
            raw = env.get(f"RANKSCOPE_KAFKA_{name.upper()}")
            if raw is not None:
                client[name] = _convert(name, kind, raw)
        options: dict[str, str] = {}
        prefix = "rankscope"
        for key, value in parse_qsl(parts.query, keep_blank_values=True):
            if key in PASSTHROUGH:
                client[key] = _convert(key, PASSTHROUGH[key], value)
            elif key == "topic_prefix":
                prefix = value
            else:
                options[key] = value
        return cls(bootstrap=bootstrap, topic_prefix=prefix, client=client, options=options)

    def topic(self, kind: str) -> str:
        if kind not in TOPIC_KINDS:
            raise ValueError(f"unknown topic kind {kind!r}; known: {', '.join(TOPIC_KINDS)}")
        return f"{self.topic_prefix}.{kind}"

    def client_kwargs(self) -> dict:
        """Keyword arguments every kafka-python client of this URL gets."""
        return {"bootstrap_servers": list(self.bootstrap), **self.client}

    def option(self, key: str, default, kind: type = str):
        """A component's own query option, converted, with a clear error when malformed."""
        raw = self.options.get(key)
        return default if raw is None else _convert(key, kind, raw)

    def redacted(self) -> str:
        """The URL for logs: servers and prefix, never credentials."""
        return f"kafka://{','.join(self.bootstrap)}?topic_prefix={self.topic_prefix}"


def topic_for_record(record: dict) -> str:
    """Topic kind of a record: ``gpu`` samples apart, everything else is telemetry."""
    return "gpu" if record.get("type") == "gpu" else "telemetry"


def idempotence_kwargs(acks, client_defaults: dict) -> dict:
    """``enable_idempotence=False`` for a producer asked for ``acks`` other than ``all``.

    kafka-python 3 turns the idempotent producer on by default (KIP-679); it needs
    ``acks=all``, so a producer asked for ``acks=1`` (ours, for throughput) turns it
    off again and says so at WARNING at every start. Delivery here is at least once
    by design (findings upserted by id, control messages dropped as replays by their
    receivers, records of built steps dropped as late), so the producer's own dedup
    adds nothing: saying so removes the warning. ``client_defaults`` is the client's
    ``KafkaProducer.DEFAULT_CONFIG`` (older clients have no such setting)."""
    if acks in ("all", -1) or "enable_idempotence" not in client_defaults:
        return {}
    return {"enable_idempotence": False}


COMPRESSIONS = ("lz4", "gzip", "zstd", "snappy", "none")
"""Batch codecs a producer may be asked for (URL option ``compression``)."""

DEFAULT_COMPRESSION = "lz4"
"""lz4: telemetry JSON shrinks about 3x at 450-650 MB/s a core, so the sink costs the
training process little and ``serve``'s client copies a third of the bytes (on the
live bench, 1.1-1.4x the records a second of uncompressed messages; gzip at
kafka-python's level 9 compresses 20-30x slower, 20 MB/s)."""

_said_codec: set[str] = set()


def compression_type(name: str) -> str | None:
    """kafka-python's ``compression_type`` for codec ``name`` (None for ``none``). A codec
    whose Python package is missing falls back to gzip (the standard library has it),
    said once at WARNING: records keep flowing, a little slower."""
    if name not in COMPRESSIONS:
        raise ValueError(f"kafka URL: compression={name!r}; want one of {list(COMPRESSIONS)}")
    if name in ("none", "gzip"):
        return None if name == "none" else name
    from kafka import codec  # only when a producer is really made

    if getattr(codec, f"has_{name}")():
        return name
    if name not in _said_codec:
        _said_codec.add(name)
        logging.getLogger("rankscope.kafka").warning(
            "kafka: compression %s needs its Python package (not installed); using gzip", name
        )
    return "gzip"
