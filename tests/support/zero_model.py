"""The model the ZeRO-3 tests train, its data and its training loops (one process's oracle
and a rank's share), shared by the tests of tracedac.zero and of the features it composes with.

``Model``: an embedding, three ``Block``s (LayerNorm, two Linears, a 7-element parameter no
world size > 1 divides, a frozen one, a call counter as an MoE router's) and a head; blocks 0
and 1 share a weight unless ``tie=False``. Each rank trains on its slice of the batch with
the loss averaged over its slice; the gradient is averaged over ranks (as DDP and FSDP do),
so with equal slices sharded training equals single-process training on the combined batch
(``reference``, ``equivalence``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import tracedac
import tracedac.zero as zero

D = 16
BATCH = 12  # divides by world sizes 1 to 4


class Block(nn.Module):
    def __init__(self, d=D):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.lin1 = nn.Linear(d, 2 * d)
        self.lin2 = nn.Linear(2 * d, d)
        self.odd = nn.Parameter(torch.randn(7) * 0.1)  # 7 elements: divides by no world size > 1
        self.frozen = nn.Parameter(torch.randn(d) * 0.1, requires_grad=False)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.checkpoint_lin1 = False  # torch.utils.checkpoint around lin1, inside the unit
        self.odd_constant = False  # odd read detached: its group gets no gradient (ranks that diverge)

    def forward(self, x):  # [B, D]
        self.calls.add_(1)  # a side effect (an MoE router's counter): once per step
        h = self.norm(x)
        h = checkpoint(self.lin1, h, use_reentrant=False) if self.checkpoint_lin1 else self.lin1(h)
        h = self.lin2(F.gelu(h))
        odd = self.odd.detach() if self.odd_constant else self.odd
        return x + h.float() * (1 + odd.sum()) + self.frozen


class Model(nn.Module):
    def __init__(self, d=D, n=3, tie=True):
        super().__init__()
        self.embed = nn.Linear(d, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        if tie:
            self.blocks[1].lin2.weight = self.blocks[0].lin2.weight  # shared between two units
        self.head = nn.Linear(d, 1)
        self.checkpoint_blocks = False  # torch.utils.checkpoint around each block (a unit)
        self.skip = ()  # indices of blocks this rank's forward skips (ranks that diverge)

    def forward(self, x):
        h = self.embed(x)
        for i, b in enumerate(self.blocks):
            if i in self.skip:
                continue
            h = checkpoint(b, h, use_reentrant=False) if self.checkpoint_blocks else b(h)
        return self.head(h).float().squeeze(-1)


def data(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, D, generator=g), torch.randn(BATCH, generator=g)


def model(seed=0, **kw):
    torch.manual_seed(seed)
    return Model(**kw)


def rank_batch(step, rank, world):
    """This rank's slice of step ``step``'s batch: ``BATCH // world`` rows."""
    x, y = data(step)
    per = BATCH // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def train(m, rank, world, steps=3, clip=None, opt_cls=torch.optim.Adam):
    opt = opt_cls(m.parameters(), lr=1e-2)
    for step in range(steps):
        x, y = rank_batch(step, rank, world)
        loss = F.mse_loss(m(x), y)
        loss.backward()
        if clip is not None:
            sharded = hasattr(m, "_tracedac_zero")
            norm = (
                zero.clip_grad_norm_(m, clip) if sharded else nn.utils.clip_grad_norm_(m.parameters(), clip)
            )
        opt.step()
        opt.zero_grad()
    return norm if clip is not None else None


def max_diff(a: dict, b: dict) -> float:
    assert list(a) == list(b), (list(a), list(b))
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a.values(), b.values()))


def reference(steps=3, clip=None):
    m = model()
    norm = train(m, 0, 1, steps, clip)
    return m.state_dict(), norm


def with_checkpoint(m, where):
    if where == "wrap-before":
        return zero.shard(tracedac.wrap(m, Block))
    if where == "wrap-after":
        return tracedac.wrap(zero.shard(m), Block)
    if where == "inside-unit":  # regions around Linears inside the units: gathers happen outside them
        return tracedac.wrap(zero.shard(m), lambda name, mod: name.endswith(("lin1", "lin2")))
    return zero.shard(m)


def equivalence(rank, world, variants=("plain",)):
    """Max difference from single-process training on the combined batch, per variant."""
    ref, _ = reference()
    out = {}
    for where in variants:
        m = with_checkpoint(model(), where)
        train(m, rank, world)
        out[where] = max_diff(zero.full_state_dict(m), ref)
    return out


class Skipping(nn.Module):
    """Three Linears, one of which a forward may skip (the order of gathers changes)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])

    def forward(self, x, skip=None):
        for i, layer in enumerate(self.layers):
            if i != skip:
                x = layer(x)
        return x


def full_grads(m) -> torch.Tensor:
    """The gradient of every trainable parameter, full (DTensor ``full_tensor``), by name, flat."""
    return torch.cat(
        [p.grad.full_tensor().flatten() for _, p in sorted(m.named_parameters()) if p.grad is not None]
    )


def flat_grads(m) -> torch.Tensor:
    """An unsharded model's gradients in the order of ``full_grads`` (by name), flat."""
    return torch.cat([p.grad.flatten() for _, p in sorted(m.named_parameters()) if p.grad is not None])


def global_loss(loss: torch.Tensor, world: int) -> float:
    x = loss.detach().clone()
    if world > 1:
        dist.all_reduce(x)
    return x.item() / world


def param_groups(m: nn.Module, lr=1e-2) -> list[dict]:
    """Weight decay on matrices, none on biases and norms: chosen by name, as people do."""
    decay = [p for n, p in m.named_parameters() if p.requires_grad and p.dim() >= 2]
    rest = [
        p for n, p in m.named_parameters() if p.requires_grad and p.dim() < 2 and not n.endswith("frozen")
    ]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": lr / 2}]
