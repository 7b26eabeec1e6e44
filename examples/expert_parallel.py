"""Expert parallel with tracedac.zero, checkpointed, saved and resumed, on 2 gloo ranks.

    python examples/expert_parallel.py      # from the clone's root; starts its own 2 ranks on the CPU

Each rank holds half of every block's experts, in a ``ModuleDict`` keyed by the expert's
global index (rank 0 ``experts.0``, ``experts.1``; rank 1 ``experts.2``, ``experts.3``): a
checkpoint holds one value per key, so experts named alike on every rank would overwrite each
other. Tokens travel to their expert's rank and back with ``all_to_all_single_autograd``
(uneven splits). The experts are sharded by ``tracedac.zero`` over a process group of their
rank alone, the rest of the model over both ranks, and every block is a tracedac region:
backward sends no all-to-all again and the routers count each token once. After a few AdamW
steps a checkpoint is saved, loaded into a fresh model and optimizer, and the steps after it
are taken again: the losses and parameters are the same to the bit.
"""

from __future__ import annotations

import datetime
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed import _functional_collectives as fc

import tracedac
import tracedac.zero as zero
from tracedac import policies

DIM, HIDDEN, EXPERTS, LAYERS = 32, 64, 4, 2
BATCH, STEPS, SAVE_AFTER = 16, 4, 2  # tokens a rank; AdamW steps; the step the checkpoint holds
WORLD = 2


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, x):  # [n, D]
        return self.down(F.gelu(self.up(x)))


class MoE(nn.Module):
    """Top-1 routing; this rank's experts, keyed by global index; counts its tokens per expert."""

    def __init__(self, rank, world):
        super().__init__()
        self.world, self.per = world, EXPERTS // world
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        every = [Expert() for _ in range(EXPERTS)]  # built on every rank alike (same seed), then kept
        mine = range(rank * self.per, (rank + 1) * self.per)
        self.experts = nn.ModuleDict({str(e): every[e] for e in mine})
        self.register_buffer("tokens_per_expert", torch.zeros(EXPERTS, dtype=torch.long), persistent=False)

    def forward(self, x):  # [N, D]
        weight, expert = self.router(x).softmax(-1).max(-1)  # [N], [N]
        self.tokens_per_expert.add_(torch.bincount(expert, minlength=EXPERTS))  # once per step
        order = expert.argsort(stable=True)  # grouped by expert, so by the rank that holds it
        group = dist.group.WORLD
        send = torch.bincount(expert // self.per, minlength=self.world)  # [world]
        recv = fc.all_to_all_single(send, None, None, group)
        send, recv = send.tolist(), recv.tolist()  # uneven, and not the same on every rank
        tokens = fc.all_to_all_single_autograd(x[order], recv, send, group)  # [M, D]
        ids = fc.all_to_all_single(expert[order], recv, send, group)  # [M]: each token's expert
        by_expert = ids.argsort(stable=True)
        sizes = torch.bincount(ids % self.per, minlength=self.per).tolist()
        outs = [e(chunk) for e, chunk in zip(self.experts.values(), tokens[by_expert].split(sizes))]
        out = torch.zeros_like(tokens).index_copy(0, by_expert, torch.cat(outs))  # [M, D]
        back = fc.all_to_all_single_autograd(out, send, recv, group)  # [N, D], in ``order``
        return torch.zeros_like(x).index_copy(0, order, back) * weight.unsqueeze(-1)


class Block(nn.Module):
    def __init__(self, rank, world):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.moe = MoE(rank, world)
        self.mlp = nn.Linear(DIM, DIM)

    def forward(self, x):  # [N, D]
        x = x + self.moe(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Model(nn.Module):
    def __init__(self, rank, world):
        super().__init__()
        torch.manual_seed(0)  # every rank builds the same dense weights and the same experts
        self.blocks = nn.ModuleList(Block(rank, world) for _ in range(LAYERS))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x):  # [N, D] -> [N]
        for block in self.blocks:
            x = block(x)
        return self.head(x).squeeze(-1)


def build(rank, world):
    """The model on this rank: experts sharded over their own rank, the rest over every rank,
    every block a tracedac region; and its optimizer."""
    own = [dist.new_group([r]) for r in range(world)][rank]  # every rank makes every group
    model = Model(rank, world)
    for block in model.blocks:  # this rank's experts, keyed by global index ("experts.2", ...)
        zero.shard(block.moe.experts, group=own)
    zero.shard(model)  # the dense parts, over every rank
    tracedac.wrap(model, Block, policy=policies.recompute_all())
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def step(model, opt, rank, world, i):
    """One AdamW step on this rank's tokens; returns the mean loss over the ranks."""
    g = torch.Generator().manual_seed(100 * i + rank)
    x, y = torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, generator=g)
    loss = F.mse_loss(model(x), y)
    loss.backward()
    # zero averaged the dense gradients over the ranks; an expert's gradient sums every rank's
    # tokens (they came to it): divide by the data-parallel size (torchtitan's gradient_divide_factor)
    for block in model.blocks:
        for p in block.moe.experts.parameters():
            p.grad.div_(world)
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / world


def run(rank, world, tmp):
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp}/init",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    torch.set_num_threads(1)
    model, opt = build(rank, world)
    losses = []
    for i in range(STEPS):
        losses.append(step(model, opt, rank, world, i))
        if i + 1 == SAVE_AFTER:
            zero.save_checkpoint(f"{tmp}/ckpt", model, opt)  # each rank writes its shards and experts
    counts = torch.stack([b.moe.tokens_per_expert for b in model.blocks])  # [LAYERS, EXPERTS]
    dist.all_reduce(counts)

    fresh, fresh_opt = build(rank, world)
    zero.load_checkpoint(f"{tmp}/ckpt", fresh, fresh_opt)  # checks every key, shape and dtype
    resumed = [step(fresh, fresh_opt, rank, world, i) for i in range(SAVE_AFTER, STEPS)]
    exact = resumed == losses[SAVE_AFTER:] and all(
        torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(model.parameters(), fresh.parameters())
    )
    flags = torch.tensor([int(exact)])
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    if rank == 0:
        print(f"{world} ranks, experts on rank 0: {sorted(model.blocks[0].moe.experts)}")
        print("losses:", " ".join(f"{x:.6f}" for x in losses))
        print(f"resumed after step {SAVE_AFTER}:", " ".join(f"{x:.6f}" for x in resumed))
        print(f"tokens counted per block: {counts.sum(1).tolist()} (true {world * BATCH * STEPS} each)")
        print("resume exact on every rank:", bool(flags.item()))
    leave()


def leave():
    """Out of this rank at once, every rank past a barrier and the output flushed, without
    ``destroy_process_group`` and the interpreter's teardown. Gloo's worker threads can let go
    of a finished collective's tensors while the interpreter finalizes, and take the GIL to do
    it, which aborts the process ("terminate called without an active exception", after every
    line above was printed: once in tracedac's CI; pytorch/pytorch#179291). Destroying the
    process groups first would prevent it, but ``destroy_process_group`` cannot here: DTensor's
    caches hold the sharded parameters' meshes, and so the groups and their threads, past it."""
    dist.barrier()  # no rank still talks to another
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main():
    with tempfile.TemporaryDirectory() as tmp:  # the rendezvous file and the checkpoint
        mp.spawn(run, args=(WORLD, tmp), nprocs=WORLD)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
