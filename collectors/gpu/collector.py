"""GPU health collector: samples every GPU of a host through NVML on its own thread.

Faulty GPUs and their memory cause about half of the unexpected interruptions
in published large-scale training reports, and NVML sees most of them before
the job dies: XIDs, uncorrected ECC errors, failed row remaps, thermal and
power throttling. This collector turns those readings into ``gpu`` records
(trace format v1) once per ``interval_s`` and as soon as a critical XID
arrives.

It never affects training: all NVML work happens on a daemon thread; records
leave through a bounded, never-blocking sender; no driver or no GPU (or a
driver that vanishes mid-run) gives one clear log notice and the collector
goes idle. Between samples the thread waits on an NVML event set with a short
timeout, so an XID is reported within a fraction of a second and ``close()``
returns promptly.

Error counters (ECC, row remapping, PCIe replays, NVLink) change rarely and
cost the most calls (NVLink: four per active link), so they are read every
``counters_interval_s`` and the last values read are repeated in the records
in between.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from rankscope.collectors.gpu.nvml import GpuLost, NvmlBackend, NvmlUnavailable
from rankscope.collectors.schema.records import GpuRecord
from rankscope.collectors.sinks.factory import make_sink
from rankscope.collectors.sinks.sender import Sender

__all__ = ["GpuCollector", "GpuCollectorConfig", "GpuCollectorStats"]

log = logging.getLogger("rankscope.collectors")


@dataclass(kw_only=True, slots=True)
class GpuCollectorConfig:
    """How often the GPU collector samples, and how its sender is sized."""

    interval_s: float = 1.0
    """Seconds between two samples of every GPU."""
    counters_interval_s: float = 5.0
    """Seconds between reads of the error counters (ECC, remap, PCIe replay, NVLink)."""
    event_wait_s: float = 0.2
    """Longest single wait on the XID event set; bounds how fast ``close()`` returns."""
    queue_size: int = 1024
    """Records held for the sender when it owns one; the oldest are dropped when full."""
    batch_max_records: int = 256
    """At most this many records per ``sink.send``."""
    flush_interval_s: float = 1.0
    """The sender flushes its sink at least this often while records flow."""
    close_timeout_s: float = 2.0
    """How long ``close()`` waits for the thread and the sender."""

    def __post_init__(self) -> None:
        for name in ("interval_s", "counters_interval_s", "event_wait_s", "flush_interval_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and value > 0):
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        if self.counters_interval_s < self.interval_s:
            raise ValueError(
                f"counters_interval_s ({self.counters_interval_s}) must be >= "
                f"interval_s ({self.interval_s})"
            )
        if self.queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {self.queue_size!r}")
        if self.batch_max_records < 1:
            raise ValueError(f"batch_max_records must be >= 1, got {self.batch_max_records!r}")
        if self.close_timeout_s < 0:
            raise ValueError(f"close_timeout_s must be >= 0, got {self.close_timeout_s!r}")


@dataclass(slots=True)
class GpuCollectorStats:
    """What the collector did; read by tests, benchmarks and the sidecar's exit line."""

    samples: int = 0
    records: int = 0
    xids: int = 0
    lost_gpus: list[int] = field(default_factory=list)
    errors: int = 0


