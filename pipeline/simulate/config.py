"""The simulation's settings: one dataclass, checked once, defaults here only."""

from __future__ import annotations

from dataclasses import dataclass, field

from rankscope.pipeline.simulate.model import ModelConfig
from rankscope.pipeline.simulate.spec import FaultSpec, SpecError, parse_fault, parse_topology

__all__ = ["SimConfig"]


@dataclass(kw_only=True, slots=True)
class SimConfig:
    """One simulated training run.

    ``faults`` may be spec strings or parsed ``FaultSpec``; ``__post_init__``
    parses them, checks them against the run, and fills in each fault's
    default step range, so after construction every fault says exactly which
    steps it acts on. Raises ``SpecError`` (a ``ValueError``) with the reason.
    """

    ranks: int
    """World size: number of rank processes."""
    steps: int
    """Optimizer steps to train."""
    out_dir: str | None = None
    """Where labels.jsonl and meta.json go (and the trace, with the default file sink)."""
    faults: list = field(default_factory=list)
    """Fault specs (``KIND[:key=value,...]`` strings or ``FaultSpec``)."""
    ranks_per_host: int = 1
    """Ranks per emulated host (hosts are node00, node01, ...)."""
    topology: str | dict | None = None
    """Axis sizes such as ``dp=2,tp=2,pp=2``; default: every rank a dp replica."""
    sink: str | None = None
    """Collector sink URL; default ``file://<out_dir>``."""
    seed: int = 0
    """Seeds the model initialisation, every rank's data and fault element choice."""
    job: str | None = None
    """Job name stamped on every record; default ``sim-<fault kinds>-s<seed>``."""
    lr: float = 3e-3
    """Adam learning rate."""
    beat_interval_s: float = 1.0
    """Collector beat interval."""
    stall_s: float = 5.0
    """After a hang fault fired: seconds without any rank finishing a step before the run ends."""
    progress_timeout_s: float = 120.0
    """With no hang fired: seconds without any progress before the run counts as stalled."""
    failure_grace_s: float = 15.0
    """After a rank exits abnormally, seconds the others get to fail or finish on their own."""
    stop_grace_s: float = 5.0
    """After asking ranks to stop, seconds before they are killed."""
    startup_timeout_s: float = 120.0
    """Seconds allowed until the first step completes (process start, rendezvous)."""
    timeout_s: float = 900.0
    """Wall-clock limit of the whole run."""
    gzip: bool = False
    """Compress the recorded JSONL files (``.jsonl.gz``) when the run ends."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model and batch sizes."""

    def __post_init__(self) -> None:
        if self.ranks < 1:
            raise SpecError(f"ranks should be >= 1, got {self.ranks}")
        if self.steps < 1:
            raise SpecError(f"steps should be >= 1, got {self.steps}")
        if self.ranks_per_host < 1:
            raise SpecError(f"ranks_per_host should be >= 1, got {self.ranks_per_host}")
        if self.ranks % self.ranks_per_host:
            raise SpecError(
                f"ranks_per_host={self.ranks_per_host} does not divide {self.ranks} ranks"
            )
        for name in ("beat_interval_s", "stall_s", "progress_timeout_s", "failure_grace_s",
                     "stop_grace_s",
                     "startup_timeout_s", "timeout_s", "lr"):
            if not getattr(self, name) > 0:
                raise SpecError(f"{name} should be > 0, got {getattr(self, name)!r}")
        if self.sink is None and self.out_dir is None:
            raise SpecError("out_dir is required when no sink is given (default: file://OUT)")
        if self.sink is not None:
            from rankscope.collectors.sinks.factory import SINKS

            scheme = self.sink.split("://", 1)[0].lower()
            if scheme not in SINKS:
                known = ", ".join(f"{s}://" for s in SINKS)
                raise SpecError(f"sink {self.sink!r}: unknown scheme {scheme!r} (known: {known})")
        self.topology = parse_topology(self.topology, self.ranks)
        self.faults = [self._resolve(f) for f in self.faults]
        if self.job is None:
            kinds = sorted({f.kind for f in self.faults if f.kind != "none"}) or ["clean"]
            self.job = f"sim-{'-'.join(kinds)}-s{self.seed}"

    def _resolve(self, fault: str | FaultSpec) -> FaultSpec:
        from rankscope.pipeline.simulate.faults import fault_class

        spec = parse_fault(fault) if isinstance(fault, str) else fault
        cls = fault_class(spec.kind)
        if not cls.targets_rank:
            return spec
        if not 0 <= spec.rank < self.ranks:
            raise SpecError(
                f"fault {spec.text!r}: rank={spec.rank} but there are {self.ranks} ranks"
            )
        if spec.from_step is None:
            spec.from_step = self.steps // 2
        if spec.from_step >= self.steps:
            raise SpecError(
                f"fault {spec.text!r}: from={spec.from_step} but the run has {self.steps} steps "
                f"(0..{self.steps - 1})"
            )
        if spec.until_step is None and cls.default_span is not None:
            spec.until_step = spec.from_step + cls.default_span
        return spec

    def host_count(self) -> int:
        return self.ranks // self.ranks_per_host
