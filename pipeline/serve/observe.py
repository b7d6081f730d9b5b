"""What ``serve`` tells its operator: log lines, metrics, alerts, from a few calls.

The loop calls ``ServeObserver`` at four points: ``start`` (after setup),
``assigned``/``revoked`` (a rebalance), ``found`` (findings out of the engine)
and ``turn`` (each loop turn); the writer calls ``action_sent`` after it
publishes a control message. On the hot path that is one comparison a turn
and one dict lookup per finding update; the progress line, the metrics'
snapshot of lag and open incidents (once a second) and every formatting
happen off it. The endpoint and the webhooks run on their own threads
(``metrics``, ``alerts``).
"""

from __future__ import annotations

import logging
import time

from rankscope.pipeline.serve.alerts import ALERT_ACTIONS
from rankscope.pipeline.serve.logs import event

__all__ = ["ServeObserver", "action_sent", "log_summary"]

log = logging.getLogger("rankscope.serve")
SNAPSHOT_S = 1.0
"""How often the lag and open-incident counts are refreshed for metrics and progress."""


def _tps(tps) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for tp in sorted(tps, key=lambda tp: (tp.topic, tp.partition)):
        out.setdefault(tp.topic, []).append(tp.partition)
    return out


class ServeObserver:
    """Logs, metrics and alerts of one ``Service`` (see the module docstring)."""

    def __init__(self, cfg, stats) -> None:
        self.cfg, self.stats = cfg, stats
        self.alerts = None
        self.metrics = None
        self.lag: dict[tuple[str, int], int | None] = {}
        self.open_incidents = 0
        self._actions: dict[str, str] = {}  # finding id -> action last seen
        self.failures = 0  # of this observer's own work (logged, the first few)
        now = time.monotonic()
        self._next_snapshot = now
        self._next_progress = now + (cfg.progress_interval_s or 0.0)
        self._last = (now, 0)  # (monotonic, records) at the last progress line

    # -- start and stop -------------------------------------------------------
    def start(self, bus: str, topics: list[str], db) -> None:
        """Start the endpoint and the webhooks (``db``: the ``ServeDb`` holding the alert
        ledger), then say what this process serves (``bus``: the redacted URL)."""
        cfg = self.cfg
        with db.session() as s:  # a restart does not log, count or page these again
            self._actions.update(s.tables.stored_actions())
        if cfg.alerts is not None:
            from rankscope.pipeline.serve.alert_ledger import AlertLedger
            from rankscope.pipeline.serve.alerts import AlertSender

            ledger = AlertLedger(db)
            self.alerts = AlertSender(cfg.alerts, delivered=ledger.delivered(), mark=ledger.mark)
        metrics = None
        if cfg.metrics_port is not None:
            from rankscope.pipeline.serve.metrics import MetricsEndpoint

            self.metrics = MetricsEndpoint(cfg.metrics_host, cfg.metrics_port, self,
                                           group=cfg.group)  # fmt: skip
            metrics = f"http://{cfg.metrics_host}:{self.metrics.port}/metrics"
        hooks = len(cfg.alerts.urls) if cfg.alerts else 0
        event(log, "start",
              "serving %s as group %s into %s; metrics %s; %d alert webhook(s); control %s",
              bus, cfg.group, cfg.db_path, metrics or "off", hooks,
              "on" if cfg.control_secret is not None else "off",
              bus=bus, group=cfg.group, store=cfg.db_path, topics=topics,
              metrics=metrics, alert_webhooks=hooks, control=cfg.control_secret is not None,
              progress_interval_s=cfg.progress_interval_s)  # fmt: skip

    def close(self) -> None:
        """Deliver queued alerts (bounded by ``drain_s``), stop the endpoint."""
        if self.alerts is not None:
            self.alerts.close()
        if self.metrics is not None:
            self.metrics.close()

    # -- rebalances ---------------------------------------------------------
    def assigned(self, tps) -> None:
        owned = _tps(tps)
        event(log, "assigned", "partitions owned: %s",
              "; ".join(f"{t} {p}" for t, p in owned.items()) or "none",
              partitions=sorted({tp.partition for tp in tps}), topics=owned)  # fmt: skip

    def revoked(self, tps) -> None:
        if tps:
            event(log, "revoked", "partitions revoked: %s",
                  "; ".join(f"{t} {p}" for t, p in _tps(tps).items()),
                  partitions=sorted({tp.partition for tp in tps}))  # fmt: skip

    # -- findings and dead letters ----------------------------------------------
    def dead(self, tp, offset: int, index: int, reason: str) -> None:
        self.stats.dead_letter(reason, index)
        event(log, "dead_letter", "dead letter %s[%d]@%d#%d: %s", tp.topic, tp.partition,
              offset, index, reason, level=logging.WARNING, topic=tp.topic,
              partition=tp.partition, offset=offset, index=index, reason=reason)  # fmt: skip

    def found(self, part, findings) -> None:
        """New findings and changed actions: counted, logged, alerted (the rest pass; a
        finding already in the store at start is not new, so a restart pages nobody).
        A failure here is logged, never raised into the loop (the findings are stored)."""
        try:
            self._found(part, findings)
        except Exception:
            self.failures += 1
            if self.failures <= 3:
                log.exception("logging, counting or alerting findings failed (serve goes on)")

    def _found(self, part, findings) -> None:
        actions = self._actions
        for f in findings:
            prev = actions.get(f.finding_id)
            if prev == f.action:
                continue  # a re-report: the incident grew
            actions[f.finding_id] = f.action
            key = (f.kind, f.action)
            self.stats.findings_by[key] = self.stats.findings_by.get(key, 0) + 1
            if prev is None:
                self._new(part, f)
            else:
                event(log, "escalated", "finding %s %s: %s -> %s (ranks %s, job %s)",
                      f.finding_id, f.kind, prev, f.action, f.ranks, f.job,
                      level=logging.WARNING if f.action in ALERT_ACTIONS else logging.INFO,
                      **_fields(f), previous_action=prev)  # fmt: skip
            if self.alerts is not None and f.action in ALERT_ACTIONS:
                self.alerts.offer(f.to_dict())

    def _new(self, part, f) -> None:
        now = time.time()
        stats = self.stats
        arrived = part.arrival.get((f.job, f.detected_step))
        if arrived is not None:  # from the step's last record to its finding
            stats.detect_latency_s.append(max(0.0, now - arrived))
            stats.finding_latency_s.observe(max(0.0, now - arrived))
        stats.record_to_finding_s.observe(now - f.detected_t)
        stats.observe_delay(f.kind, f.detected_step - f.first_step)
        hosts = ",".join(map(str, f.hosts)) or "?"
        event(log, "finding", "finding %s: %s on ranks %s (hosts %s) of job %s from step %d, "
              "detected at step %d, action %s, score %.2f", f.finding_id, f.kind, f.ranks, hosts,
              f.job, f.first_step, f.detected_step, f.action, f.score,
              level=logging.WARNING if f.action in ALERT_ACTIONS else logging.INFO,
              **_fields(f))  # fmt: skip

    # -- each turn ------------------------------------------------------------
    def turn(self, lag: dict, parts: dict) -> None:
        """Refresh the snapshot once a second; a progress line when one is due.
        ``lag``: the aligner's (topic, partition) -> messages; ``parts``: number -> state."""
        mono = time.monotonic()
        if mono < self._next_snapshot:
            return
        self._next_snapshot = mono + SNAPSHOT_S
        self.lag = dict(lag)
        try:
            total = 0
            for part in list(parts.values()):
                eng = part.engine
                total += sum(eng.stats(job).get("open_incidents", 0) for job in eng.jobs)
            self.open_incidents = total
        except Exception:  # a number on a progress line must not stop serve
            self.failures += 1
            if self.failures <= 3:
                log.exception("counting open incidents failed (serve goes on)")
        if self.cfg.progress_interval_s is not None and mono >= self._next_progress:
            self._next_progress = mono + self.cfg.progress_interval_s
            self.progress(mono)

    def progress(self, mono: float) -> None:
        st = self.stats
        t0, r0 = self._last
        self._last = (mono, st.records)
        rate = (st.records - r0) / (mono - t0) if mono > t0 else 0.0
        lag = {f"{t}:{p}": n for (t, p), n in sorted(self.lag.items()) if n is not None}
        alerts = self.alert_totals()
        event(log, "progress", "progress: %s records/s (%s in all), lag %d messages, "
              "%d open incidents, %d findings, %d dead letters, %d control messages%s",
              f"{rate:,.0f}", f"{st.records:,}", sum(lag.values()), self.open_incidents,
              len(self._actions), st.deadletters, st.control_sent,
              "" if alerts is None else ", alerts {sent} sent {failed} failed {dropped} "
              "dropped {queued} queued".format(**alerts),
              records_per_s=round(rate, 1), records=st.records, messages=st.messages,
              lag_messages=sum(lag.values()), lag=lag, open_incidents=self.open_incidents,
              findings=len(self._actions), finding_updates=st.findings,
              dead_letters=st.deadletters, control_sent=st.control_sent,
              engine_errors=st.engine_errors, alerts=alerts)  # fmt: skip

    def alert_totals(self) -> dict | None:
        if self.alerts is None:
            return None
        out = {"sent": 0, "failed": 0, "dropped": 0, "queued": 0, "retries": 0}
        for c in self.alerts.counts():
            for k in out:
                out[k] += c[k]
        return out


