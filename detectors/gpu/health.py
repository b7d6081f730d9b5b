"""GPU health: hardware errors that condemn a GPU at once, no consensus needed.

Design notes: docs/detectors.md, "detectors/gpu/health.py".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from rankscope.detectors.evidence import num
from rankscope.detectors.frame import StepFrame
from rankscope.detectors.gpu.readings import column, has_gpu, xid_lists
from rankscope.detectors.signal import DetectorOutput, Signal

__all__ = ["GpuHealthConfig", "GpuHealthState", "detect", "CRITICAL_XIDS", "NAME"]

NAME = "gpu_health"

# XIDs that mean the GPU (or its memory, or its links) cannot be trusted.
# Sources: NVIDIA's XID catalogue and GPU memory error management guides.
CRITICAL_XIDS: dict[int, str] = {
    48: "double-bit (uncorrectable) ECC error in GPU memory",
    63: "ECC page retirement or row remapping event: GPU needs a reset to use the spare row",
    64: "ECC page retirement or row remapping failure: no spare row left",
    74: "NVLink error: a link had a fatal error or needed recovery",
    79: "GPU has fallen off the bus: no longer reachable over PCIe",
    92: "high single-bit ECC error rate: memory wearing out",
    94: "contained uncorrectable ECC error: the application that hit it must restart",
    95: "uncontained uncorrectable ECC error: every process on the GPU is affected, reset needed",
    119: "GSP RPC timeout: the GPU's system processor stopped answering",
    120: "GSP error: the GPU's system processor reported a fatal error",
}


@dataclass(kw_only=True, slots=True)
class GpuHealthConfig:
    """Settings of the GPU health detector (defaults are evict-worthy facts)."""

    critical_xids: tuple[int, ...] = tuple(CRITICAL_XIDS)
    """XIDs that are fatal; others are ignored here (many are application errors)."""
    ecc_dbe_growth_min: int = 1
    """A rise of at least this many uncorrected ECC errors is fatal."""
    nvlink_error_growth_min: int = 1
    """A rise of at least this many NVLink errors is fatal; raise it on fabrics with benign
    CRC noise."""
    temp_slowdown_c: float = 87.0
    """Slowdown temperature used when a reading does not carry the GPU's own threshold."""
    temp_shutdown_c: float = 92.0
    """Shutdown temperature used when a reading does not carry the GPU's own threshold."""

    def __post_init__(self) -> None:
        if any(not isinstance(x, int) or x <= 0 for x in self.critical_xids):
            raise ValueError(f"critical_xids must be positive ints, got {self.critical_xids!r}")
        if self.ecc_dbe_growth_min < 1:
            raise ValueError(f"ecc_dbe_growth_min must be >= 1, got {self.ecc_dbe_growth_min}")
        if self.nvlink_error_growth_min < 1:
            raise ValueError(
                f"nvlink_error_growth_min must be >= 1, got {self.nvlink_error_growth_min}"
            )
        if not 0 < self.temp_slowdown_c <= self.temp_shutdown_c:
            raise ValueError(
                "need 0 < temp_slowdown_c <= temp_shutdown_c, got "
                f"{self.temp_slowdown_c} and {self.temp_shutdown_c}"
            )


_COUNTERS = ("ecc_dbe", "nvlink_errors")


