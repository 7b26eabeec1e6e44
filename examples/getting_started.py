"""Getting started: checkpoint a model's blocks with tracedac, train, and see what is kept.

    python examples/getting_started.py      # from the clone's root; CPU, a few seconds

A small pre-norm transformer whose feed-forward is a Mixture of Experts. Its router counts the
tokens it sends to each expert in its forward (``tokens_per_expert.add_``), as the load
balancing of Llama 4 and DeepSeek-V3 does. Checkpointed by tracedac, the forward runs once and
backward replays recorded ops, so the count is right; ``torch.utils.checkpoint`` runs the
block's Python again in backward and counts every token twice.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import tracedac
from tracedac import policies

DIM, HEADS, EXPERTS, LAYERS, VOCAB = 64, 4, 4, 2, 128
BATCH, SEQ, STEPS = 4, 32, 3


class MoE(nn.Module):
    """Top-1 routing to ``EXPERTS`` expert MLPs; counts the tokens each expert gets."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM)) for _ in range(EXPERTS)
        )
        self.register_buffer("tokens_per_expert", torch.zeros(EXPERTS, dtype=torch.long))

    def forward(self, x):  # [N, D]
        weight, expert = self.router(x).softmax(-1).max(-1)  # [N], [N]
        self.tokens_per_expert.add_(torch.bincount(expert, minlength=EXPERTS))  # a side effect
        out = torch.zeros_like(x)
        for e, mlp in enumerate(self.experts):
            rows = (expert == e).nonzero().squeeze(-1)  # [n_e]
            out = out.index_add(0, rows, mlp(x[rows]) * weight[rows, None])
        return out


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.out = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.moe = MoE()

    def forward(self, x):  # [B, T, D]
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, HEADS, DIM // HEADS).transpose(1, 3).unbind(2)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, D/H]
        x = x + self.out(attn.transpose(1, 2).reshape(b, t, DIM))
        return x + self.moe(self.norm2(x).view(b * t, DIM)).view(b, t, DIM)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):  # [B, T]
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)  # [B, T, VOCAB]


def train(model, data, steps=STEPS):
    """AdamW steps of next-token prediction; returns the losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for tokens in data[:steps]:
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def counted(model):
    """Tokens the routers counted, over every MoE in the model."""
    return sum(int(m.tokens_per_expert.sum()) for m in model.modules() if isinstance(m, MoE))


class TorchCheckpointed(nn.Module):
    """A block under ``torch.utils.checkpoint``, for comparison."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def main():
    torch.manual_seed(0)
    plain = Model()
    model = copy.deepcopy(plain)
    tracedac.wrap(model, Block, policy=policies.save_matmuls())  # every Block is a region
    torch_model = copy.deepcopy(plain)
    torch_model.blocks = nn.ModuleList(TorchCheckpointed(b) for b in torch_model.blocks)
    data = [torch.randint(0, VOCAB, (BATCH, SEQ + 1)) for _ in range(STEPS)]

    reference = train(plain, data)  # no checkpointing
    losses = train(model, data)
    train(torch_model, data)
    print("losses, no checkpoint:", " ".join(f"{x:.6f}" for x in reference))
    print("losses, tracedac:     ", " ".join(f"{x:.6f}" for x in losses))
    same = all(torch.equal(a, b) for a, b in zip(plain.parameters(), model.parameters()))
    print("parameters equal to no checkpointing:", same)
    true = STEPS * BATCH * SEQ * LAYERS
    print(
        f"tokens counted: true {true}, tracedac {counted(model)}, torch's checkpoint {counted(torch_model)}"
    )

    # What one block keeps for backward: a table, then the same as data under two planners.
    x = torch.randn(BATCH, SEQ, DIM)
    tracedac.print_saved(Block(), x, policy=policies.save_matmuls())
    for planner in (policies.memory_budget(0.3), policies.min_cut()):  # planners: the whole graph
        report = tracedac.saved_report(Block(), x, policy=planner)
        print(f"{planner}: keeps {report.kept_bytes} bytes, replays {report.replay_ops} ops")


if __name__ == "__main__":
    main()
