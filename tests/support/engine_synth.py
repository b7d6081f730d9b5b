"""Synthetic step traces for the engine, store and replay tests (real record dicts).

Layout as Megatron: tp fastest, then dp, then pp; ``ranks_per_host`` ranks per
host. Faults are injected into the records themselves, so everything
downstream (trace files, readers, assembler, detectors) runs for real. A
straggler makes the job pay, as in a synchronous job: every rank's step is
longer by its extra compute and its peers wait that long in ``comm_s``.
"""

from __future__ import annotations

import numpy as np
from rankscope.collectors.schema.records import StepRecord

T0 = 1_764_470_000.0


def make_records(
    *,
    job: str = "job-a",
    dp: int = 4,
    tp: int = 2,
    pp: int = 1,
    steps: int = 40,
    ranks_per_host: int = 4,
    step_s: float = 0.2,
    straggler: tuple[int, int, float] | None = None,  # (rank, from_step, factor)
    vanish: tuple[int, int] | None = None,  # (rank, from_step): no more records
    digest_flip: tuple[int, int] | None = None,  # (rank, from_step): wrong param_digest
    seed: int = 0,
) -> list[dict]:
    rng = np.random.default_rng(seed)
    world = dp * tp * pp
    out = []
    t_step = T0
    for step in range(steps):
        late = bool(straggler) and step >= straggler[1]
        extra = 0.12 * (straggler[2] - 1) if late else 0.0  # what everyone waits for
        for rank in range(world):
            if vanish and rank == vanish[0] and step >= vanish[1]:
                continue
            t_, d_, p_ = rank % tp, (rank // tp) % dp, rank // (tp * dp)
            compute = 0.12 * (1 + 0.02 * rng.standard_normal())
            if straggler and rank == straggler[0] and step >= straggler[1]:
                compute *= straggler[2]
            digest = f"s{step}-tp{t_}-pp{p_}"
            if digest_flip and rank == digest_flip[0] and step >= digest_flip[1]:
                digest = "bad-" + digest
            out.append(
                StepRecord(
                    job=job, rank=rank, step=step, world=world, host=f"h{rank // ranks_per_host}",
                    t=t_step + 0.001 * rank, dp=d_, tp=t_, pp=p_, step_s=step_s + extra,
                    compute_s=compute, data_s=0.01,
                    comm_s=0.05 + (extra if late and rank != straggler[0] else 0.0),
                    loss=2.0 + 0.01 * rng.standard_normal(),
                    grad_norm=1.0 + 0.01 * rng.standard_normal(), grad_norm_reduced=1.0,
                    nonfinite=0, param_digest=digest,
                ).to_dict()
            )  # fmt: skip
        t_step += step_s + extra
    return out


def one_step_record(**over) -> dict:
    """One small valid ``step`` record (job j, rank 1 of 4, step 2, one collective), with
    ``over`` applied: the unit the message-decoding tests vary field by field."""
    r = {"v": 1, "type": "step", "job": "j", "rank": 1, "step": 2, "world": 4, "host": "h",
         "t": 1.5, "compute_s": 0.2, "collectives": [{"op": "allreduce", "group": "dp",
         "seq": 3, "s": 0.01}]}  # fmt: skip
    r.update(over)
    return r
