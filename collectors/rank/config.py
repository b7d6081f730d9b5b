"""The rank collector's settings: one dataclass, defaults in one place only."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["CollectorConfig"]


@dataclass(kw_only=True, slots=True)
class CollectorConfig:
    """How the rank collector behaves inside a training process.

    Every knob trades telemetry fidelity for cost on the training thread or
    memory; none of them can make the collector block training.
    """

    beat_interval_s: float = 1.0
    """Seconds between progress beats (also sent while the training thread is blocked)."""
    queue_size: int = 4096
    """Records held for the background sender; when full the oldest are dropped and counted."""
    batch_max_records: int = 512
    """At most this many records per ``sink.send`` call."""
    send_interval_s: float = 0.2
    """The sender wakes this often (or when half a batch is queued) rather than per
    record: batching keeps it from taking the GIL from the training thread every step."""
    flush_interval_s: float = 1.0
    """The sender calls ``sink.flush()`` at least this often while records flow."""
    close_timeout_s: float = 5.0
    """How long ``close()`` waits for the sender to drain before giving up (a stalled sink)."""
    digest_every_steps: int = 1
    """Compute ``param_digest`` every this many steps (1 = every step; 0 = never)."""
    digest_in_background: bool | None = None
    """Compute the digest on a worker thread between the optimizer step and the next one
    (True), or on the training thread at the step boundary (False). None (default): the
    worker when a parameter lives on an accelerator (the read is kernels the worker
    queues), inline when all are on CPU: the read is CPU work wherever it runs, and on a
    host whose cores training fills, a Python worker only adds GIL hand-offs (measured:
    docs/collectors.md). A worker job not started by the next optimizer step is taken
    over by the training thread. Loops that change parameters through ``.data`` between
    steps, which the worker cannot notice, set False."""
    ddp_group_name: str = "dp"
    """Group name written for the DDP gradient all-reduce collectives."""
    device_timing: bool | None = None
    """Time ``compute_s``/``comm_s`` on the device with CUDA events (docs/collectors.md,
    Device timing). None (default): when a parameter lives on a CUDA device."""
    device_timing_wait_s: float = 2.0
    """How long after its step ends the sender waits for the step's events; a step
    whose events are still incomplete then keeps its CPU times (counted)."""
    device_timing_max_pending: int = 64
    """Steps whose events may be in flight at once; past that a step keeps its CPU
    times (counted as dropped), so memory stays bounded when the device falls behind."""
    device_events: Callable[[], Any] | None = None
    """Factory of timing events (default ``torch.cuda.Event(enable_timing=True)``).
    Given, device timing is on whatever the parameters' device: tests put scripted
    events here."""

    def __post_init__(self) -> None:
        if not self.beat_interval_s > 0:
            raise ValueError(f"beat_interval_s must be > 0, got {self.beat_interval_s!r}")
        if self.queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {self.queue_size!r}")
        if self.batch_max_records < 1:
            raise ValueError(f"batch_max_records must be >= 1, got {self.batch_max_records!r}")
        if not self.send_interval_s > 0:
            raise ValueError(f"send_interval_s must be > 0, got {self.send_interval_s!r}")
        if not self.flush_interval_s > 0:
            raise ValueError(f"flush_interval_s must be > 0, got {self.flush_interval_s!r}")
        if self.close_timeout_s < 0:
            raise ValueError(f"close_timeout_s must be >= 0, got {self.close_timeout_s!r}")
        if self.digest_every_steps < 0:
            raise ValueError(f"digest_every_steps must be >= 0, got {self.digest_every_steps!r}")
        if not self.device_timing_wait_s >= 0:
            raise ValueError(
                f"device_timing_wait_s must be >= 0, got {self.device_timing_wait_s!r}"
            )
        if self.device_timing_max_pending < 1:
            raise ValueError(
                f"device_timing_max_pending must be >= 1, got {self.device_timing_max_pending!r}"
            )
        if self.device_events is not None and not callable(self.device_events):
            raise ValueError("device_events must be a callable returning an event")
        if not self.ddp_group_name:
            raise ValueError("ddp_group_name must be a non-empty string")