class GpuHealthState:
    """Per global rank, the counters last reported on a clean step (NaN: none yet)."""

    __slots__ = ("base",)

    def __init__(self, cfg: GpuHealthConfig | None = None) -> None:
        self.base = {c: np.zeros(0) for c in _COUNTERS}

    def _grow(self, top: int) -> None:
        for c, arr in self.base.items():
            if arr.shape[0] < top:
                grown = np.full(max(top, 2 * arr.shape[0]), np.nan)
                grown[: arr.shape[0]] = arr
                self.base[c] = grown

    def baseline(self, ranks: np.ndarray, counter: str) -> np.ndarray:
        arr = self.base[counter]
        out = np.full(ranks.shape[0], np.nan)
        known = ranks < arr.shape[0]
        out[known] = arr[ranks[known]]
        return out

    def learn(self, frame: StepFrame, clean_mask: np.ndarray) -> None:
        """Clean rows with a reading set the baseline of their rank."""
        if not has_gpu(frame):
            return
        ranks = frame.rank.astype(np.int64)
        self._grow(int(ranks.max()) + 1)
        for c in _COUNTERS:
            x = column(frame, c)
            ok = np.asarray(clean_mask, dtype=bool) & np.isfinite(x)
            self.base[c][ranks[ok]] = x[ok]

    def state_dict(self) -> dict:
        out = {}
        for c, arr in self.base.items():
            idx = np.flatnonzero(np.isfinite(arr))
            out[c] = {"ranks": idx.tolist(), "values": arr[idx].tolist()}
        return out

    def load_state_dict(self, d: dict) -> None:
        self.base = {c: np.zeros(0) for c in _COUNTERS}
        for c in _COUNTERS:
            part = d.get(c, {})
            ranks = np.asarray(part.get("ranks", []), dtype=np.int64)
            if ranks.size:
                self._grow(int(ranks.max()) + 1)
                self.base[c][ranks] = np.asarray(part.get("values", []), dtype=np.float64)


def _threshold(frame: StepFrame, name: str, default: float) -> np.ndarray:
    own = column(frame, name)
    return np.where(np.isfinite(own) & (own > 0), own, default)


def detect(frame: StepFrame, state: GpuHealthState, cfg: GpuHealthConfig) -> DetectorOutput:
    """Hardware errors (XID, uncorrectable ECC, failed remap) that condemn a GPU at once."""
    out = DetectorOutput()
    if not has_gpu(frame):
        return out
    n = frame.n
    ranks = frame.rank.astype(np.int64)
    causes: list[list[dict]] = [[] for _ in range(n)]
    critical = set(cfg.critical_xids)
    for i, xids in enumerate(xid_lists(frame)):
        bad = [x for x in xids if x in critical]
        for x in bad:
            reason = CRITICAL_XIDS.get(x, "configured as critical")
            causes[i].append({"cause": "xid", "xid": x, "reason": reason})
    for counter, min_growth in (("ecc_dbe", cfg.ecc_dbe_growth_min),
                                ("nvlink_errors", cfg.nvlink_error_growth_min)):
        x = column(frame, counter)
        base = state.baseline(ranks, counter)
        with np.errstate(invalid="ignore"):
            grew = np.isfinite(x) & np.isfinite(base) & (x - base >= min_growth)
        for i in np.flatnonzero(grew):
            causes[i].append({"cause": f"{counter}_growth", "before": num(base[i]),
                              "now": num(x[i])})
    failed = column(frame, "remap_failed")
    for i in np.flatnonzero(failed > 0):
        causes[i].append({"cause": "remap_failed",
                          "reason": "row remapping failed: a bad memory row has no spare"})
    temp = column(frame, "temp_c")
    slow = _threshold(frame, "temp_slowdown_c", cfg.temp_slowdown_c)
    shut = _threshold(frame, "temp_shutdown_c", cfg.temp_shutdown_c)
    with np.errstate(invalid="ignore"):
        hot = np.isfinite(temp) & (temp >= slow)
    for i in np.flatnonzero(hot):
        where = "shutdown" if temp[i] >= shut[i] else "slowdown"
        causes[i].append({"cause": f"temp_at_{where}", "temp_c": num(temp[i]),
                          "threshold_c": num(shut[i] if where == "shutdown" else slow[i])})
    gpu_index = column(frame, "gpu")
    for i in range(n):
        if not causes[i]:
            continue
        evidence = {"metric": "gpu_health", "causes": causes[i]}
        if np.isfinite(gpu_index[i]):
            evidence["gpu"] = int(gpu_index[i])
        out.signals.append(Signal(
            kind="gpu",
            ranks=(int(ranks[i]),),
            detector=NAME,
            score=float(len(causes[i])),
            severity="fatal",
            evidence=evidence,
        ))
    return out


CONFIG = GpuHealthConfig
STATE = GpuHealthState
