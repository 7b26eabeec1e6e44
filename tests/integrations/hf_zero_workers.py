"""A Hugging Face model sharded by ``tracedac.zero`` with ``hf.enable``, on each rank
(imported by spawned processes: top-level).

Each rank trains the tiny model (``benchmarks.hf.build``) on its half of every batch with SGD,
whose update is the gradient scaled, so the parameters show the gradients without an
optimizer's amplification of the last bits. The oracle, ``reference``: the same model,
unsharded and uncheckpointed, in one process, on the mean of the ranks' losses.
"""

from __future__ import annotations

import torch
import torch._dynamo
import torch.distributed as dist

import tracedac.zero as zero
from benchmarks.hf import batch, build, lm_loss
from tracedac.integrations import hf

STEPS, ROWS, LR = 3, 4, 0.1

# (architecture, tied input and output embeddings, shard before enable, compiled)
CASES = (
    ("llama", False, True, False),
    ("llama", True, False, False),  # the tied weight: one parameter under two names, in one unit
    ("mixtral", False, True, False),
    ("llama", False, True, True),
)


def model(kind: str, tied: bool):
    m = build(kind)
    if tied:
        m.config.tie_word_embeddings = True
        m.tie_weights()
    return m


def data(step: int, rank: int, world: int) -> dict:
    per = ROWS // world
    return {k: v[rank * per : (rank + 1) * per] for k, v in batch(ROWS, 16, seed=10 + step).items()}


def reference(kind: str, tied: bool, world: int) -> dict:
    m = model(kind, tied)
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        loss = sum(lm_loss(m, data(step, r, world)) for r in range(world)) / world
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in m.state_dict().items()}}


def train(rank, world, kind, tied, shard_first, compiled) -> dict:
    m = model(kind, tied)
    if shard_first:
        zero.shard(m)
        hf.enable(m)
    else:
        hf.enable(m)
        zero.shard(m)
    call = torch.compile(m, backend="aot_eager_decomp_partition") if compiled else m
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        loss = lm_loss(call, data(step, rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return {"losses": losses, "state": zero.full_state_dict(call)}


def every_case(rank, world) -> dict:
    out = {}
    for case in CASES:
        torch._dynamo.reset()
        out[case] = train(rank, world, *case)
    return out
