"""Collectives a module imported by name before attach are recorded too.

torchtitan's MoE token dispatcher does ``from torch.distributed._functional_collectives
import all_to_all_single``: before ``collectors/rank/by_name.py`` its expert
all-to-alls had no entries (a real torchtitan 0.3 run, EP 2 over 4 gloo ranks:
none of its 30 per step). Here a module made the same way, before attach, calls
the functional all-to-all and ``torch.distributed.all_reduce`` by name: both are
recorded, and close gives the module its originals back.
"""

from __future__ import annotations

import queue
import sys
import types

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from rankscope.collectors import RankCollector
from rankscope.collectors.rank.by_name import rebind, restore
from rankscope.collectors.sinks.embedded import iter_channel, register_channel, unregister_channel


def _user_module(name: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.all_to_all_single = funcol.all_to_all_single  # as ``from ... import`` binds it
    mod.all_reduce = dist.all_reduce
    sys.modules[name] = mod
    return mod


def test_collectives_imported_by_name_are_recorded_and_restored(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    user = _user_module("user_moe_dispatch")
    orig_a2a, orig_ar = user.all_to_all_single, user.all_reduce
    q: queue.Queue = queue.Queue()
    register_channel("by-name", q)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rc = RankCollector.attach(model, opt, job="b", sink="embedded://by-name")
    try:
        assert user.all_to_all_single is not orig_a2a and user.all_reduce is not orig_ar
        for _ in range(2):
            y = model(torch.randn(2, 4))
            routed = user.all_to_all_single(y.detach(), None, None, group=dist.group.WORLD)
            (y * routed).sum().backward()  # the result's first use waits for it
            user.all_reduce(model.weight.grad)
            opt.step()
            opt.zero_grad()
    finally:
        rc.close()
        unregister_channel("by-name")
        sys.modules.pop("user_moe_dispatch", None)
        dist.destroy_process_group()
    assert user.all_to_all_single is orig_a2a and user.all_reduce is orig_ar
    steps = [r for r in iter_channel(q) if r["type"] == "step"]
    assert len(steps) == 2
    for r in steps:
        ops = [c["op"] for c in r["collectives"]]
        assert ops.count("alltoall") == 1 and ops.count("allreduce") == 1, ops


def test_torch_and_rankscope_modules_keep_their_references():
    def orig():
        return "orig"

    def wrapper():
        return "wrapped"

    names = ("torch._fake_by_name", "rankscope._fake_by_name", "user_by_name")
    mods = [types.ModuleType(n) for n in names]
    for n, m in zip(names, mods, strict=True):
        m.fn = m.alias = orig
        sys.modules[n] = m
    try:
        done = rebind({"fn": orig}, {"fn": wrapper})
        assert [m.fn is wrapper for m in mods] == [False, False, True]
        assert mods[2].alias is wrapper  # under any name
        mods[2].alias = "replaced since"  # someone else's since: left alone
        restore(done)
        assert mods[2].fn is orig and mods[2].alias == "replaced since" and done == []
    finally:
        for n in names:
            sys.modules.pop(n, None)
