"""Robust location and scale per peer group, vectorized over groups and metrics.

Design notes: docs/detectors.md, "detectors/stats/robust.py".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["GroupStats", "group_stats", "robust_z", "quantile_sorted", "MAD_TO_SIGMA"]

MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its sigma
IQR_TO_SIGMA = 1.0 / 1.349
FLOAT32_REL = 1e-6  # relative rounding of a float32 median (about 8 x its epsilon)


@dataclass(slots=True)
class GroupStats:
    """Per group (shape ``(..., groups)``): finite count, median, robust sigma."""

    count: np.ndarray
    median: np.ndarray
    scale: np.ndarray


def quantile_sorted(s: np.ndarray, count: np.ndarray | int, q: float) -> np.ndarray:
    """Linear-interpolated quantile of rows sorted ascending with NaN padding at the end.

    ``count`` is the number of finite values per row, or one int when every
    row has the same count (then the positions are static: plain slicing).
    """
    if isinstance(count, int):
        if count == 0:
            return np.full(s.shape[:-1], np.nan)
        pos = q * (count - 1)
        lo = int(np.floor(pos))
        hi = min(lo + 1, count - 1)
        frac = pos - lo
        a = s[..., lo]
        return a if frac == 0 else a + (s[..., hi] - a) * frac
    pos = q * np.maximum(count - 1, 0)
    lo = np.floor(pos).astype(np.int64)
    hi = np.minimum(lo + 1, np.maximum(count - 1, 0))
    frac = pos - lo
    a = np.take_along_axis(s, lo[..., None], axis=-1)[..., 0]
    b = np.take_along_axis(s, hi[..., None], axis=-1)[..., 0]
    out = a + (b - a) * frac
    return np.where(count > 0, out, np.nan)


def group_stats(mat: np.ndarray) -> GroupStats:
    """Median and robust sigma of each row of ``mat`` (last axis = peers).

    The statistics are computed in float32: sorting is what costs, and float32
    sorts several times faster with seven significant digits to spare for a
    median or a MAD. Values beyond float32's range count as missing here (they
    are outliers anyway; callers score the float64 values against the result).
    """
    with np.errstate(over="ignore"):
        mat = np.asarray(mat, dtype=np.float32)
    finite = np.isfinite(mat)
    if finite.all():
        clean = mat
        count = np.full(mat.shape[:-1], mat.shape[-1], dtype=np.int64)
        cnt: np.ndarray | int = int(mat.shape[-1])
    else:
        clean = np.where(finite, mat, np.nan)
        count = finite.sum(axis=-1)
        cnt = count
    if mat.shape[-1] == 0:
        nan = np.full(mat.shape[:-1], np.nan)
        return GroupStats(count=count, median=nan, scale=nan.copy())
    s = np.sort(clean, axis=-1)
    with np.errstate(invalid="ignore"):
        med = np.ascontiguousarray(quantile_sorted(s, cnt, 0.5))
        dev = clean - med[..., None]
        np.abs(dev, out=dev)
        dev.sort(axis=-1)
        scale = np.float32(MAD_TO_SIGMA) * quantile_sorted(dev, cnt, 0.5)
        if np.any(scale <= 0):  # rare: more than half the peers report the same value
            iqr = (quantile_sorted(s, cnt, 0.75) - quantile_sorted(s, cnt, 0.25)) * np.float32(
                IQR_TO_SIGMA
            )
            scale = np.where(scale > 0, scale, iqr)
            last = np.take_along_axis(s, np.maximum(count - 1, 0)[..., None], axis=-1)[..., 0]
            gap = (last - s[..., 0]) / np.maximum(count - 1, 1)
            scale = np.where(scale > 0, scale, gap)
    return GroupStats(
        count=count, median=med.astype(np.float64), scale=scale.astype(np.float64)
    )


def robust_z(x: np.ndarray, median: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """(x - median) / scale, with +-inf for a deviation against a zero scale.

    NaN wherever ``x`` or the median is not finite (nothing to score).
    """
    with np.errstate(divide="ignore", invalid="ignore"):
        dev = x - median
        z = dev / scale
        if np.all(scale > 0) and not np.isinf(x).any():  # common case: nothing to patch
            return z
        same = np.abs(dev) <= FLOAT32_REL * np.abs(median)  # equal up to the median's rounding
        z = np.where(scale > 0, z, np.where(same, 0.0, np.sign(dev) * np.inf))
    return np.where(np.isfinite(x) & np.isfinite(median), z, np.nan)
