"""What each rank runs in tests/test_collectives_in_regions.py (imported by spawned processes).

Two blocks that talk to the other ranks inside a checkpointed region: ``MoE``, expert
parallelism with one expert per rank (tokens routed with uneven all-to-all splits, through this
rank's expert, and back), and ``RowParallel``, a tensor-parallel MLP whose partial outputs an
all-reduce sums. Each worker returns, per policy, the collectives counted in forward and in
backward (torch's ``CommDebugMode``, which counts functional collectives) and the largest
gradient difference from the same block without checkpointing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import _functional_collectives as fc
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils.checkpoint import CheckpointPolicy

import tracedac
from tracedac import CheckpointError, policies

D = 16
TOKENS = 12
POLICIES = {
    "recompute_all": policies.recompute_all,
    "save_matmuls": policies.save_matmuls,
    "memory_budget(0.3)": lambda: policies.memory_budget(0.3),
    "min_cut": policies.min_cut,
}


class MoE(nn.Module):
    """One expert per rank. The router sends each token to a rank (uneven splits, different on
    every rank); the token goes there, through that rank's expert, and back, weighted by its
    router probability. ``sizes`` (send, receive) are exchanged here with a functional
    all-to-all unless given (a compiled graph takes them as constants)."""

    def __init__(self, world: int, d: int = D, h: int = 32):
        super().__init__()
        self.world = world
        self.router = nn.Linear(d, world, bias=False)
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)

    def forward(self, x, sizes=None):
        group = dist.group.WORLD
        weight, dest = self.router(x).softmax(-1).max(-1)
        order = dest.argsort(stable=True)
        if sizes is None:
            send = torch.bincount(dest, minlength=self.world)
            sizes = send.tolist(), fc.all_to_all_single(send, None, None, group).tolist()
        send, recv = sizes
        tokens = fc.all_to_all_single_autograd(x[order], recv, send, group)
        out = self.down(F.gelu(self.up(tokens)))
        back = fc.all_to_all_single_autograd(out, send, recv, group)
        y = torch.zeros_like(back).index_copy(0, order, back)
        return x + y * weight.unsqueeze(-1)


class RowParallel(nn.Module):
    """A tensor-parallel MLP: each rank holds a slice of the hidden layer, and an all-reduce
    sums the slices' outputs."""

    def __init__(self, d: int = D, h: int = 16):
        super().__init__()
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d, bias=False)

    def forward(self, x):
        y = fc.all_reduce(self.down(F.gelu(self.up(x))), "sum", dist.group.WORLD)
        return x + y.sigmoid() * y


class GlobalScale(nn.Module):
    """A statistic summed over ranks in place with ``torch.distributed.all_reduce`` (a c10d
    collective, as a global norm or a token counter is), which backward then reads."""

    def __init__(self, d: int = D):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        h = self.lin(x)
        total = h.detach().square().sum(0)
        dist.all_reduce(total)
        return h * total.rsqrt()


def _inputs(rank: int, make):
    """The block (same parameters on every rank) and this rank's tokens."""
    torch.manual_seed(0)
    block = make()
    torch.manual_seed(1 + rank)
    return block, torch.randn(TOKENS, D)


def sizes_of(block: MoE, x):
    """The (send, receive) split sizes ``block`` routes ``x`` with, exchanged outside any graph."""
    with torch.no_grad():
        send = torch.bincount(block.router(x).argmax(-1), minlength=block.world)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    return send.tolist(), recv.tolist()


def _step(block, x, *args):
    """Forward and backward, each under CommDebugMode: (forward counts, backward counts, grads)."""
    x = x.clone().requires_grad_()
    block.zero_grad()
    with CommDebugMode() as forward:
        loss = block(x, *args).square().sum()
    with CommDebugMode() as backward:
        loss.backward()
    counts = [{str(op): n for op, n in c.get_comm_counts().items() if n} for c in (forward, backward)]
    return *counts, [x.grad, *(p.grad for p in block.parameters())]


