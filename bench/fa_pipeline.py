"""A torchtitan-like pipelined loop for the false-alarm bench: PP 2 x DP 2.

The small Llama of ``fa_sharded`` split in two stages (embeddings and the first
block; the second block, the norm and the output), one
``torch.distributed.pipelining.PipelineStage`` per rank on the ``pp`` group,
each stage replicated over ``dp`` with FSDP2 on a ``(dp_replicate, dp_shard)``
mesh of shard size 1 (how torchtitan data-parallelizes a stage), and a 1F1B
schedule over four micro-batches; the last stage computes the loss. Ranks 0-1
are stage 0, ranks 2-3 stage 1.

``ppi``: the interleaved schedule (``InterleavedLoop``), two stages per rank.

Faults it can localize: a straggler (a stage's rank slow; its pipeline partner
only waits, and must not be named) and a slow link (the stage's gradient
all-reduce over its replicas). A flipped weight has one replica to disagree
with, and a NaN travels the pipeline both ways in one step (the activations
forward, the gradients back): neither is attributable to one rank here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from fa_sharded import BATCH, SEQ, VOCAB, TinyLlama, _TitanLoop
from torch import nn

__all__ = ["LOOPS"]

MICROBATCHES = 4


class _First(nn.Module):
    def __init__(self, lm: TinyLlama) -> None:
        super().__init__()
        self.tok_embeddings, self.layer = lm.tok_embeddings, lm.layers[0]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.layer(self.tok_embeddings(tokens))


class _Last(nn.Module):
    def __init__(self, lm: TinyLlama) -> None:
        super().__init__()
        self.layers = nn.ModuleList(lm.layers[1:])
        self.norm, self.output = lm.norm, lm.output

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


class PPLoop(_TitanLoop):
    """Two pipeline stages, each over two data-parallel replicas, 1F1B."""

    style = "pp"
    pp = 2
    clip = False  # a stage's clip_grad_norm_ sees only its own stage's gradients
    faults = ("straggler", "network")
    reduce_op = "all_reduce"  # replicas of a stage (shard size 1) all-reduce their grads

    def wrap(self) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        if self.world % self.pp:
            raise ValueError(f"pp style: world {self.world} is not a multiple of pp {self.pp}")
        mesh = init_device_mesh("cpu", (self.pp, self.world // self.pp, 1),
                                mesh_dim_names=("pp", "dp_replicate", "dp_shard"))  # fmt: skip
        stage = mesh["pp"].get_local_rank()
        self.last = stage == self.pp - 1
        self.model = _Last(self.model) if self.last else _First(self.model)
        fully_shard(self.model, mesh=mesh["dp_replicate", "dp_shard"], reshard_after_forward=False)
        pipe = PipelineStage(self.model, stage, self.pp, torch.device("cpu"),
                             group=mesh["pp"].get_group())  # fmt: skip
        self.schedule = Schedule1F1B(pipe, n_microbatches=MICROBATCHES, loss_fn=_loss)
        self.topology = mesh
        return self._finish(mesh["dp_replicate"].get_local_rank())

    def step(self, it: int, rc) -> None:
        ix = torch.randint(len(self.data) - SEQ - 1, (BATCH,), generator=self.gen)
        x = torch.stack([self.data[i : i + SEQ] for i in ix])
        y = torch.stack([self.data[i + 1 : i + 1 + SEQ] for i in ix])
        if self.last:
            losses: list[torch.Tensor] = []
            self.schedule.step(target=y, losses=losses)
            rc.loss(torch.stack(losses).mean().detach())
        else:
            self.schedule.step(x)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad()


class _Part(nn.Module):
    """One of ``ppi``'s four stages: the embeddings, a block, or the norm and output."""

    def __init__(self, *mods: nn.Module) -> None:
        super().__init__()
        self.mods = nn.ModuleList(mods)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for m in self.mods:
            h = m(h)
        return h


class InterleavedLoop(PPLoop):
    """torchtitan's interleaved pipeline: four stages over two pp ranks (rank p holds
    stages p and p + 2), ``ScheduleInterleaved1F1B``, the blocks under activation
    checkpointing, each stage FSDP2-replicated over dp; the collector gets the list
    of the rank's stages (torchtitan's ``model_parts``)."""

    style = "ppi"

    def wrap(self) -> list[nn.Module]:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            checkpoint_wrapper,
        )
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

        if self.world % self.pp:
            raise ValueError(f"ppi style: world {self.world} is not a multiple of pp {self.pp}")
        mesh = init_device_mesh("cpu", (self.pp, self.world // self.pp, 1),
                                mesh_dim_names=("pp", "dp_replicate", "dp_shard"))  # fmt: skip
        lm, n = self.model, 2 * self.pp
        every = [_Part(lm.tok_embeddings), *(_Part(checkpoint_wrapper(b)) for b in lm.layers),
                 _Part(lm.norm, lm.output)]  # fmt: skip
        if len(every) != n:
            raise ValueError(f"ppi style: {len(every)} stages for {n} (pp {self.pp} x 2)")
        p = mesh["pp"].get_local_rank()
        held = [p, p + self.pp]
        self.last = n - 1 in held
        stages = []
        for i in held:
            fully_shard(every[i], mesh=mesh["dp_replicate", "dp_shard"],
                        reshard_after_forward=False)  # fmt: skip
            stages.append(PipelineStage(every[i], i, n, torch.device("cpu"),
                                        group=mesh["pp"].get_group()))  # fmt: skip
        self.model = nn.ModuleList(every[i] for i in held)
        self.schedule = ScheduleInterleaved1F1B(stages, n_microbatches=MICROBATCHES,
                                                loss_fn=_loss)  # fmt: skip
        self.topology = mesh
        self._finish(mesh["dp_replicate"].get_local_rank())
        return list(self.model)


LOOPS = {"pp": PPLoop, "ppi": InterleavedLoop}
