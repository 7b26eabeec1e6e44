"""What each rank runs in the ``MixedPrecision(param_dtype="auto")`` tests (spawned: top-level).

Oracles: the module-list ``MixedPrecision()`` (Linear parameters in bf16, by a list the user
writes) trained the same way, and the bytes every all-gather moves at the process group
(``GatherLog``, below the library's ops).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import tracedac.zero as zero

from . import workers as w


def _train(m, rank, world, steps=3, log=w.GatherLog, read=lambda log: (log.bytes, log.gathered)):
    """Losses and, per step, what ``read`` finds in a ``log`` open over forward and backward
    (default: all-gather bytes sent and gathered); each forward under bf16 autocast."""
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    losses, logged = [], []
    for step in range(steps):
        x, y = w.rank_batch(step, rank, world)
        opened = log()
        try:
            with torch.autocast("cpu", torch.bfloat16):
                loss = F.mse_loss(m(x).float(), y)
            loss.backward()
        finally:
            opened.close()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        logged.append(read(opened))
    return losses, logged


def _dtypes(m) -> dict:
    """Each group's name -> its travel dtype."""
    return {g.name: str(g.dtype).removeprefix("torch.") for g in m._tracedac_zero.all_groups}


def eager(rank, world):
    """``"auto"`` against the module list: the same losses and parameters (a cast moved before
    the gather changes no bit), the wire after the first step equal, and the decision."""
    listed = zero.shard(w.model(), mixed_precision=zero.MixedPrecision())
    auto = zero.shard(w.model(), mixed_precision=zero.MixedPrecision("auto"))
    first = _dtypes(auto)
    want_losses, want_wire = _train(listed, rank, world)
    losses, wire = _train(auto, rank, world)
    params = w.max_diff(zero.full_state_dict(auto), zero.full_state_dict(listed))
    # an eval pass without autocast after the decision: bf16 groups gather fp32 there
    plain = w.model()
    plain.load_state_dict(zero.full_state_dict(auto))
    x, _ = w.rank_batch(0, rank, world)
    with torch.no_grad():
        eval_diff = (auto(x) - plain(x)).abs().max().item()
    return dict(
        first=first,
        decided=_dtypes(auto),
        losses=(losses, want_losses),
        wire=(wire, want_wire),
        params=params,
        eval_diff=eval_diff,
    )


class Divergent(nn.Module):
    """One Linear whose weight rank 0 reads through a matmul (autocast casts it) and rank 1
    reads as it is (a sum): only an agreement between ranks keeps their gathers matching."""

    def __init__(self, rank):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(w.D, w.D)
        self.rank = rank

    def forward(self, x):
        if self.rank == 0:
            return self.lin(x).float().sum(-1)
        return (x * self.lin.weight.sum() + self.lin.bias.sum()).sum(-1)


def divergent(rank, world):
    m = zero.shard(Divergent(rank), mixed_precision=zero.MixedPrecision("auto"))
    losses, wire = _train(m, rank, world)
    return _dtypes(m), losses


class Tied(nn.Module):
    """An embedding whose weight is also the output projection's (read as it is by the lookup,
    cast by autocast for the matmul), beside a plain Linear."""

    def __init__(self, vocab=32):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, w.D)
        self.lin = nn.Linear(w.D, w.D)
        self.head = nn.Linear(w.D, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx):
        return self.head(self.lin(self.embed(idx))).float()


def tied(rank, world, how):
    """The dtypes "auto" decides for the tied weight and the Linear, ``how``: "eager" (the
    groups' dtypes after two steps) or "compiled" (the dtypes of the graph's gathers)."""
    import torch._dynamo

    from .compile_workers import GATHER, START, Graphs

    idx = torch.arange(8).view(2, 4)
    if how == "eager":
        m = zero.shard(Tied(), mixed_precision=zero.MixedPrecision("auto"))
        for _ in range(2):
            with torch.autocast("cpu", torch.bfloat16):
                m(idx).sum().backward()
        return _dtypes(m)
    torch._dynamo.reset()
    m = zero.shard(Tied(), mixed_precision=zero.MixedPrecision("auto"))
    g = Graphs()
    with torch.autocast("cpu", torch.bfloat16):
        torch.compile(m, fullgraph=True, backend=g.backend)(idx).sum().backward()
    names = {grp.key: grp.name for grp in m._tracedac_zero.all_groups}
    out = {
        names[n.args[1]]: str(n.kwargs.get("dtype", n.args[2] if len(n.args) > 2 else None))
        for gm in g.forward
        for n in gm.graph.nodes
        if n.target in (GATHER, START)
    }
    torch._dynamo.reset()
    return out


def nested(rank, world):
    """Each block sharded, then the model (FSDP2's pattern), "auto" at either level or both:
    (inner, outer) -> {(group kind, dtype)} after three steps under autocast."""
    out = {}
    for inner, outer in (("auto", "auto"), (None, "auto"), ("auto", None)):
        m = w.model()
        for b in m.blocks:
            zero.shard(b, mixed_precision=zero.MixedPrecision("auto") if inner else None)
        zero.shard(m, mixed_precision=zero.MixedPrecision("auto") if outer else None)
        _train(m, rank, world)
        out[(inner, outer)] = {
            (g.name.split("(")[1].rstrip(")"), str(g.dtype).removeprefix("torch."))
            for g in m._tracedac_zero.all_groups
        }
    return out


def autocast_on_one_rank(rank, world):
    """Two steps under autocast on both ranks ("auto" decides bf16 for the Linear groups),
    then a forward under autocast on rank 0 only: rank 0 gathers those groups in bf16 and
    rank 1 in fp32. Returns the ZeroError's message (or None) and how long it took."""
    import time

    m = zero.shard(w.model(), mixed_precision=zero.MixedPrecision("auto"), timeout=20)
    _train(m, rank, world, steps=2)
    x, _ = w.rank_batch(2, rank, world)
    start = time.monotonic()
    try:
        with torch.autocast("cpu", torch.bfloat16, enabled=rank == 0):
            m(x)
    except zero.ZeroError as e:
        return time.monotonic() - start, str(e)
    return time.monotonic() - start, None
