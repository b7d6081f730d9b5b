"""Synthetic DDP steps with bucketed all-reduces for the network detector's tests."""

from __future__ import annotations

import numpy as np
from support.synth import make_frame

__all__ = ["BUCKETS", "D", "dp_step", "blamed"]

BUCKETS = 3
D = 0.05  # injected delay per all-reduce (s)


def dp_step(lay, step, rng, delayed=None, slow_compute=None, skew=None, t0=True, jitter=0.0005,
            delay=D, quick=None):
    """One DDP step: bucket k of every rank enters at T_k; delays push later buckets back;
    ``quick``: a rank computing 10 % less, early for the second bucket only (it waits
    there, and its saving goes into the wait)."""
    w = lay["rank"].shape[0]
    base = 1.7e9 + step
    compute = 0.3 * (1 + 0.01 * rng.standard_normal(w))
    if quick is not None:
        compute[quick] *= 0.9
    late = np.zeros(w)
    if slow_compute is not None:
        late[slow_compute] = 0.1
        compute[slow_compute] += 0.1
    colls = [[] for _ in range(w)]
    comm = np.zeros(w)
    for k in range(BUCKETS):
        enter = base + 0.1 * (k + 1) * (1 + late / 0.3) + rng.exponential(jitter, w)
        if quick is not None and k == 1:
            enter[quick] -= 0.03
        call = enter.copy()  # when the reduction really starts
        if delayed is not None:
            enter[delayed] += k * delay
            call[delayed] = enter[delayed] + delay
        done = call.max() + 0.002
        for r in range(w):
            rec = {"op": "allreduce", "group": "dp", "seq": step * BUCKETS + k,
                   "s": float(done - enter[r])}
            if t0:
                rec["t0"] = float(enter[r] + (skew if skew is not None and r == 3 else 0.0))
            colls[r].append(rec)
        comm += done - enter
    m = {"compute_s": compute, "comm_s": comm, "data_s": np.full(w, 0.001)}
    m["step_s"] = compute + comm + 0.001
    return make_frame(lay, step, m, collectives=colls)


def blamed(outs):
    return [(i, s.ranks) for i, o in enumerate(outs) for s in o.signals if not s.unattributed]
