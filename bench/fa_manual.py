"""A loop that averages its gradients itself, with no DDP wrapper.

``manual``: the shape of PyTorch's "Writing Distributed Applications with
PyTorch" tutorial and of much research code: a small convolutional net on
MNIST-sized images split across ranks, the plain module (no
``DistributedDataParallel``), and after ``loss.backward()`` an
``average_gradients`` that all-reduces every parameter's ``.grad`` in place
(one ``dist.all_reduce`` per parameter, ``SUM`` then divided by the world
size); SGD with momentum.

There is no DDP bucket to read the local gradient from, and by the
optimizer step ``.grad`` holds the average: the collector has to see each
gradient before its all-reduce to know what this rank computed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["LOOPS"]


class Net(nn.Module):
    """The tutorial's MNIST net: two convolutions with max-pooling, dropout, two
    linear layers, log-softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = F.relu(self.fc1(x.flatten(1)))
        x = F.dropout(x, training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)


def average_gradients(model: nn.Module) -> None:
    """The tutorial's gradient averaging: one all-reduce per parameter."""
    size = float(dist.get_world_size())
    for param in model.parameters():
        if param.grad is None:
            continue
        dist.all_reduce(param.grad.data, op=dist.ReduceOp.SUM)
        param.grad.data /= size


class ManualLoop:
    """``step()`` is one batch: forward, NLL loss, backward, average, SGD step."""

    style = "manual"
    ddp = False  # no comm hook: the slow link wraps the loop's own all-reduce
    nan_in_grad = True  # a local gradient can be poisoned before the loop reduces it
    reduce_op = "all_reduce"
    topology = None
    faults = ("straggler", "sdc-param", "nonfinite", "network")

    def __init__(self, rank: int, world: int, seed: int, steps: int) -> None:
        torch.manual_seed(seed)  # same initial weights on every rank
        self.model = Net()
        gen = torch.Generator().manual_seed(seed * 1000 + rank)  # this rank's partition
        self.images = torch.randn(2048, 1, 28, 28, generator=gen)
        self.targets = torch.randint(0, 10, (2048,), generator=gen)
        self.gen, self.batch, self.pos = gen, 32, 0
        torch.manual_seed(seed * 1000 + rank)  # dropout masks differ per rank

    def wrap(self) -> nn.Module:
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.5)
        return self.model

    def attributable(self, kind: str, rank: int) -> list[int]:
        return [rank]

    def step(self, it: int, rc) -> None:
        if self.pos + self.batch > len(self.images):  # next epoch, reshuffled
            perm = torch.randperm(len(self.images), generator=self.gen)
            self.images, self.targets, self.pos = self.images[perm], self.targets[perm], 0
        x = self.images[self.pos : self.pos + self.batch]
        y = self.targets[self.pos : self.pos + self.batch]
        self.pos += self.batch
        self.opt.zero_grad()
        loss = F.nll_loss(self.model(x), y)
        loss.backward()
        average_gradients(self.model)
        self.opt.step()
        rc.loss(loss.detach())


LOOPS = {"manual": ManualLoop}
