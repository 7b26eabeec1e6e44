"""What each rank runs in tests/test_tensor_parallel.py (imported by spawned processes).

A transformer-style MLP block parallelized with torch's tensor parallel API: ``"tp"``, the
hidden layer split across ranks (``ColwiseParallel`` then ``RowwiseParallel``: an all-reduce
sums the partial outputs), and ``"sp"``, sequence parallel around it (the LayerNorm runs on
each rank's slice of the tokens; an all-gather before the hidden layer, a reduce-scatter
after). Its weights and activations are ``DTensor``s. Each worker compares the block in a
tracedac region with the same block without checkpointing: the collectives counted in
forward and in backward (torch's ``CommDebugMode``) and the gradients.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard, init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import parallelize_module

import tracedac
from benchmarks.tensor_parallel import Block, plan

from .collective_workers import POLICIES

D = 16
TOKENS = 8


def _setup(rank: int, world: int, kind: str):
    """The parallelized block (same weights on every rank before sharding), the whole batch,
    and a function making this rank's input from it (a sequence-sharded DTensor for "sp")."""
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    block = parallelize_module(Block(D, 32), mesh, plan(kind))
    x = torch.randn(TOKENS, D)

    def inputs(x):
        if kind == "sp":
            return DTensor.from_local(x.chunk(world)[rank], mesh, [Shard(0)])
        return x

    return block, x, inputs


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _step(fn, block, x, inputs):
    """Forward and backward, each under CommDebugMode: (forward counts, backward counts,
    gradients of the whole batch and of every parameter, as full tensors)."""
    xg = x.clone().requires_grad_()
    block.zero_grad()
    with CommDebugMode() as forward:
        loss = _full(fn(inputs(xg))).square().sum()
    with CommDebugMode() as backward:
        loss.backward()
    counts = [{str(op): n for op, n in c.get_comm_counts().items() if n} for c in (forward, backward)]
    return *counts, [xg.grad, *(_full(p.grad) for p in block.parameters())]


