"""The benchmark's default model: a small GPT whose feed-forward is a Mixture of Experts.

Pre-norm blocks (LayerNorm, causal self-attention, residuals) with an MoE feed-forward. The
MoE's ``Router`` counts the tokens it sends to each expert in its forward, with a buffer
update; that is the side effect a checkpoint that re-runs Python performs twice. Experts
gather their tokens with ``nonzero``/``index_select``/``index_add_``, so shapes inside a
block depend on the data, as in real MoE layers. Dropout is on, so replay has to draw the
same random numbers as the forward did.

``Block`` is the unit to checkpoint: ``tracedac.wrap(model, Block)``, or set
``GPT.checkpoint_fn`` to call each block through ``torch.utils.checkpoint``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Block", "Config", "GPT", "MoE", "Router", "Seeded", "make_batch"]


@dataclass(frozen=True)
class Config:
    """Model and batch sizes.

    The defaults make one forward+backward without checkpointing take a few tenths of a
    second on a 2-core CPU, so the whole default benchmark (six variants checked and timed,
    and the tracing-overhead section) takes about a minute. 1024 tokens a step keep matmuls
    big enough that the timings measure the libraries rather than Python's per-call cost,
    and each token passes through top_k x expert_hidden = 2 x 512 = 4 x dim expert units:
    the FLOPs of a dense GPT feed-forward, spread over 8 experts.
    """

    vocab: int = 2048
    layers: int = 4
    dim: int = 256
    heads: int = 4
    experts: int = 8
    top_k: int = 2
    expert_hidden: int = 512  # each expert's feed-forward width
    batch: int = 8
    seq: int = 128
    dropout: float = 0.1
    seed: int = 0
    # None: each expert takes the tokens routed to it (data-dependent shapes, as in real MoE
    # layers). A factor: fixed-capacity routing, each expert takes exactly
    # ceil(capacity * tokens * top_k / experts) slots of the call's tokens (a rank's share under
    # ZeRO); tokens over it are dropped, empty slots carry weight 0: static shapes, which
    # torch.compile needs for one graph (bench --compile).
    capacity: float | None = None

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def check(self) -> None:
        """Raise a ValueError naming the first size that cannot build a model."""
        for name in ("vocab", "layers", "dim", "heads", "experts", "top_k", "expert_hidden", "batch", "seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"Config.{name} must be at least 1, got {getattr(self, name)}")
        if self.dim % self.heads:
            raise ValueError(
                f"dim={self.dim} does not split into heads={self.heads} equal heads; "
                "pick a dim that is a multiple of heads."
            )
        if self.top_k > self.experts:
            raise ValueError(
                f"top_k={self.top_k} is more than experts={self.experts}: each token picks "
                "top_k distinct experts; lower top_k or add experts."
            )
        if self.capacity is not None and not self.capacity > 0:
            raise ValueError(f"capacity must be a positive factor (or None), got {self.capacity}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


class Attention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, D]
        B, T, D = x.shape
        q, k, v = self.qkv(x).split(D, dim=2)  # [B, T, D] each
        q, k, v = (
            t.view(B, T, self.heads, D // self.heads).transpose(1, 2) for t in (q, k, v)
        )  # [B, H, T, Dh]
        # No dropout inside attention: with dropout_p > 0 CPU leaves the fused kernel for the
        # math path (bmm, softmax, bernoulli), and the attention op that save_matmuls keeps
        # would not appear at all.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, Dh]
        return self.proj(y.transpose(1, 2).reshape(B, T, D))  # [B, T, D]


class Router(nn.Module):
    """Picks ``top_k`` experts per token and counts, in a buffer, how many tokens each got."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.top_k = cfg.top_k
        self.gate = nn.Linear(cfg.dim, cfg.experts, bias=False)
        self.register_buffer("tokens_per_expert", torch.zeros(cfg.experts, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [N, D]
        probs = self.gate(x).softmax(dim=-1)  # [N, E]
        weights, experts = probs.topk(self.top_k, dim=-1)  # [N, K], [N, K]
        weights = weights / weights.sum(dim=-1, keepdim=True)  # [N, K]
        # The load-balancing statistic MoE trainers log; a checkpoint that re-runs this
        # forward in backward adds every token twice.
        self.tokens_per_expert.add_(
            torch.bincount(experts.flatten(), minlength=self.tokens_per_expert.numel())
        )
        return weights, experts


class MoE(nn.Module):
    """Top-k routed experts; each expert is a GELU MLP applied to the tokens routed to it."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.router = Router(cfg)
        self.capacity = cfg.capacity  # slots per routed token, on average (None: no fixed capacity)
        self.top_k = cfg.top_k
        self.w1 = nn.Parameter(
            torch.randn(cfg.experts, cfg.dim, cfg.expert_hidden) / math.sqrt(cfg.dim)
        )  # [E, D, F]
        self.w2 = nn.Parameter(
            torch.randn(cfg.experts, cfg.expert_hidden, cfg.dim) / math.sqrt(cfg.expert_hidden)
        )  # [E, F, D]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, D]
        flat = x.reshape(-1, x.shape[-1])  # [N, D]
        weights, experts = self.router(flat)  # [N, K], [N, K]
        out = torch.zeros_like(flat)  # [N, D]
        if self.capacity is not None:
            return self._fixed_capacity(flat, weights, experts, out).view_as(x)
        for e in range(self.w1.shape[0]):
            token, slot = (experts == e).nonzero(as_tuple=True)  # [n_e], [n_e]
            h = F.gelu(flat.index_select(0, token) @ self.w1[e])  # [n_e, F]
            y = (h @ self.w2[e]) * weights[token, slot].unsqueeze(-1)  # [n_e, D]
            out.index_add_(0, token, y.to(out.dtype))  # under autocast y is bf16, out fp32
        return out.view_as(x)  # [B, T, D]

    def _fixed_capacity(self, flat, weights, experts, out):  # [N, D], [N, K], [N, K], [N, D]
        # Each expert's slots go to its highest-weighted tokens; unrouted tokens weigh 0.
        dispatch = torch.zeros(flat.shape[0], self.w1.shape[0], dtype=weights.dtype, device=flat.device)
        dispatch.scatter_(1, experts, weights)  # [N, E]
        n, e = dispatch.shape  # the tokens of this call (a rank's share under ZeRO)
        slots = min(n, math.ceil(self.capacity * n * self.top_k / e))
        gate, token = dispatch.topk(slots, dim=0)  # [C, E], [C, E]
        for e in range(self.w1.shape[0]):
            h = F.gelu(flat.index_select(0, token[:, e]) @ self.w1[e])  # [C, F]
            y = (h @ self.w2[e]) * gate[:, e].unsqueeze(-1)  # [C, D]
            out.index_add_(0, token[:, e], y.to(out.dtype))
        return out


class Block(nn.Module):
    """One pre-norm transformer block: the unit the benchmark checkpoints."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.moe = MoE(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, D]
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.moe(self.ln2(x)))  # [B, T, D]


class Seeded:
    """``Model.seeded(cfg)``: the model with weights drawn from ``cfg.seed``, the same on every call."""

    @classmethod
    def seeded(cls, cfg):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            return cls(cfg)


class GPT(Seeded, nn.Module):
    """Token and position embeddings, ``layers`` blocks, final norm, LM head; returns the loss.

    ``checkpoint_fn``, when set, is called as ``checkpoint_fn(block, x)`` in place of
    ``block(x)`` (as Hugging Face's ``_gradient_checkpointing_func``), so checkpoint functions
    that take a callable (``torch.utils.checkpoint.checkpoint``) can wrap each block.
    """

    def __init__(self, cfg: Config):
        super().__init__()
        cfg.check()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos_emb = nn.Parameter(torch.randn(cfg.seq, cfg.dim) * 0.02)  # [T, D]
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.checkpoint_fn = None
        nn.init.normal_(self.tok_emb.weight, std=0.02)

    def routers(self) -> list[Router]:
        return [m for m in self.modules() if isinstance(m, Router)]

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # [B, T], [B, T]
        T = idx.shape[1]
        if T > self.pos_emb.shape[0]:
            raise ValueError(
                f"got sequences of {T} tokens but the model has positions for {self.pos_emb.shape[0]}; "
                "build it with Config(seq=...) at least that long."
            )
        x = self.drop(self.tok_emb(idx) + self.pos_emb[:T])  # [B, T, D]
        for block in self.blocks:
            x = block(x) if self.checkpoint_fn is None else self.checkpoint_fn(block, x)  # [B, T, D]
        logits = self.head(self.ln_f(x))  # [B, T, V]
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def make_batch(cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and their next-token targets, drawn from ``cfg.seed``."""
    g = torch.Generator().manual_seed(cfg.seed + 1)
    tokens = torch.randint(cfg.vocab, (cfg.batch, cfg.seq + 1), generator=g)  # [B, T + 1]
    return tokens[:, :-1], tokens[:, 1:]  # [B, T], [B, T]
