"""The planner benchmark's model: a small Llama-style decoder.

Pre-norm decoder layers as in Llama: RMSNorm, rotary position embeddings on queries and
keys, causal attention through ``F.scaled_dot_product_attention``, a SwiGLU feed-forward,
no biases anywhere. No dropout, so every run of a step computes the same numbers.

``DecoderLayer`` is the unit to checkpoint. ``Llama.layers`` is an ``nn.Sequential``, so
``model.layers(x)`` runs the layers alone: the region stack whose memory the benchmark
measures. The rotary tables are buffers computed once at construction, so they are alive
before any forward and no region creates them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .model import Seeded, make_batch  # the same seeding and batch recipe as the MoE model

__all__ = ["DecoderLayer", "Llama", "LlamaConfig", "make_batch"]


@dataclass(frozen=True)
class LlamaConfig:
    """Model and batch sizes; the defaults are the issue's: 2 layers, hidden 256, 4 x 128 tokens."""

    vocab: int = 1024
    layers: int = 2
    dim: int = 256
    heads: int = 4
    mlp_hidden: int = 704  # Llama's 8/3 x dim (683) rounded up to a multiple of 64
    batch: int = 4
    seq: int = 128
    rope_theta: float = 10000.0
    eps: float = 1e-5
    seed: int = 0

    def check(self) -> None:
        """Raise a ValueError naming the first size that cannot build a model."""
        for name in ("vocab", "layers", "dim", "heads", "mlp_hidden", "batch", "seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"LlamaConfig.{name} must be at least 1, got {getattr(self, name)}")
        if self.dim % self.heads or (self.dim // self.heads) % 2:
            raise ValueError(
                f"dim={self.dim} must split into heads={self.heads} heads of an even width "
                "(rotary embeddings rotate pairs of channels); pick dim a multiple of 2 x heads."
            )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, D]
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotary_tables(cfg: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    half = cfg.dim // cfg.heads // 2
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(half, dtype=torch.float32) / half)  # [Dh/2]
    angles = torch.outer(torch.arange(cfg.seq, dtype=torch.float32), inv_freq)  # [T, Dh/2]
    angles = torch.cat((angles, angles), dim=-1)  # [T, Dh]
    return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:  # [B, H, T, Dh]
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.heads = cfg.heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        cos, sin = _rotary_tables(cfg)
        # Buffers, not recomputed per forward: alive before the region, outside every budget.
        self.register_buffer("cos", cos, persistent=False)  # [T, Dh]
        self.register_buffer("sin", sin, persistent=False)  # [T, Dh]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, D]
        B, T, D = x.shape
        q, k, v = (
            w(x).view(B, T, self.heads, D // self.heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )  # [B, H, T, Dh] each
        cos, sin = self.cos[:T], self.sin[:T]  # [T, Dh]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, Dh]
        return self.wo(y.transpose(1, 2).reshape(B, T, D))  # [B, T, D]


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.mlp_hidden, bias=False)  # gate
        self.w3 = nn.Linear(cfg.dim, cfg.mlp_hidden, bias=False)  # up
        self.w2 = nn.Linear(cfg.mlp_hidden, cfg.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, D]
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # [B, T, D]


class DecoderLayer(nn.Module):
    """One pre-norm Llama layer: the unit the planner benchmark checkpoints."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, D]
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))  # [B, T, D]


class Llama(Seeded, nn.Module):
    """Token embedding, ``layers`` decoder layers, final RMSNorm, LM head; returns the loss."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        cfg.check()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.Sequential(*(DecoderLayer(cfg) for _ in range(cfg.layers)))
        self.norm = RMSNorm(cfg.dim, cfg.eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # [B, T], [B, T]
        if idx.shape[1] > self.cfg.seq:
            raise ValueError(
                f"got sequences of {idx.shape[1]} tokens but the rotary tables cover {self.cfg.seq}; "
                "build the model with LlamaConfig(seq=...) at least that long."
            )
        x = self.layers(self.embed(idx))  # [B, T, D]
        logits = self.head(self.norm(x))  # [B, T, V]
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
