"""Long runs keep nothing per step: a few hundred AdamW steps of tracedac.zero, with and without
regions, eager and compiled, every mixed-precision mode, prefetch on and off, against FSDP2's
``fully_shard`` on the same model and loop.

Host memory is read from glibc's allocator (``mallinfo2``), outside the library. torch's
flight recorder (a ring buffer of the last ``TORCH_FR_BUFFER_SIZE`` collectives, 2000 by
default, ~300 bytes each) grows with every collective until it is full: tracedac.zero issues
an order check before each collective, so it fills that buffer about twice as fast as FSDP2
and a short run reads it as a leak (~14 KB a step for the first ~50 steps of this model).
The buffer is bounded; the tests make it small (64 entries) so that it is full after the
warm-up and what remains is what the libraries themselves keep. Each rank checks what it
measured (tests/support/ranks.py).
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracedac
import tracedac.zero as zero
from tracedac._compat import _VERSION

from ..support.probe import allocated_bytes
from ..support.ranks import check, start_parts

STEPS = 200
FLOOR = 1024  # bytes a step: allocator noise over 200 steps reads up to ~250 on either library
COMPILED = "zero+wrap+compile"
MODES = {
    1: ("zero", "zero+wrap", "zero+bf16+wrap", "zero+auto+wrap", "zero+noprefetch+wrap"),
    2: ("zero+wrap", "zero+auto+wrap", COMPILED),
}
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
    bytes0, objects0 = allocated_bytes(), len(gc.get_objects())
    for _ in range(steps):
        step()
    gc.collect()
    bytes1, objects1 = allocated_bytes(), len(gc.get_objects())
    return (bytes1 - bytes0) / steps, (objects1 - objects0) / steps


def soak(rank, world, modes, steps):
    """``host_bytes_per_step`` for FSDP2 and each of ``modes``, one after another in this
    process; check "<mode> keeps nothing" each: no more host memory a step than FSDP2 on the
    same loop, and no Python object a step (FSDP2 included). Before torch 2.13, beyond FSDP2's:
    on torch 2.11 both libraries keep ~21 tuples a step that torch itself holds (the DTensor op
    schemas of AdamW's foreach ops, out of the garbage collector's sight), which are not
    tracedac's."""
    fsdp_bytes, fsdp_objects = host_bytes_per_step(rank, world, "fsdp", steps)
    limit = max(2 * fsdp_bytes, FLOOR)
    torchs = fsdp_objects if _VERSION < (2, 13) else 0  # (torch's own, before 2.13)
    with check("fsdp keeps nothing"):
        assert fsdp_bytes <= limit, (fsdp_bytes, limit)
        assert fsdp_objects - torchs < 0.5, fsdp_objects  # not one object a step
    for mode in modes:
        bytes_per_step, objects_per_step = host_bytes_per_step(rank, world, mode, steps)
        with check(f"{mode} keeps nothing"):
            assert bytes_per_step <= limit, (mode, bytes_per_step, limit)
            assert objects_per_step - torchs < 0.5, (mode, objects_per_step)  # not one object a step


@pytest.fixture(scope="module")
def soaks():
    """Both world sizes' soaks, started together: one rank alone would leave a core idle."""
    env = {"TORCH_FR_BUFFER_SIZE": "64"}  # read by each rank at its first collective
    runs = {
        world: start_parts(world, [(soak, modes, STEPS)], timeout=600, env=env)
        for world, modes in MODES.items()
    }
    yield runs
    for run in runs.values():
        run.close()


@pytest.mark.slow
def test_one_rank_keeps_no_host_memory_per_step_in_any_mode(soaks):
    """Eager, regions or not, fp32 / bf16 / "auto" under autocast, prefetch on and off."""
    soaks[1].checks().passed(*(f"{mode} keeps nothing" for mode in ("fsdp", *MODES[1])))


@pytest.mark.slow
def test_two_ranks_keep_no_host_memory_per_step_eager(soaks):
    """Two ranks, where every gather and reduce-scatter crosses the wire, eager."""
    soaks[2].checks().passed(*(f"{mode} keeps nothing" for mode in ("fsdp", "zero+wrap", "zero+auto+wrap")))


@pytest.mark.slow
def test_two_ranks_keep_no_host_memory_per_step_compiled(soaks):
    """The same, compiled fullgraph with regions inside the sharded blocks."""
    soaks[2].checks().passed(f"{COMPILED} keeps nothing")