def _difference(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def eager(rank, world, kind):
    """{"plain": (forward counts, backward counts), policy: (forward counts, backward counts,
    gradient difference from plain)} for ``kind`` "moe", "all_reduce" or "c10d", and the MoE's
    splits."""
    make = {"moe": lambda: MoE(world), "all_reduce": RowParallel, "c10d": GlobalScale}[kind]
    block, x = _inputs(rank, make)
    fwd, bwd, want = _step(block, x)
    out = {"plain": (fwd, bwd)}
    if kind == "moe":
        out["sizes"] = sizes_of(block, x)
    for name, policy in POLICIES.items():
        tracedac.checkpoint(block, policy=policy())
        fwd, bwd, got = _step(block, x)
        out[name] = (fwd, bwd, _difference(got, want))
        tracedac.unwrap(block)
    return out


def moe(rank, world):
    return eager(rank, world, "moe")


def warm(rank, world):
    """Each block repeated under each policy (the warm path, record/warm.py: the first call
    records a template, the next ones run it): {kind: {policy: [(forward counts, backward
    counts, gradient difference from plain) per step], "plain": (forward, backward)}}, and how
    many calls ran warm."""
    from tracedac.policies.plan_cache import plans
    from tracedac.record import warm as warm_path
    from tracedac.record.template import TEMPLATES

    out = {}
    before = warm_path.stats()["warm"]
    for kind, make in (("moe", lambda: MoE(world)), ("all_reduce", RowParallel), ("c10d", GlobalScale)):
        block, x = _inputs(rank, make)
        fwd, bwd, want = _step(block, x)
        out[kind] = {"plain": (fwd, bwd)}
        for name, policy in POLICIES.items():
            TEMPLATES.clear()
            plans.entries.clear()  # (a plan cached by an earlier part would make its template a call early)
            tracedac.checkpoint(block, policy=policy())
            steps = []
            for _ in range(3):
                fwd, bwd, got = _step(block, x)
                steps.append((fwd, bwd, _difference(got, want)))
            out[kind][name] = steps
            tracedac.unwrap(block)
    out["warm"] = warm_path.stats()["warm"] - before
    return out


def all_reduce(rank, world):
    return eager(rank, world, "all_reduce")


def c10d(rank, world):
    return eager(rank, world, "c10d")


def outside(rank, world):
    """The all-to-alls outside the region, the expert inside: the region receives the
    collective's ``AsyncCollectiveTensor``. (its type name, {policy: (forward counts, backward
    counts, gradient difference from plain)}, plain's counts)."""
    block, x = _inputs(rank, lambda: MoE(world))
    send, recv = sizes_of(block, x)

    # F.linear, not the modules: CommDebugMode's module tracker fails on a module called
    # from no module here (IndexError in _fw_set_module_hook; torch's own checkpoint too)
    def expert(t):
        up, down = block.up, block.down
        return F.linear(F.gelu(F.linear(t, up.weight, up.bias)), down.weight, down.bias)

    def step(fn):
        xg = x.clone().requires_grad_()
        block.zero_grad()
        with CommDebugMode() as forward:
            tokens = fc.all_to_all_single_autograd(xg, recv, send, dist.group.WORLD)
            back = fc.all_to_all_single_autograd(fn(tokens), send, recv, dist.group.WORLD)
            loss = back.square().sum()
        with CommDebugMode() as backward:
            loss.backward()
        counts = [{str(op): n for op, n in c.get_comm_counts().items() if n} for c in (forward, backward)]
        grads = [p.grad for p in block.parameters() if p.grad is not None]
        return type(tokens).__name__, *counts, [xg.grad, *grads]

    kind, fwd, bwd, want = step(expert)
    out = {"plain": (fwd, bwd), "type": kind}
    for name, policy in POLICIES.items():
        _, fwd, bwd, got = step(tracedac.checkpoint(expert, policy=policy()))
        out[name] = (fwd, bwd, _difference(got, want))
    return out


def compiled(rank, world, names=tuple(POLICIES)):
    """The MoE compiled fullgraph with ``aot_eager_decomp_partition``, without checkpointing and
    under each policy: per name, (collectives in the forward graph, in the backward graph, the
    decisions of the forward graph's collectives, collectives backward recomputes, graph
    breaks, gradient difference from eager without checkpointing)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from tracedac.compile.vocab import DECISION
    from tracedac.inspect.compiled import partition

    block, x = _inputs(rank, lambda: MoE(world))
    sizes = sizes_of(block, x)
    *_, want = _step(block, x, sizes)

    def collectives(graph) -> dict:
        ops = [
            str(n.target)
            for n in graph.nodes
            if n.op == "call_function" and getattr(n.target, "namespace", None) == "_c10d_functional"
        ]
        return {op: ops.count(op) for op in sorted(set(ops))}

    out = {}
    for name in ("plain", *names):
        if name != "plain":
            tracedac.checkpoint(block, policy=POLICIES[name]())
        torch._dynamo.reset()
        counters.clear()

        def step(x):
            return block(x, sizes).square().sum()

        (part,) = partition(step, x.clone().requires_grad_())
        tags = {
            (n.meta.get("recompute"), n.meta.get(DECISION))
            for n in part.fw.graph.nodes
            if getattr(n.target, "namespace", None) == "_c10d_functional"
        }
        recomputed = [
            str(n.target) for n in part.replayed if getattr(n.target, "namespace", None) == "_c10d_functional"
        ]
        torch._dynamo.reset()
        xg = x.clone().requires_grad_()
        block.zero_grad()
        torch.compile(step, backend="aot_eager_decomp_partition", fullgraph=True)(xg).backward()
        got = [xg.grad, *(p.grad for p in block.parameters())]
        out[name] = (
            collectives(part.fw.graph),
            collectives(part.bw.graph),
            tags,
            recomputed,
            sum(counters["graph_break"].values()),
            _difference(got, want),
        )
        tracedac.unwrap(block)
    return out


def _keep_collectives_replayed(node):
    """A policy that asks for every collective to be replayed."""
    if "c10d" in node.name:
        return CheckpointPolicy.MUST_RECOMPUTE
    return CheckpointPolicy.PREFER_RECOMPUTE


def refusals(rank, world):
    """The CheckpointError messages of a policy that must replay a collective, and of a region
    that writes a collective's result in place where backward needs the value from before."""
    out = {}
    block, x = _inputs(rank, RowParallel)
    tracedac.checkpoint(block, policy=_keep_collectives_replayed)
    try:
        block(x.clone().requires_grad_())
    except CheckpointError as e:
        out["must_recompute"] = str(e)
    tracedac.unwrap(block)

    def written(x):
        y = fc.all_reduce(x * 2, "sum", dist.group.WORLD)
        s = y.sigmoid()  # replayed in backward: from y as it was before the write below
        y.mul_(3)
        return s * y

    try:
        tracedac.checkpoint(written)(x.clone().requires_grad_())
    except CheckpointError as e:
        out["written"] = str(e)
    return out


def several(rank, world, parts):
    from tests.zero.workers import several as run

    return run(rank, world, parts, where=globals())