def _difference(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def eager(rank, world, kind):
    """{"plain": (forward counts, backward counts), policy: (forward counts, backward counts,
    gradient difference from plain)}, and the parameters' types."""
    block, x, inputs = _setup(rank, world, kind)
    fwd, bwd, want = _step(block, block, x, inputs)
    out = {"plain": (fwd, bwd), "types": sorted({type(p).__name__ for p in block.parameters()})}
    for name, policy in POLICIES.items():
        fwd, bwd, got = _step(tracedac.checkpoint(block, policy=policy()), block, x, inputs)
        out[name] = (fwd, bwd, _difference(got, want))
        tracedac.unwrap(block)
    return out


def compiled(rank, world, kind, names=tuple(POLICIES)):
    """The block compiled fullgraph (``aot_eager_decomp_partition``) in a region under each
    policy: per name, (the forward graph's collectives, the (recompute, decision) tags on them,
    the backward graph's collectives and the eager uncheckpointed block's backward collectives,
    each {op name: count}, graph breaks, gradient difference from eager plain)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from tracedac.compile.vocab import DECISION
    from tracedac.inspect.compiled import partition

    block, x, inputs = _setup(rank, world, kind)
    _, eager_backward, want = _step(block, block, x, inputs)
    eager_backward = {op.split(".")[-1]: n for op, n in eager_backward.items()}

    def is_collective(n) -> bool:
        return getattr(n.target, "namespace", None) == "_c10d_functional" and "wait" not in str(n.target)

    out = {}
    for name in names:
        tracedac.checkpoint(block, policy=POLICIES[name]())

        def step(x):
            return _full(block(inputs(x))).square().sum()

        torch._dynamo.reset()
        counters.clear()
        (part,) = partition(step, x.clone().requires_grad_())
        nodes = [n for n in part.fw.graph.nodes if is_collective(n)]
        forward = sorted(str(n.target) for n in nodes)
        tags = {(n.meta.get("recompute"), n.meta.get(DECISION)) for n in nodes}
        backward = [n.target._opname for n in part.bw.graph.nodes if is_collective(n)]
        backward = {op: backward.count(op) for op in set(backward)}
        torch._dynamo.reset()
        xg = x.clone().requires_grad_()
        block.zero_grad()
        torch.compile(step, backend="aot_eager_decomp_partition", fullgraph=True)(xg).backward()
        got = [xg.grad, *(_full(p.grad) for p in block.parameters())]
        breaks = sum(counters["graph_break"].values())
        out[name] = (forward, tags, backward, eager_backward, breaks, _difference(got, want))
        tracedac.unwrap(block)
    return out


def eager_tp(rank, world):
    return eager(rank, world, "tp")


def eager_sp(rank, world):
    return eager(rank, world, "sp")


def compiled_tp(rank, world, names):
    return compiled(rank, world, "tp", names)


def compiled_sp(rank, world, names):
    return compiled(rank, world, "sp", names)


def async_input(rank, world):
    """A module region (``tracedac.wrap``) given a functional collective's result made before
    it (an ``AsyncCollectiveTensor``, a subclass that waits at its first use): (its type name,
    gradient difference from the module unwrapped)."""
    import torch.distributed as dist
    from torch.distributed import _functional_collectives as fc

    torch.manual_seed(0)
    expert = nn.Sequential(nn.Linear(D, D), nn.GELU())
    x = torch.randn(TOKENS, D, requires_grad=True)
    splits = [TOKENS // world] * world

    def step():
        x.grad = None
        tokens = fc.all_to_all_single_autograd(x, splits, splits, dist.group.WORLD)
        expert(tokens).square().sum().backward()
        return type(tokens).__name__, x.grad.clone()

    kind, want = step()
    tracedac.wrap(expert, nn.Linear)
    _, got = step()
    return kind, float((got - want).abs().max())


def replayed(rank, world):
    """``replay_collectives``: per case, (forward counts, backward counts, gradient difference
    from plain) against plain's counts, or the CheckpointError's message where refused."""
    from tracedac import CheckpointError, policies

    from . import collective_workers as cw

    rc = policies.replay_collectives
    out = {}
    cases = {
        "moe": (lambda: cw._inputs(rank, lambda: cw.MoE(world)), cw._step, cw._difference),
        "c10d": (lambda: cw._inputs(rank, cw.GlobalScale), cw._step, cw._difference),
    }
    for kind, (make, step, difference) in cases.items():
        block, x = make()
        *plain, want = step(block, x)
        out[f"{kind} plain"] = tuple(plain)
        names = {"recompute_all": rc(policies.recompute_all())}
        if kind == "moe":
            names["min_cut"] = rc(policies.min_cut())  # plans from each rank's own splits
            names["either"] = policies.either(
                rc(policies.recompute_all()), policies.save_names("none")
            )  # found inside
        for name, policy in names.items():
            tracedac.checkpoint(block, policy=policy)
            try:
                *counts, got = step(block, x)
                out[f"{kind} {name}"] = (*counts, difference(got, want))
            except CheckpointError as e:
                out[f"{kind} {name}"] = str(e)
            tracedac.unwrap(block)
    # a region replaying its all-reduce inside a region that keeps everything it can
    import torch.distributed as dist
    from torch.distributed import _functional_collectives as fc

    def inner(t):
        return fc.all_reduce(t.sin(), "sum", dist.group.WORLD).cos()

    def outer(f):
        return lambda t: f(t.exp()) * 2

    x = torch.randn(4, requires_grad=True)
    (want,) = torch.autograd.grad(outer(inner)(x).sum(), x)
    nested = tracedac.checkpoint(outer(tracedac.checkpoint(inner, policy=rc(policies.recompute_all()))))
    (got,) = torch.autograd.grad(nested(x).sum(), x)
    out["nested"] = float((got - want).abs().max())
    block, x, inputs = _setup(rank, world, "sp")
    *plain, want = _step(block, block, x, inputs)
    out["sp plain"] = tuple(plain)
    *counts, got = _step(tracedac.checkpoint(block, policy=rc(policies.recompute_all())), block, x, inputs)
    out["sp recompute_all"] = (*counts, _difference(got, want))
    return out


def several(rank, world, parts):
    from tests.zero.workers import several as run

    return run(rank, world, parts, where=globals())
