"""What each rank runs in the soak tests: a few hundred training steps, and the host memory
they leave behind (imported by spawned processes, so top-level).

Oracles: glibc's allocator statistics (``mallinfo2``), read from outside the library, and
FSDP2's ``fully_shard`` trained on the same model and loop in the same kind of process.
"""

from __future__ import annotations

import gc

import torch
import torch.nn.functional as F
from torch import nn

import tracedac
import tracedac.zero as zero
from benchmarks import probe

D = 32


class Block(nn.Module):
    def __init__(self, d=D):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):  # [B, D]
        return x + self.down(F.gelu(self.up(self.ln(x))))


class Model(nn.Module):
    def __init__(self, d=D, n=3):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x).squeeze(-1)


def build(mode: str):
    """The model and the callable to train for ``mode``: '+'-joined words, 'fsdp' (FSDP2) or
    tracedac.zero with 'wrap' (regions), 'bf16' / 'auto' (mixed precision), 'noprefetch',
    'compile' (fullgraph, AOTAutograd's partitioner)."""
    torch.manual_seed(0)
    m = Model()
    words = set(mode.split("+"))
    if "fsdp" in words:
        from torch.distributed.fsdp import fully_shard

        for b in m.blocks:
            fully_shard(b)
        fully_shard(m)
    else:
        mp = None
        if "auto" in words:
            mp = zero.MixedPrecision("auto")
        elif "bf16" in words:
            mp = zero.MixedPrecision()
        zero.shard(m, mixed_precision=mp, prefetch="noprefetch" not in words)
    if "wrap" in words:
        tracedac.wrap(m, Block)
    call = m
    if "compile" in words:
        torch._dynamo.config.recompile_limit = 64
        call = torch.compile(m, fullgraph=True, backend="aot_eager_decomp_partition")
    return m, call, words


def host_bytes_per_step(rank, world, mode: str, steps: int, warmup: int = 30) -> tuple[float, float]:
    """Bytes the allocator holds after ``warmup + steps`` steps beyond after ``warmup``, per
    step, and the same for Python objects the garbage collector tracks."""
    m, call, words = build(mode)
    # foreach: the implementation torch picks on GPUs; CPU's default loops over the parameters,
    # each of its ops dispatched through DTensor on its own: half of a step's time here
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(8, D, generator=g), torch.randn(8, generator=g)
    autocast = torch.autocast("cpu", torch.bfloat16, enabled="auto" in words)

    def step():
        with autocast:
            loss = F.mse_loss(call(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()

    for _ in range(warmup):
        step()
    gc.collect()
    bytes0, objects0 = probe.allocated_bytes(), len(gc.get_objects())
    for _ in range(steps):
        step()
    gc.collect()
    bytes1, objects1 = probe.allocated_bytes(), len(gc.get_objects())
    return (bytes1 - bytes0) / steps, (objects1 - objects0) / steps


def soak(rank, world, modes, steps):
    """``host_bytes_per_step`` for each mode, one after another in this process."""
    return {mode: host_bytes_per_step(rank, world, mode, steps) for mode in modes}
