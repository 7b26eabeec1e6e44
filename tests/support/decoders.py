"""Two small decoders for the tests that train a whole model (``tests/test_peak.py``): a
Llama-style one, and a GPT whose feed-forward is a Mixture of Experts with data-dependent
expert shapes and dropout. Each returns its loss from ``model(tokens, targets)``; ``llama()`` and
``moe()`` build one from a fixed seed with its batch.

They are the tests' own (the benchmarks hold the full-size models, ``benchmarks/llama.py`` and
``benchmarks/model.py``; no test outside tests/bench imports those): ``DecoderLayer`` and
``Block`` are the units to checkpoint.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Block", "DecoderLayer", "llama", "moe"]

VOCAB = 256


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight


class Attention(nn.Module):
    """Causal attention; rotary position embeddings when ``seq`` is given (the Llama's)."""

    def __init__(self, dim: int, heads: int, seq: int | None = None):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=seq is None)
        self.out = nn.Linear(dim, dim, bias=seq is None)
        self.rotary = seq is not None
        if self.rotary:
            half = dim // heads // 2
            angles = torch.outer(torch.arange(seq).float(), 1e-4 ** (torch.arange(half).float() / half))
            angles = torch.cat((angles, angles), -1)  # [T, Dh]
            self.register_buffer("cos", angles.cos(), persistent=False)
            self.register_buffer("sin", angles.sin(), persistent=False)

    def _rotate(self, x):  # [B, H, T, Dh]
        a, b = x.chunk(2, -1)
        return x * self.cos[: x.shape[2]] + torch.cat((-b, a), -1) * self.sin[: x.shape[2]]

    def forward(self, x):  # [B, T, D]
        B, T, D = x.shape
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.qkv(x).split(D, -1))
        if self.rotary:
            q, k = self._rotate(q), self._rotate(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, Dh]
        return self.out(y.transpose(1, 2).reshape(B, T, D))


class DecoderLayer(nn.Module):
    """Pre-norm Llama layer: RMSNorm, rotary attention, SwiGLU; no bias, no dropout."""

    def __init__(self, dim: int, heads: int, seq: int):
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(dim), RMSNorm(dim)
        self.attn = Attention(dim, heads, seq)
        hidden = 3 * dim
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Experts(nn.Module):
    """Top-2 routing over 4 GELU experts, each taking the tokens routed to it (``nonzero``:
    shapes follow the data); the router counts its tokens in a buffer."""

    def __init__(self, dim: int, experts: int = 4, hidden: int = 128):
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, dim, hidden) / dim**0.5)
        self.w2 = nn.Parameter(torch.randn(experts, hidden, dim) / hidden**0.5)
        self.register_buffer("tokens_per_expert", torch.zeros(experts, dtype=torch.int64))

    def forward(self, x):  # [B, T, D]
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = self.router(flat).softmax(-1).topk(2, -1)  # [N, 2] each
        weights = weights / weights.sum(-1, keepdim=True)
        self.tokens_per_expert.add_(torch.bincount(chosen.flatten(), minlength=self.w1.shape[0]))
        out = torch.zeros_like(flat)
        for e in range(self.w1.shape[0]):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            y = F.gelu(flat.index_select(0, token) @ self.w1[e]) @ self.w2[e]
            out.index_add_(0, token, y * weights[token, slot].unsqueeze(-1))
        return out.view_as(x)


class Block(nn.Module):
    """Pre-norm GPT block with the MoE feed-forward and dropout (replay must draw the same)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.moe = Experts(dim)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.moe(self.ln2(x)))


class Decoder(nn.Module):
    """Embedding, ``layers`` (an ``nn.Sequential``), final norm, LM head; returns the loss."""

    def __init__(self, layers: list[nn.Module], dim: int, norm: nn.Module):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.layers = nn.Sequential(*layers)
        self.norm = norm
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens, targets):  # [B, T], [B, T]
        logits = self.head(self.norm(self.layers(self.embed(tokens))))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _batch(batch: int, seq: int):
    tokens = torch.randint(VOCAB, (batch, seq + 1), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def llama(layers: int = 3, dim: int = 64, seq: int = 64, batch: int = 2):
    """A seeded small Llama (``DecoderLayer``s) and a batch of token ids with next-token targets."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Decoder([DecoderLayer(dim, 4, seq) for _ in range(layers)], dim, RMSNorm(dim))
    return model, _batch(batch, seq)


def moe(layers: int = 3, dim: int = 64, seq: int = 32, batch: int = 2):
    """A seeded small MoE GPT (``Block``s: data-dependent expert shapes, dropout) and a batch."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Decoder([Block(dim, 4) for _ in range(layers)], dim, nn.LayerNorm(dim))
    return model, _batch(batch, seq)
