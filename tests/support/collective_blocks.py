"""Blocks that talk to the other ranks inside a checkpointed region, and one step of each
under torch's ``CommDebugMode`` (which counts functional collectives), for the tests of
collectives in regions (tests/test_collectives_in_regions.py, tests/test_replay_collectives.py).

``MoE``: expert parallelism with one expert per rank (tokens routed with uneven all-to-all
splits, through this rank's expert, and back). ``RowParallel``: a tensor-parallel MLP whose
partial outputs an all-reduce sums. ``GlobalScale``: a statistic summed over ranks in place by
``torch.distributed.all_reduce``. ``step`` returns the collectives counted in forward and in
backward and the gradients; ``difference`` the largest gradient difference.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import _functional_collectives as fc
from torch.distributed.tensor.debug import CommDebugMode

from tracedac import policies

D = 16
TOKENS = 12
POLICIES = {
    "recompute_all": policies.recompute_all,
    "save_matmuls": policies.save_matmuls,
    "memory_budget(0.3)": lambda: policies.memory_budget(0.3),
    "min_cut": policies.min_cut,
}


class MoE(nn.Module):
    """One expert per rank. The router sends each token to a rank (uneven splits, different on
    every rank); the token goes there, through that rank's expert, and back, weighted by its
    router probability. ``sizes`` (send, receive) are exchanged here with a functional
    all-to-all unless given (a compiled graph takes them as constants)."""

    def __init__(self, world: int, d: int = D, h: int = 32):
        super().__init__()
        self.world = world
        self.router = nn.Linear(d, world, bias=False)
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)

    def forward(self, x, sizes=None):
        group = dist.group.WORLD
        weight, dest = self.router(x).softmax(-1).max(-1)
        order = dest.argsort(stable=True)
        if sizes is None:
            send = torch.bincount(dest, minlength=self.world)
            sizes = send.tolist(), fc.all_to_all_single(send, None, None, group).tolist()
        send, recv = sizes
        tokens = fc.all_to_all_single_autograd(x[order], recv, send, group)
        out = self.down(F.gelu(self.up(tokens)))
        back = fc.all_to_all_single_autograd(out, send, recv, group)
        y = torch.zeros_like(back).index_copy(0, order, back)
        return x + y * weight.unsqueeze(-1)


class RowParallel(nn.Module):
    """A tensor-parallel MLP: each rank holds a slice of the hidden layer, and an all-reduce
    sums the slices' outputs."""

    def __init__(self, d: int = D, h: int = 16):
        super().__init__()
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d, bias=False)

    def forward(self, x):
        y = fc.all_reduce(self.down(F.gelu(self.up(x))), "sum", dist.group.WORLD)
        return x + y.sigmoid() * y


class GlobalScale(nn.Module):
    """A statistic summed over ranks in place with ``torch.distributed.all_reduce`` (a c10d
    collective, as a global norm or a token counter is), which backward then reads."""

    def __init__(self, d: int = D):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        h = self.lin(x)
        total = h.detach().square().sum(0)
        dist.all_reduce(total)
        return h * total.rsqrt()


def inputs(rank: int, make):
    """The block (same parameters on every rank) and this rank's tokens."""
    torch.manual_seed(0)
    block = make()
    torch.manual_seed(1 + rank)
    return block, torch.randn(TOKENS, D)


def sizes_of(block: MoE, x):
    """The (send, receive) split sizes ``block`` routes ``x`` with, exchanged outside any graph."""
    with torch.no_grad():
        send = torch.bincount(block.router(x).argmax(-1), minlength=block.world)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    return send.tolist(), recv.tolist()


def step(block, x, *args):
    """Forward and backward, each under CommDebugMode: (forward counts, backward counts, grads)."""
    x = x.clone().requires_grad_()
    block.zero_grad()
    with CommDebugMode() as forward:
        loss = block(x, *args).square().sum()
    with CommDebugMode() as backward:
        loss.backward()
    counts = [{str(op): n for op, n in c.get_comm_counts().items() if n} for c in (forward, backward)]
    return *counts, [x.grad, *(p.grad for p in block.parameters())]


def difference(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))
