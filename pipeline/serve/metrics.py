"""``serve``'s Prometheus endpoint: the service's counters, read when scraped.

One collector with one method, ``collect()`` (prometheus client_python's own
pattern for state that lives elsewhere): the loop and the writer bump plain
integers in ``ServeStats`` and fill ``histogram.Buckets``; nothing here runs
until a scrape, on the endpoint's thread, which copies the dicts (a C-level
copy under the GIL) and the snapshot the loop refreshes once a second
(consumer lag, open incidents). Every name and label is listed in
docs/kafka.md ("Metrics"), with example alert rules. Each ``serve`` has its own
registry (no module-level state shared between instances or tests).
"""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.utils import floatToGoString

__all__ = ["MetricsEndpoint", "ServeCollector"]

P = "rankscope_"


def _histogram(name: str, doc: str, label: str | None, hists: dict) -> HistogramMetricFamily:
    fam = HistogramMetricFamily(P + name, doc, labels=[label] if label else [])
    for value, hist in sorted(hists.items()):
        buckets, total, _count = hist.snapshot()
        le = [("+Inf" if math.isinf(b) else floatToGoString(b), n) for b, n in buckets]
        fam.add_metric([value] if label else [], le, sum_value=total)
    return fam


def _counter(name: str, doc: str, labels: list[str], values: dict) -> CounterMetricFamily:
    fam = CounterMetricFamily(P + name, doc, labels=labels)
    for key, n in sorted(values.items()):
        fam.add_metric([str(k) for k in (key if isinstance(key, tuple) else (key,))], n)
    return fam


class ServeCollector:
    """Reads one ``serve``'s ``ServeStats`` and ``ServeObserver`` snapshot."""

    def __init__(self, observer, *, group: str) -> None:
        self._obs = observer
        self._group = group

    def collect(self):
        obs, st = self._obs, self._obs.stats
        info = GaugeMetricFamily(P + "serve_info", "This serve process (value 1).",
                                 labels=["group"])  # fmt: skip
        info.add_metric([self._group], 1)
        yield info
        yield CounterMetricFamily(P + "messages", "Kafka messages read.", value=st.messages)
        yield _counter("records", "Records fed to the engine, by topic, partition and path "
                       "(columns: decoded straight to columns; records: one by one).",
                       ["topic", "partition", "path"], dict(st.records_in))  # fmt: skip
        lag = GaugeMetricFamily(P + "consumer_lag_messages",
                                "Messages not read yet, up to the last fetch's high watermark.",
                                labels=["topic", "partition"])  # fmt: skip
        for (topic, part), n in sorted(obs.lag.items()):
            if n is not None:
                lag.add_metric([topic, str(part)], n)
        yield lag
        yield _counter("dead_letters", "Messages and records sent to the dead-letter topic, "
                       "by reason class.", ["reason"], dict(st.dead_by_reason))  # fmt: skip
        yield _counter("findings", "New findings, once per finding and action it reached "
                       "(an escalation counts again; findings stored before start do not).",
                       ["kind", "action"], dict(st.findings_by))  # fmt: skip
        yield CounterMetricFamily(P + "finding_updates", "Finding updates stored (an incident "
                                  "that grows is updated every step).", value=st.findings)
        yield GaugeMetricFamily(P + "open_incidents", "Incidents open in this process's engines.",
                                value=obs.open_incidents)  # fmt: skip
        yield _counter("control_messages", "Signed evict/recover messages published.",
                       ["action"], dict(st.control_by_action))  # fmt: skip
        yield CounterMetricFamily(P + "checkpoints", "Checkpoints handed to the writer.",
                                  value=st.checkpoints)  # fmt: skip
        yield CounterMetricFamily(P + "engine_errors", "Steps or engine outputs dropped because "
                                  "the engine raised.", value=st.engine_errors)
        yield _histogram("finding_latency_seconds", "From the arrival of the last record of a "
                         "finding's detected step to the finding.", None,
                         {"": st.finding_latency_s})  # fmt: skip
        yield _histogram("record_to_finding_seconds", "From the record time of a finding's "
                         "detected step (the trainer's clock) to the finding.", None,
                         {"": st.record_to_finding_s})  # fmt: skip
        yield _histogram("detection_delay_steps", "Steps from an incident's onset (first step) "
                         "to its detection, by kind.", "kind", dict(st.delay_steps))
        yield _histogram("store_write_seconds", "How long one DuckDB write took (turn: findings "
                         "and dead letters; checkpoint: also engine state).", "what",
                         dict(st.write_s))  # fmt: skip
        yield from self._alerts()

    def _alerts(self):
        counts = self._obs.alerts.counts() if self._obs.alerts is not None else []
        for name, key, doc in (
            ("alerts_sent", "sent", "Alerts a webhook answered with 2xx."),
            ("alerts_failed", "failed", "Alerts given up after every try or a 4xx."),
            ("alert_retries", "retries", "Tries after a failed one."),
            ("alerts_dropped", "dropped", "Alerts dropped because the webhook's queue was full."),
        ):
            yield _counter(name, doc, ["webhook"], {c["webhook"]: c[key] for c in counts})
        queued = GaugeMetricFamily(P + "alerts_queued", "Alerts waiting for a webhook.",
                                   labels=["webhook"])  # fmt: skip
        for c in counts:
            queued.add_metric([c["webhook"]], c["queued"])
        yield queued


class MetricsEndpoint:
    """``GET /metrics`` on ``host:port`` (port 0: any free one, see ``port``)."""

    def __init__(self, host: str, port: int, observer, *, group: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(ServeCollector(observer, group=group))
        ProcessCollector(registry=self.registry)  # CPU, memory, open files of serve
        try:
            self._server, self._thread = start_http_server(port, host, registry=self.registry)
        except OSError as exc:
            raise ValueError(f"metrics endpoint on {host}:{port}: {exc}") from None
        self.port = self._server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
