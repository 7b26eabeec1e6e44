"""A transformer-style MLP block parallelized with torch's tensor parallel API, and one step of it
under torch's ``CommDebugMode``, for tests/test_tensor_parallel.py and
tests/test_replay_collectives.py.

``"tp"``: the hidden layer split across ranks (``ColwiseParallel`` then ``RowwiseParallel``: an
all-reduce sums the partial outputs); ``"sp"``: sequence parallel around it (the LayerNorm runs
on each rank's slice of the tokens; an all-gather before the hidden layer, a reduce-scatter
after). Its weights and activations are ``DTensor``s. (``benchmarks/tensor_parallel.py`` times
the same block; the tests keep their own.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard, init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import parallelize_module

D = 16
TOKENS = 8


class Block(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)

    def forward(self, x):  # [T, D]
        return x + self.down(F.gelu(self.up(self.norm(x))))


def plan(kind: str) -> dict:
    """torch's tensor-parallel plan of a ``Block``: ``"tp"`` (Colwise then Rowwise) or ``"sp"``
    (sequence parallel around them: the tokens sharded on dim 0 in and out)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if kind == "tp":
        return {"up": ColwiseParallel(), "down": RowwiseParallel()}
    return {
        "norm": SequenceParallel(),
        "up": ColwiseParallel(input_layouts=Shard(0)),
        "down": RowwiseParallel(output_layouts=Shard(0), use_local_output=False),
    }


def setup(rank: int, world: int, kind: str):
    """The parallelized block (same weights on every rank before sharding), the whole batch,
    and a function making this rank's input from it (a sequence-sharded DTensor for "sp")."""
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    block = parallelize_module(Block(D, 32), mesh, plan(kind))
    x = torch.randn(TOKENS, D)

    def inputs(x):
        if kind == "sp":
            return DTensor.from_local(x.chunk(world)[rank], mesh, [Shard(0)])
        return x

    return block, x, inputs


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def step(fn, block, x, inputs):
    """Forward and backward, each under CommDebugMode: (forward counts, backward counts,
    gradients of the whole batch and of every parameter, as full tensors)."""
    xg = x.clone().requires_grad_()
    block.zero_grad()
    with CommDebugMode() as forward:
        loss = full(fn(inputs(xg))).square().sum()
    with CommDebugMode() as backward:
        loss.backward()
    counts = [{str(op): n for op, n in c.get_comm_counts().items() if n} for c in (forward, backward)]
    return *counts, [xg.grad, *(full(p.grad) for p in block.parameters())]


def difference(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))
