"""Tensor subclasses in regions, on 2 gloo ranks: a tensor-parallel and a sequence-parallel
block (DTensor weights and activations, torch's ``parallelize_module``) checkpointed by
tracedac under every policy, eager and compiled fullgraph, against the same block without
checkpointing (docs/design.md, "Tensor subclasses").

Before: ``CheckpointError: a DTensor (a tensor subclass) reached an op inside a checkpointed
region``. Now the region records the local ops DTensor dispatches to; its redistributions
(all-gather, reduce-scatter, all-reduce) are collectives, kept and never issued again.

The rank functions beside the tests check what they compute (tests/support/ranks.py).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

import tracedac

from .support import tp_block as tb
from .support.collective_blocks import POLICIES as MAKE_POLICY
from .support.ranks import check, run_parts

pytestmark = pytest.mark.slow  # the quick loop (pytest -m "not slow") leaves this file out

KINDS = ("tp", "sp")
POLICIES = ("recompute_all", "save_matmuls", "memory_budget(0.3)", "min_cut")


def eager(rank, world, kind):
    """The ``kind`` block without checkpointing, then in a region under each policy: check
    "eager <kind> <policy>", its parameters DTensors, the collectives of no checkpointing
    (one that reduces among them), and its gradients exactly."""
    block, x, inputs = tb.setup(rank, world, kind)
    fwd, bwd, want = tb.step(block, block, x, inputs)
    types = sorted({type(p).__name__ for p in block.parameters()})
    for name in POLICIES:
        with check(f"eager {kind} {name}"):
            try:
                got_fwd, got_bwd, got = tb.step(
                    tracedac.checkpoint(block, policy=MAKE_POLICY[name]()), block, x, inputs
                )
            finally:
                tracedac.unwrap(block)
            assert "DTensor" in types, types
            assert any("all_reduce" in op or "reduce_scatter" in op for op in fwd), fwd
            assert (got_fwd, got_bwd) == (fwd, bwd), (name, (fwd, bwd), (got_fwd, got_bwd))
            assert tb.difference(got, want) == 0.0, (name, tb.difference(got, want))


def compiled(rank, world, kind, names):
    """The block compiled fullgraph (``aot_eager_decomp_partition``) in a region under each
    policy of ``names``: check "compiled <kind> <policy>"."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from tracedac.compile.vocab import DECISION
    from tracedac.inspect.compiled import partition

    block, x, inputs = tb.setup(rank, world, kind)
    _, eager_backward, want = tb.step(block, block, x, inputs)
    eager_backward = {op.split(".")[-1]: n for op, n in eager_backward.items()}

    def is_collective(n) -> bool:
        return getattr(n.target, "namespace", None) == "_c10d_functional" and "wait" not in str(n.target)

    for name in names:
        tracedac.checkpoint(block, policy=MAKE_POLICY[name]())

        def step(x):
            return tb.full(block(inputs(x))).square().sum()

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
        got = [xg.grad, *(tb.full(p.grad) for p in block.parameters())]
        breaks = sum(counters["graph_break"].values())
        tracedac.unwrap(block)
        with check(f"compiled {kind} {name}"):
            assert forward, "the region's collectives are in the forward graph"
            assert {recompute for recompute, _ in tags} == {CheckpointPolicy.MUST_SAVE}, tags
            assert all(n <= eager_backward.get(op, 0) for op, n in backward.items()), (
                backward,
                eager_backward,
            )
            assert breaks == 0, breaks
            assert tb.difference(got, want) < 1e-5, tb.difference(got, want)


def async_input(rank, world):
    """A module region (``tracedac.wrap``) given a functional collective's result made before
    it (an ``AsyncCollectiveTensor``, a subclass that waits at its first use): the gradients
    of the module unwrapped."""
    import torch.distributed as dist
    from torch.distributed import _functional_collectives as fc

    torch.manual_seed(0)
    expert = nn.Sequential(nn.Linear(tb.D, tb.D), nn.GELU())
    x = torch.randn(tb.TOKENS, tb.D, requires_grad=True)
    splits = [tb.TOKENS // world] * world

    def step():
        x.grad = None
        tokens = fc.all_to_all_single_autograd(x, splits, splits, dist.group.WORLD)
        expert(tokens).square().sum().backward()
        return type(tokens).__name__, x.grad.clone()

    kind, want = step()
    tracedac.wrap(expert, nn.Linear)
    _, got = step()
    assert kind == "AsyncCollectiveTensor", kind
    assert float((got - want).abs().max()) == 0.0, float((got - want).abs().max())


@pytest.fixture(scope="module")
def eager_ranks():
    return run_parts(2, [(eager, "tp"), (eager, "sp"), (async_input,)], timeout=120)


@pytest.fixture(scope="module")
def compiled_ranks():
    """Each policy compiled once, on alternating blocks (a compile is ~10 s on 2 cores)."""
    return run_parts(2, [(compiled, "tp", POLICIES[0::2]), (compiled, "sp", POLICIES[1::2])], timeout=300)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("policy", POLICIES)
def test_a_dtensor_block_in_a_region_issues_the_collectives_of_no_checkpointing_with_its_gradients(
    eager_ranks, kind, policy
):
    eager_ranks.passed(f"eager {kind} {policy}")


def test_a_module_region_takes_a_collectives_async_result_made_before_it(eager_ranks):
    eager_ranks.passed("async_input")


def test_a_compiled_dtensor_block_in_a_region_recomputes_no_collective_and_matches_eager(compiled_ranks):
    """The region's collectives tagged MUST_SAVE, and the compiled backward issuing no collective
    the uncheckpointed block's backward does not (counted by op: torch 2.14's partitioner
    merges a backward all-gather with its forward twin, so a name alone cannot tell a recompute
    from the backward's own)."""
    compiled_ranks.passed(
        *(f"compiled tp {name}" for name in POLICIES[0::2]),
        *(f"compiled sp {name}" for name in POLICIES[1::2]),
    )
