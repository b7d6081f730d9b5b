"""The assembled step: what every detector receives.

The engine (``pipeline/engine/assemble.py``) turns the records of one (job, step)
into a ``StepFrame``: one row per rank that reported, columns as numpy arrays,
so a detector works on whole steps at once instead of record by record. Rows
are sorted by rank. Absent numeric readings are NaN; absent strings are None.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["StepFrame", "METRIC_COLUMNS", "COORD_NAMES", "NAMED_BITS", "diverged", "work_group"]

# Numeric columns of ``StepFrame.m`` (float64, NaN when a rank did not report it).
METRIC_COLUMNS = (
    "t",
    "step_s",
    "compute_s",
    "comm_s",
    "data_s",
    # of step_s, the training thread's wait for a CPU (straggler/own_time.py)
    "cpu_wait_s",
    "loss",
    "grad_norm",
    "grad_norm_reduced",
    "nonfinite",
    "dropped",
    "tokens",
    # not a reading: the parameter shard a rank holds under sharded data
    # parallelism (FSDP2/HSDP); only peers of equal shard are replicas
    "shard",
    # 1.0 where the loop skipped the step's optimizer update (GradScaler found inf/NaN)
    "skipped",
    # not a reading: which columns the row's record named non-finite in
    # ``nonfinite_fields`` (bits: NAMED_BITS); there a NaN is a value, not a gap
    "nonfinite_named",
)
NAMED_BITS = {"loss": 1, "grad_norm": 2, "grad_norm_reduced": 4}
"""Columns a record may name non-finite (``nonfinite_fields``): their bit in ``nonfinite_named``."""
# Parallel coordinates; peers share every one of them except ``dp``.
COORD_NAMES = ("dp", "tp", "pp", "cp", "ep")


@dataclass(slots=True)
class StepFrame:
    """One step of one job, ranks as rows.

    ``group`` numbers the symmetric peer groups (ranks whose coordinates other
    than dp are equal); detectors compare a rank only with rows of the same
    group. ``missing`` lists ranks of the world that did not report by the
    step's deadline: their absence is evidence too.
    """

    job: str
    step: int
    world: int
    rank: np.ndarray  # int64 (n,)
    host: np.ndarray  # object (n,)
    group: np.ndarray  # int64 (n,) peer-group id
    coords: dict[str, np.ndarray]  # int64 (n,) per name in COORD_NAMES
    m: dict[str, np.ndarray]  # float64 (n,) per name in METRIC_COLUMNS
    digest: np.ndarray  # object (n,) param_digest or None
    collectives: list[list[dict]] | None = None  # per row, the step's collectives
    checks: list[dict] = field(default_factory=list)  # this step's `check` records
    gpu: dict[str, np.ndarray] = field(default_factory=dict)  # per-rank GPU readings
    missing: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # what several detectors derive from this step alone (``memo``), computed once
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def n(self) -> int:
        return int(self.rank.shape[0])

    @property
    def t(self) -> float:
        """End of the step: the latest rank's ``t``."""
        return self.memo("t", _end_time)

    def memo(self, key, compute):
        """``compute(self)``, once per frame and ``key``: a frame is not changed once
        assembled, so what is derived from it alone (the step's reference time, a peer
        consensus of its columns) need not be derived again by the next detector."""
        memo = self._memo
        if key not in memo:
            memo[key] = compute(self)
        return memo[key]


def _end_time(frame: StepFrame) -> float:
    ts = frame.m["t"]
    return float(np.nanmax(ts)) if ts.size and not np.all(np.isnan(ts)) else float("nan")


def work_group(frame: StepFrame) -> np.ndarray:
    """Group ids of ranks that do the same work: coordinates equal except ``dp`` and ``tp``.

    Tensor-parallel shards split every matmul evenly, so a rank's compute is comparable
    with its tp partners' as well as its dp peers'; a dp 2 x tp 2 job then has four peers
    to outvote one slow rank instead of two that cannot. Pipeline stages and experts do
    different work and stay apart. Without tp this is ``frame.group``.
    """
    tp = frame.coords.get("tp")
    if tp is None or not tp.size or not tp.any():
        return frame.group
    key = np.zeros(frame.n, dtype=np.int64)
    for c in COORD_NAMES:
        if c not in ("dp", "tp"):
            v = frame.coords[c]
            key = key * (int(v.max()) + 1 if v.size else 1) + v
    return np.unique(key, return_inverse=True)[1].astype(np.int64).reshape(-1)


def diverged(frame: StepFrame) -> bool:
    """Every rank's local gradient is non-finite this step (all report ``nonfinite``).

    Then the job has diverged: a reduced NaN made every replica's weights NaN, and
    what the ranks compute is no longer the model's work (a mixture of experts
    routes every NaN token to the same experts, whose rank then does all of it).
    The timing detectors leave such steps alone; the NaN's origin was named at
    the step it appeared, when the other ranks' gradients were still finite.
    """
    return bool(frame.memo("diverged", _diverged))


def _diverged(frame: StepFrame) -> bool:
    nf = frame.m.get("nonfinite")
    if nf is None or frame.n < 2:
        return False
    with np.errstate(invalid="ignore"):
        return bool(np.all(nf > 0))  # a NaN reading (not reported) compares False
