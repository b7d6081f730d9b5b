"""Peer-group index: lay a step's rows out as a (groups x peers) matrix.

Design notes: docs/detectors.md, "detectors/stats/peers.py".
"""

from __future__ import annotations

import numpy as np

__all__ = ["PeerIndex", "PeerCache"]


class PeerIndex:
    """Where each row of a step sits in the (n_groups, width) peer matrix.

    ``row_gid[i]`` is the dense group number of row ``i`` and ``row_pos[i]``
    its column; ``sizes[g]`` counts the rows of group ``g``. When every group
    has the same size, ``matrix`` is one gather and a reshape (the common case
    of a regular dp x tp x pp job), a plain reshape when rows are already in
    group order.
    """

    __slots__ = (
        "group", "n", "n_groups", "width", "row_gid", "row_pos", "sizes", "keys", "valid",
        "_perm", "_pad",
    )

    def __init__(self, group: np.ndarray) -> None:
        group = np.asarray(group, dtype=np.int64)
        self.group = group.copy()
        self.n = int(group.shape[0])
        if self.n == 0:
            self.n_groups, self.width = 0, 0
            self.row_gid = np.zeros(0, dtype=np.int64)
            self.row_pos = np.zeros(0, dtype=np.int64)
            self.sizes = np.zeros(0, dtype=np.int64)
            self.keys = np.zeros(0, dtype=np.int64)
            self.valid = np.zeros((0, 0), dtype=bool)
            self._perm, self._pad = np.zeros(0, dtype=np.int64), False
            return
        keys, gid = np.unique(group, return_inverse=True)
        self.keys = keys  # the frame's group id of each dense group number
        gid = gid.reshape(-1).astype(np.int64)
        sizes = np.bincount(gid)
        order = np.argsort(gid, kind="stable")
        starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        pos = np.empty(self.n, dtype=np.int64)
        pos[order] = np.arange(self.n, dtype=np.int64) - starts[gid[order]]
        self.row_gid, self.row_pos, self.sizes = gid, pos, sizes
        self.n_groups, self.width = int(sizes.shape[0]), int(sizes.max())
        # matrix cell -> source row (n = padding), so building a matrix is one gather
        perm = np.full(self.n_groups * self.width, self.n, dtype=np.int64)
        perm[gid * self.width + pos] = np.arange(self.n, dtype=np.int64)
        self._pad = bool(np.any(sizes != self.width))
        self.valid = (perm < self.n).reshape(self.n_groups, self.width)  # False = padding
        self._perm = None if np.array_equal(perm, np.arange(self.n)) else perm

    def matrix(self, values: np.ndarray, fill: float = np.nan) -> np.ndarray:
        """Values over rows -> (n_groups, width) matrix, ``fill`` in padding.

        Also accepts a stack ``(m, n)`` of several metrics and returns
        ``(m, n_groups, width)`` so that one sort serves all metrics.
        """
        values = np.asarray(values, dtype=np.float64)
        lead = values.shape[:-1]
        if self._pad:
            values = np.concatenate([values, np.full((*lead, 1), fill)], axis=-1)
        flat = values if self._perm is None else np.take(values, self._perm, axis=-1)
        return flat.reshape(*lead, self.n_groups, self.width)

    def matrix_obj(self, values: np.ndarray) -> np.ndarray:
        """Object values (digests, signatures) -> (n_groups, width), None in padding."""
        values = np.asarray(values, dtype=object)
        if self._pad:
            values = np.concatenate([values, np.full(1, None, dtype=object)])
        flat = values if self._perm is None else np.take(values, self._perm)
        return flat.reshape(self.n_groups, self.width)

    def argmax_rows(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per group: the row holding the largest finite value, and the finite count.

        Groups without a finite value get row ``-1``.
        """
        mat = self.matrix(values)
        finite = np.isfinite(mat)
        col = np.argmax(np.where(finite, mat, -np.inf), axis=1)
        cells = np.arange(self.n_groups) * self.width + col
        rows = cells if self._perm is None else self._perm[cells]
        count = finite.sum(axis=1)
        return np.where(count > 0, rows, -1), count

    def cell_rows(self, g: int) -> np.ndarray:
        """Row index of each column of group ``g`` (``n`` marks padding)."""
        if self._perm is None:
            return np.arange(g * self.width, (g + 1) * self.width)
        return self._perm[g * self.width : (g + 1) * self.width]

    def rows(self, per_group: np.ndarray) -> np.ndarray:
        """Broadcast a per-group array ``(..., n_groups)`` back to rows ``(..., n)``."""
        return np.take(per_group, self.row_gid, axis=-1)

    def peers_of(self, row: int) -> np.ndarray:
        """Row indices of the peer group of ``row`` (itself included); for evidence only."""
        return np.flatnonzero(self.row_gid == self.row_gid[row])


class PeerCache:
    """Keeps the last ``PeerIndex`` and rebuilds it only when the grouping changes."""

    __slots__ = ("_index",)

    def __init__(self) -> None:
        self._index: PeerIndex | None = None

    def get(self, group: np.ndarray) -> PeerIndex:
        idx = self._index
        if idx is None or idx.n != group.shape[0] or not np.array_equal(idx.group, group):
            idx = PeerIndex(group)
            self._index = idx
        return idx
