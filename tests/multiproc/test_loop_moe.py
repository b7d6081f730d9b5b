"""A mixture of experts with expert parallelism, on real gloo ranks.

The ranks are replicas only in their dense weights: each holds its own expert,
which DDP is told to ignore. The digest and the reduced norm must cover the
replicated weights alone (else no two ranks ever agree and the replica votes
go blind), and the token all-to-alls must be timed whichever API moves them
(``torch.distributed.all_to_all_single`` or the functional ``all_to_all_single_autograd``,
whose waits were compute before). Faults as in ``test_loop_styles.py``.
"""

from __future__ import annotations

import pytest
from support.loops.harness import findings, run_loop
from support.loops.model import Opts
from test_loop_styles import (
    CLEAN,
    FAULTS,
    FLIP_RANK,
    FLIP_STEP,
    STEPS,
    _assert_common,
    _assert_located,
)

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize("functional", [False, True], ids=["c10d", "functional"])
def test_expert_parallel_moe_under_ddp(tmp_path, functional):
    world = 4
    steps, info = run_loop("moe_ep", world, tmp_path, opts=Opts(steps=STEPS), faults=FAULTS,
                           build_kw={"functional": functional})  # fmt: skip
    _assert_common(steps, info, world)
    for s in CLEAN:
        recs = [steps[s][r] for r in range(world)]
        assert len({r["param_digest"] for r in recs}) == 1  # the dense replicas agree
        assert len({r["grad_norm_reduced"] for r in recs}) == 1
        for r in recs:
            a2a = [c for c in r["collectives"] if c["op"] == "alltoall"]
            counts = [c for c in a2a if c["bytes"] == 8 * world]
            tokens = [c for c in a2a if c["bytes"] != 8 * world]
            assert len(counts) == 1, a2a  # the counts, then the tokens there and back
            assert len(tokens) == (2 if functional else 4), a2a  # backward: c10d only
            assert sum(c["s"] for c in tokens) > 0
    assert steps[FLIP_STEP][FLIP_RANK]["param_digest"] != steps[FLIP_STEP][0]["param_digest"]
    _assert_located(findings(tmp_path / "trace"), flip=True)
