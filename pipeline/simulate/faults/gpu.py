"""GPU hardware faults: scripted NVML readings under the real GPU collector.

Every rank runs the real ``GpuCollector`` (attached with its rank collector,
records through the same sender) over a scripted NVML (``ScriptedNvml``)
whose one GPU shows healthy, slightly noisy readings. On the faulty rank,
from step ``from`` on, the script turns bad in one of three ways:

- ``mode=xid``: one critical XID event (default 79, fallen off the bus) on
  the first faulty step, delivered through the NVML event set;
- ``mode=ecc``: the volatile uncorrected ECC counter goes from 0 to 1;
- ``mode=thermal``: the GPU throttles (``sw_thermal``, SM clock and power
  divided by ``factor``, temperature up, still below the slowdown threshold)
  and the rank's emulated device time stretches by ``factor`` (the same
  slowdown the straggler fault applies, pipeline/simulate/device.py), as a
  throttled GPU's kernels would.

GPU samples come every ``interval_s`` seconds of wall time (default 0.25, so
a short simulated run has enough of them), not per step.
"""

from __future__ import annotations

import random

from rankscope.pipeline.simulate.faults.base import Fault, FaultContext, register_fault

__all__ = ["GpuFault"]

MODES = ("xid", "ecc", "thermal")
GPUS_PER_HOST = 8  # GPUs of the scripted host; a rank samples its own (its index on the host)
_HEALTHY_CLOCKS_MHZ = (1950, 1965, 1980, 1980, 1980, 1995)


def _mode(value: str) -> str:
    if value not in MODES:
        raise ValueError(f"mode should be one of {', '.join(MODES)}")
    return value


def _xid(value: str) -> int:
    x = int(value)
    if not 0 < x < 1000:
        raise ValueError("xid should be an XID number such as 79")
    return x


def _factor(value: str) -> float:
    f = float(value)
    if not 1.0 < f <= 10:
        raise ValueError("factor should be within (1, 10] (1.5 = clock 1.5x lower)")
    return f


def _interval(value: str) -> float:
    s = float(value)
    if not 0.02 <= s <= 10:
        raise ValueError("interval_s should be within [0.02, 10] seconds")
    return s


def _local_index(rank: int, world: int, host: str) -> int:
    """This rank's index on its emulated host (``nodeHH`` holds ranks H*K .. H*K+K-1)."""
    digits = "".join(ch for ch in host if ch.isdigit())
    if digits:
        h = int(digits)
        for k in range(1, world + 1):
            if world % k == 0 and h * k <= rank < (h + 1) * k:
                return (rank - h * k) % GPUS_PER_HOST
    return rank % GPUS_PER_HOST


@register_fault
class GpuFault(Fault):
    """``gpu:rank=R,from=S[,until=U],mode=xid|ecc|thermal[,xid=N][,factor=F][,interval_s=X]``."""

    kind = "gpu"
    label_kind = "gpu"
    params = {"mode": _mode, "xid": _xid, "factor": _factor, "interval_s": _interval}

    def __init__(self, spec):
        super().__init__(spec)
        self.mode = spec.params.get("mode", "thermal")
        self.xid = spec.params.get("xid", 79)
        self.factor = spec.params.get("factor", 1.5)
        self.interval_s = spec.params.get("interval_s", 0.25)
        self.nvml = None
        self.collector = None
        self._fired = False
        self._rng: random.Random | None = None
        self._index = 0

    def magnitude(self) -> float | None:
        if self.mode == "thermal":
            return self.factor
        return float(self.xid) if self.mode == "xid" else 1.0

    def install(self, ctx: FaultContext) -> None:
        from rankscope.pipeline.simulate.scripted_nvml import ScriptedNvml

        self._index = _local_index(ctx.rank, ctx.world, ctx.host)
        self.nvml = ScriptedNvml(GPUS_PER_HOST)
        self._rng = random.Random(ctx.seed * 1009 + ctx.rank)
        device = ctx.extra.get("device")
        if self.mode == "thermal" and ctx.rank == self.spec.rank and device is not None:
            rank = ctx.rank
            device.add_scaler(
                lambda phase, step: self.factor if self.spec.active(rank, step) else 1.0
            )
        self._script(ctx, self.spec.active(ctx.rank, 0))
        ctx.optimizer.register_step_post_hook(lambda opt, args, kwargs: self._on_step(ctx))

    def _start(self, ctx: FaultContext) -> None:
        from rankscope.collectors.gpu.attach import attach_for_rank
        from rankscope.collectors.gpu.collector import GpuCollectorConfig

        rc = ctx.extra.get("collector")
        if rc is None:  # the worker did not expose its collector: nothing to attach to
            return
        cfg = GpuCollectorConfig(
            interval_s=self.interval_s,
            counters_interval_s=self.interval_s,
            event_wait_s=min(0.1, self.interval_s),
        )
        self.collector = attach_for_rank(
            rc, device=self._index, config=cfg, nvml=self.nvml
        )

    def _on_step(self, ctx: FaultContext) -> None:
        if self.collector is None:
            self._start(ctx)
        active = self.spec.active(ctx.rank, ctx.step + 1)  # readings for the step to come
        self._script(ctx, active)

    def _script(self, ctx: FaultContext, active: bool) -> None:
        """Set this rank's GPU readings for the coming step.

        Values are computed first and each field written once: the collector
        samples on its own thread and must never see a half-written state
        (a healthy clock on a throttled step).
        """
        g = self.nvml.gpus[self._index]
        rng = self._rng
        util = rng.randint(95, 99)
        temp = rng.randint(60, 66)
        power = rng.randint(640_000, 660_000)
        clock = rng.choice(_HEALTHY_CLOCKS_MHZ)
        mask = 0x4 if rng.random() < 0.3 else 0  # at the power cap now and then
        if active and self.mode == "thermal":
            temp = rng.randint(83, 85)
            clock = int(round(clock / self.factor / 15.0)) * 15
            power = int(power / self.factor)
            mask = 0x20  # sw_thermal
        g.util_pct, g.temp_c, g.power_mw, g.sm_clock_mhz, g.clock_event_mask = (
            util, temp, power, clock, mask)
        if not active:
            return
        if self.mode == "ecc":
            g.ecc_dbe = 1
        if not self._fired:
            if self.mode == "xid":
                if self.collector is None or not self.collector.ready.is_set():
                    return  # NVML events reach only a registered event set: fire once it is
                self.nvml.inject_xid(self._index, self.xid)
            self._fired = True
            ctx.report({"fault": self.spec.text, "kind": self.kind, "rank": ctx.rank,
                        "step": ctx.step + 1, "mode": self.mode, "gpu": self._index,
                        "magnitude": self.magnitude()})

    def close(self, ctx: FaultContext) -> None:
        if self.collector is not None:
            self.collector.close()
