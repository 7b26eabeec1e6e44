"""The Llama 4 / DeepSeek case: an MoE block with auxiliary-loss-free load balancing, for
tests/zero/test_moe_compile.py and tests/test_offload_planner.py.

``expert_bias`` (a buffer) shifts the router's top-k choice only, the block counts
``tokens_per_expert`` in its forward, and after the optimizer step the bias moves toward the
under-used experts, ``bias += rate * sign(mean(counts) - counts)``, from the counts summed over
ranks (``reduce``). The oracle of a test: the same model unsharded, uncheckpointed, eager, on
the whole batch, step by step (``train(oracle, oracle, 0, 1, lambda t: t)``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

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


def train(model, call, rank, world, reduce):
    """Per step: (the loss of the whole batch, the token counts summed by ``reduce`` over ranks,
    the bias after the step)."""
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