class GpuCollector:
    """Samples GPUs on a daemon thread and emits ``gpu`` records.

    ``devices``: GPUs to sample, as NVML indices or UUIDs (a UUID prefix, as
    ``CUDA_VISIBLE_DEVICES`` allows); None: every GPU of the host.
    ``rank_map``: NVML index -> global rank using it, stamped as ``rank``;
    ``rank``: one rank stamped on every sampled GPU (a rank sampling its own).
    Records go to ``sink`` (a URL or sink object, through a private bounded
    ``Sender``) or, when ``sender`` is given, into that existing sender (the
    rank collector's, so both share one queue and one file).
    ``nvml``: the pynvml module or a fake with the same function names.
    """

    def __init__(
        self,
        job: str,
        sink: Any = None,
        *,
        host: str | None = None,
        devices: list[int | str] | None = None,
        rank_map: dict[int, int] | None = None,
        rank: int | None = None,
        config: GpuCollectorConfig | None = None,
        nvml: Any = None,
        sender: Any = None,
    ) -> None:
        if not job:
            raise ValueError("job must be a non-empty string")
        if (sink is None) == (sender is None):
            raise ValueError("give exactly one of sink (URL or object) and sender")
        self.job = job
        self.host = host or socket.gethostname()
        self.cfg = config or GpuCollectorConfig()
        self.rank_map = {int(k): int(v) for k, v in (rank_map or {}).items()}
        self.rank = rank
        self._want = (
            None
            if devices is None
            else [d if isinstance(d, str) and not d.isdigit() else int(d) for d in devices]
        )
        self._backend = NvmlBackend(nvml)
        self._own_sender = sender is None
        if sender is None:
            sender = Sender(
                make_sink(sink),
                queue_size=self.cfg.queue_size,
                batch_max_records=self.cfg.batch_max_records,
                flush_interval_s=self.cfg.flush_interval_s,
                name="rankscope-gpu-sender",
            )
        self._sender = sender
        self._stop = threading.Event()
        self.ready = threading.Event()  # set once NVML opened (or failed to)
        self.notice: str | None = None  # why the collector is idle, when it is
        self.stats = GpuCollectorStats()
        self.devices: list[int] = []
        self.driver_version: str | None = None
        self._infos: dict[int, Any] = {}
        self._watching = False
        self._pending_xids: dict[int, list[int]] = {}
        self._counters: dict[int, dict] = {}
        self._counters_due = 0.0
        self._thread: threading.Thread | None = None

    # -- public ------------------------------------------------------------------

    def start(self) -> GpuCollector:
        """Start the sampling thread; returns at once (NVML opens on the thread)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rankscope-gpu", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop sampling, release NVML and drain the private sender; never raises."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.cfg.close_timeout_s)
        if self._own_sender:
            try:
                self._sender.close(self.cfg.close_timeout_s)
            except Exception as exc:  # noqa: BLE001 - close must not raise into training
                log.warning("rankscope gpu collector: closing the sender failed: %s", exc)

    @property
    def idle(self) -> bool:
        """True when the collector gave up (no driver, no GPU, driver gone)."""
        return self.notice is not None

    def open(self) -> bool:
        """Open NVML and pick the devices; False (with ``notice`` set) when there is nothing."""
        try:
            infos = self._backend.open()
        except NvmlUnavailable as exc:
            return self._go_idle(f"no usable NVIDIA driver ({exc})")
        self.driver_version = self._backend.driver_version()
        self._infos = {i.index: i for i in infos}
        wanted = list(self._infos) if self._want is None else [self._resolve(d) for d in self._want]
        unknown = [
            w for w, d in zip(self._want or [], wanted, strict=False) if d not in self._infos
        ]
        if unknown:
            log.warning(
                "rankscope gpu collector: GPU(s) %s not on this host (it has %d)",
                unknown,
                len(infos),
            )
        self.devices = [d for d in wanted if d in self._infos]
        if not self.devices:
            return self._go_idle("no GPU to sample on this host")
        try:
            watched = self._backend.watch_xids(self.devices)
        except NvmlUnavailable as exc:
            return self._go_idle(f"NVIDIA driver went away ({exc})")
        self._watching = bool(watched)
        if len(watched) < len(self.devices):
            log.info(
                "rankscope gpu collector: XID events not available on GPU(s) %s",
                sorted(set(self.devices) - set(watched)),
            )
        return True

    def _resolve(self, selector: int | str) -> int | None:
        """NVML index of a selector: an index, or a UUID (prefix) as CUDA accepts."""
        if isinstance(selector, int):
            return selector
        hits = [
            i for i, info in self._infos.items() if info.uuid and info.uuid.startswith(selector)
        ]
        return hits[0] if len(hits) == 1 else None

    def collect(self, now: float | None = None) -> list[dict]:
        """Sample every device once and return the ``gpu`` records (also used by tests).

        Raises ``NvmlUnavailable`` when the driver went away; a lost GPU is
        dropped from ``devices`` with a notice and the others are still read.
        """
        now = time.time() if now is None else now
        mono = time.monotonic()
        read_counters = mono >= self._counters_due
        if read_counters:
            self._counters_due = mono + self.cfg.counters_interval_s
        out = []
        for index in list(self.devices):
            try:
                fast = self._backend.read_fast(index)
                if read_counters or index not in self._counters:
                    self._counters[index] = self._backend.read_counters(index)
            except GpuLost as exc:
                self._lose(index, exc)
                continue
            info = self._infos[index]
            rec = GpuRecord(
                job=self.job,
                host=self.host,
                gpu=index,
                t=now,
                rank=self.rank if self.rank is not None else self.rank_map.get(index),
                xid=self._pending_xids.pop(index, None),
                **fast,
                **self._counters[index],
            ).to_dict()
            # Extra fields (the format allows them): the GPU's own thresholds
            # let the health detector judge temperature without guessing.
            if info.temp_slowdown_c is not None:
                rec["temp_slowdown_c"] = info.temp_slowdown_c
            if info.temp_shutdown_c is not None:
                rec["temp_shutdown_c"] = info.temp_shutdown_c
            out.append(rec)
        self.stats.samples += 1
        return out

    # -- thread ------------------------------------------------------------------

    def _go_idle(self, reason: str) -> bool:
        if self.notice is None:
            self.notice = reason
            log.warning(
                "rankscope gpu collector: %s; GPU telemetry is off, training goes on", reason
            )
        return False

    def _lose(self, index: int, exc: BaseException) -> None:
        if index in self.devices:
            self.devices.remove(index)
            self.stats.lost_gpus.append(index)
            self._pending_xids.pop(index, None)  # nowhere to report them any more
            log.warning("rankscope gpu collector: %s; no longer sampling it", exc)
        if not self.devices:
            self._go_idle("every sampled GPU is lost")

    def _emit(self, records: list[dict]) -> None:
        for rec in records:
            self._sender.put(rec)
        self.stats.records += len(records)

    def _wait(self, seconds: float) -> bool:
        """Wait up to ``seconds``, collecting XIDs; True when one arrived."""
        if not self._watching:
            self._stop.wait(seconds)
            return False
        t0 = time.monotonic()
        events = self._backend.wait_xids(max(1, int(seconds * 1000)))
        if not events and time.monotonic() - t0 < seconds / 2:
            # A driver whose wait returns at once must not turn this into a busy loop.
            self._stop.wait(seconds - (time.monotonic() - t0))
        got = False
        for index, xid in events:
            if index not in self.devices and len(self.devices) == 1:
                index = self.devices[0]  # NVML could not name the GPU; only one is watched
            if index not in self.devices:
                log.warning("rankscope gpu collector: XID %d on an unidentified GPU", xid)
                continue
            self._pending_xids.setdefault(index, []).append(xid)
            self.stats.xids += 1
            got = True
        return got

    def _loop(self) -> None:
        next_due = time.monotonic()
        while not self._stop.is_set() and self.devices:
            now = time.monotonic()
            if now >= next_due or self._pending_xids:
                self._emit(self.collect())
                next_due = max(next_due + self.cfg.interval_s, now + self.cfg.interval_s / 2)
                continue
            try:
                self._wait(min(next_due - now, self.cfg.event_wait_s))
            except GpuLost:
                # The event set cannot say which GPU; the next read finds out.
                self._watching = False

    def _run(self) -> None:
        try:
            ok = self.open()
        except Exception as exc:  # noqa: BLE001 - a surprise must not escape the thread
            ok = self._go_idle(f"NVML failed to open ({type(exc).__name__}: {exc})")
        self.ready.set()
        try:
            if ok:
                self._loop()
        except NvmlUnavailable as exc:
            self._go_idle(f"NVIDIA driver went away mid-run ({exc})")
        except Exception as exc:  # noqa: BLE001
            self.stats.errors += 1
            self._go_idle(f"GPU sampling failed ({type(exc).__name__}: {exc})")
        finally:
            self._backend.close()
