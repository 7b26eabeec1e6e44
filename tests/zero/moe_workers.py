"""The Llama 4 / DeepSeek case on each rank (imported by spawned processes: top-level).

An MoE block with auxiliary-loss-free load balancing: ``expert_bias`` (a buffer) shifts the
router's top-k choice only, the block counts ``tokens_per_expert`` in its forward, and after
the optimizer step the bias moves toward the under-used experts, ``bias += rate *
sign(mean(counts) - counts)``, from the counts summed over ranks. Each block is checkpointed
by tracedac, the model sharded by ``zero.shard`` and each block compiled with
``fullgraph=True`` (torchtitan's order). The oracle: the same model unsharded, uncheckpointed,
eager, on the whole batch, step by step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tracedac
import tracedac.zero as zero

D, E, H, K = 16, 4, 24, 2  # width, experts, expert hidden, experts per token
BATCH, STEPS, RATE = 16, 4, 1e-2


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.router = nn.Linear(D, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, D, H) * 0.2)
        self.w2 = nn.Parameter(torch.randn(E, H, D) * 0.2)
        self.register_buffer("expert_bias", torch.zeros(E))
        self.register_buffer("tokens_per_expert", torch.zeros(E))

    def forward(self, x):  # [T, D]
        h = self.norm(x)
        scores = torch.sigmoid(self.router(h))  # [T, E]
        _, chosen = torch.topk(scores + self.expert_bias, K, dim=-1)  # the bias picks, never weighs
        weight = scores.gather(-1, chosen)
        weight = weight / weight.sum(-1, keepdim=True)  # [T, K]
        onehot = F.one_hot(chosen, E).to(x.dtype)  # [T, K, E]
        self.tokens_per_expert.add_(onehot.detach().sum((0, 1)))
        gate = (onehot * weight.unsqueeze(-1)).sum(1)  # [T, E]: static shapes, every expert runs
        out = torch.einsum("teh,ehd->ted", torch.einsum("td,edh->teh", h, self.w1).relu(), self.w2)
        return x + (gate.unsqueeze(-1) * out).sum(1)


class Model(nn.Module):
    def __init__(self, n=2):
        super().__init__()
        self.embed = nn.Linear(D, D)
        self.blocks = nn.ModuleList(MoE() for _ in range(n))
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h).squeeze(-1)


def _batch(step):
    g = torch.Generator().manual_seed(7 + step)
    return torch.randn(BATCH, D, generator=g), torch.randn(BATCH, generator=g)


def _update_bias(model, reduce) -> None:
    """After the optimizer step: the bias from the counts of every rank, then the counts reset."""
    with torch.no_grad():
        for b in model.blocks:
            counts = reduce(b.tokens_per_expert.clone())
            b.expert_bias.add_(RATE * torch.sign(counts.mean() - counts))
            b.tokens_per_expert.zero_()


def _train(model, call, rank, world, reduce):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    per = BATCH // world
    out = []
    for step in range(STEPS):
        x, y = _batch(step)
        loss = F.mse_loss(call(x[rank * per : (rank + 1) * per]), y[rank * per : (rank + 1) * per])
        loss.backward()
        opt.step()
        opt.zero_grad()
        counts = [reduce(b.tokens_per_expert.clone()) for b in model.blocks]
        _update_bias(model, reduce)
        out.append(
            (reduce(loss.detach()).item() / world, counts, [b.expert_bias.clone() for b in model.blocks])
        )
    return out


def llama4_case(rank, world, backend="aot_eager_decomp_partition"):
    """Per step (loss, counts, bias) of the eager oracle and of the sharded, checkpointed,
    compiled model; dynamo's graph breaks and graphs; the tracedac ops in the blocks' graphs."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    oracle = Model()
    model = Model()
    model.load_state_dict(oracle.state_dict())
    want = _train(oracle, oracle, 0, 1, lambda t: t)

    for b in model.blocks:
        tracedac.checkpoint(b)
    zero.shard(model)
    torch._dynamo.reset()
    counters.clear()
    seen: set = set()

    def keep_ops(gm, example_inputs):  # the graphs dynamo hands the backend: their tracedac ops
        seen.update(
            str(n.target).removesuffix(".default")
            for n in gm.graph.nodes
            if str(n.target).startswith("tracedac.")
        )
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    for b in model.blocks:
        b.compile(fullgraph=True, backend=keep_ops)

    def reduce(t):
        dist.all_reduce(t)
        return t

    got = _train(model, model, rank, world, reduce)
    return want, got, sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"], seen