def _fields(f) -> dict:
    return {"finding_id": f.finding_id, "job": f.job, "kind": f.kind,
            "ranks": [int(r) for r in f.ranks], "hosts": [str(h) for h in f.hosts],
            "first_step": int(f.first_step), "detected_step": int(f.detected_step),
            "action": f.action, "score": float(f.score), "detector": f.detector}  # fmt: skip


def action_sent(stats, msg: dict, topic: str) -> None:
    """After the writer published control message ``msg`` (its writer-thread hook)."""
    stats.sent_control(msg["action"])
    event(log, "action", "action sent: %s ranks %s (hosts %s) of job %s from step %d "
          "(finding %s) on %s", msg["action"], msg["ranks"], ",".join(msg["hosts"]) or "-",
          msg["job"],
          msg["step"], msg["finding_id"], topic, level=logging.WARNING, job=msg["job"],
          action=msg["action"], ranks=msg["ranks"], hosts=msg["hosts"], step=msg["step"],
          finding_id=msg["finding_id"], topic=topic)  # fmt: skip


def log_summary(stats) -> None:
    """The line ``serve`` ends with."""
    event(log, "summary", "rankscope serve: %s", stats.summary(), records=stats.records,
          messages=stats.messages, seconds=round(stats.seconds, 3),
          finding_updates=stats.findings, control_sent=stats.control_sent,
          dead_letters=stats.deadletters, checkpoints=stats.checkpoints,
          engine_errors=stats.engine_errors,
          partition_records={str(k): v for k, v in sorted(stats.partition_records.items())})
