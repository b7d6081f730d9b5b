"""Hand-built StepFrames for tests and benchmarks of the detectors.

Ranks are laid out as Megatron does (tp fastest, then dp, then pp), hosts hold
``ranks_per_host`` consecutive ranks, and the peer group of a rank numbers its
(tp, pp) pair, so frames look like what the engine assembles from a real
dp x tp x pp job without going through records.
"""

from __future__ import annotations

import numpy as np
from rankscope.detectors.frame import METRIC_COLUMNS, StepFrame

__all__ = ["layout", "make_frame", "run_detector"]


def layout(dp: int, tp: int = 1, pp: int = 1, ranks_per_host: int = 8) -> dict[str, np.ndarray]:
    """Coordinates, hosts and peer-group ids of every rank of a dp x tp x pp job."""
    world = dp * tp * pp
    rank = np.arange(world, dtype=np.int64)
    t = rank % tp
    d = (rank // tp) % dp
    p = rank // (tp * dp)
    hosts = np.array([f"h{r // ranks_per_host:05d}" for r in range(world)], dtype=object)
    return {
        "rank": rank,
        "dp": d,
        "tp": t,
        "pp": p,
        "host": hosts,
        "group": p * tp + t,
    }


def make_frame(
    lay: dict[str, np.ndarray],
    step: int,
    metrics: dict[str, np.ndarray] | None = None,
    *,
    job: str = "synth",
    rows: np.ndarray | None = None,
    digest: np.ndarray | None = None,
    collectives: list[list[dict]] | None = None,
    checks: list[dict] | None = None,
) -> StepFrame:
    """A frame for ``step``; ``rows`` selects the ranks that reported (default all).

    ``metrics`` values are over all ranks of the layout; absent columns are NaN.
    """
    world = lay["rank"].shape[0]
    sel = np.arange(world) if rows is None else np.asarray(rows, dtype=np.int64)
    n = sel.shape[0]
    metrics = metrics or {}
    m = {c: np.asarray(metrics[c], dtype=np.float64)[sel] if c in metrics else np.full(n, np.nan)
         for c in METRIC_COLUMNS}
    coords = {c: (lay[c][sel] if c in lay else np.zeros(n, dtype=np.int64))
              for c in ("dp", "tp", "pp", "cp", "ep")}
    missing = np.setdiff1d(np.arange(world), sel)
    return StepFrame(
        job=job,
        step=step,
        world=world,
        rank=lay["rank"][sel],
        host=lay["host"][sel],
        group=lay["group"][sel],
        coords=coords,
        m=m,
        digest=(np.asarray(digest, dtype=object)[sel] if digest is not None
                else np.full(n, None, dtype=object)),
        collectives=None if collectives is None else [collectives[i] for i in sel],
        checks=list(checks or []),
        missing=missing,
    )


def run_detector(module, frames, cfg=None, state=None):
    """Feed frames through one detector module as the engine does; (outputs, state).

    clean_mask = rows named by no signal of the step (the engine also drops
    rows with non-finite readings; detectors must cope either way). ``state``
    goes on from an earlier call's (or a restored) state.
    """
    cfg = cfg or module.CONFIG()
    state = state if state is not None else module.STATE(cfg)
    outs = []
    for f in frames:
        out = module.detect(f, state, cfg)
        named = [r for s in out.signals for r in s.ranks]
        clean = ~np.isin(f.rank, named) if named else np.ones(f.n, dtype=bool)
        state.learn(f, clean)
        outs.append(out)
    return outs, state


def replica_pair_frame(lay, step, compute, rng, waits=True):
    """A pp 2 x dp 2 step (``layout(2, 1, 2)``) from its per-rank ``compute``: with
    ``waits`` each stage's two replicas meet in their gradient all-reduce (the faster
    one waits for the slower), else ``comm_s`` is noise that waits for nobody."""
    if waits:
        comm = np.maximum(compute, compute[[1, 0, 3, 2]]) - compute + 0.01
    else:
        comm = 0.01 + 0.004 * rng.random(4)
    m = {"compute_s": compute, "data_s": np.full(4, 0.001), "comm_s": comm}
    m["step_s"] = compute + comm + 0.001
    return make_frame(lay, step, m)
