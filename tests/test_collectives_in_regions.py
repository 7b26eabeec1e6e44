"""Collectives inside a checkpointed region run once: their results are kept under every
policy and planner, never replayed (docs/design.md, "Collectives are effects").

On 2 gloo ranks (tests/support/ranks.py): an expert-parallel MoE block (tokens sent to the rank
their router picks with uneven all-to-all splits, through its expert, and back) and a
tensor-parallel MLP (an all-reduce), each checkpointed under four policies, against the same
block without checkpointing: the collectives counted in forward and in backward
(``CommDebugMode``) and the gradients. Then the MoE compiled fullgraph. Before the rule,
backward replayed both all-to-alls (4 in backward where the block issues 2), and under
``min_cut`` the two ranks, planning from their own split sizes, replayed different ones and
gloo aborted on the mismatch.

The rank functions beside the tests check what they compute; one spawn runs the eager ones,
each test reports its check (tests/support/ranks.py).
"""

from __future__ import annotations

import pytest
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import _functional_collectives as fc
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils.checkpoint import CheckpointPolicy

import tracedac
from tracedac import CheckpointError

from .support import collective_blocks as cb
from .support.ranks import check, message_of, run_parts

pytestmark = pytest.mark.slow  # the quick loop (pytest -m "not slow") leaves this file out

POLICIES = tuple(cb.POLICIES)
A2A, ALL_REDUCE = "c10d_functional.all_to_all_single", "c10d_functional.all_reduce"
# what each block issues without checkpointing: (forward, backward)
PLAIN = {
    "moe": ({A2A: 3}, {A2A: 2}),  # the split sizes' all-to-all and the tokens' two; their gradients'
    "all_reduce": ({ALL_REDUCE: 1}, {ALL_REDUCE: 1}),
    "c10d": ({"c10d.allreduce_": 1}, {}),
}
MAKE = {"moe": cb.MoE, "all_reduce": lambda world: cb.RowParallel(), "c10d": lambda world: cb.GlobalScale()}


def eager(rank, world, kind):
    """Block ``kind`` without checkpointing, then checkpointed under each policy: check
    "<kind> <policy>", the collectives of no checkpointing in forward and in backward, and its
    gradients exactly."""
    block, x = cb.inputs(rank, lambda: MAKE[kind](world))
    fwd, bwd, want = cb.step(block, x)
    if kind == "moe":
        sizes = [None] * world
        dist.all_gather_object(sizes, cb.sizes_of(block, x))
        with check("moe splits"):
            assert all(len(set(send)) > 1 for send, _ in sizes), sizes  # uneven
            assert sizes[0] != sizes[1], sizes  # different on every rank
    for name, policy in cb.POLICIES.items():
        with check(f"{kind} {name}"):
            tracedac.checkpoint(block, policy=policy())
            try:
                got_fwd, got_bwd, got = cb.step(block, x)
            finally:
                tracedac.unwrap(block)
            assert (fwd, bwd) == PLAIN[kind], (fwd, bwd)
            assert (got_fwd, got_bwd) == (fwd, bwd), (name, got_fwd, got_bwd)
            assert cb.difference(got, want) == 0.0, (name, cb.difference(got, want))


def outside(rank, world):
    """The all-to-alls outside the region, the expert inside: the region receives the
    collective's ``AsyncCollectiveTensor``. Check "outside <policy>": it is one, and the
    collectives and gradients of the uncheckpointed expert."""
    block, x = cb.inputs(rank, lambda: cb.MoE(world))
    send, recv = cb.sizes_of(block, x)

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
    for name, policy in cb.POLICIES.items():
        with check(f"outside {name}"):
            _, got_fwd, got_bwd, got = step(tracedac.checkpoint(expert, policy=policy()))
            assert kind == "AsyncCollectiveTensor", kind
            assert (got_fwd, got_bwd) == (fwd, bwd), (name, (fwd, bwd), (got_fwd, got_bwd))
            assert cb.difference(got, want) == 0.0, (name, cb.difference(got, want))


def warm(rank, world):
    """Each block repeated three steps under each policy (the warm path, record/warm.py: the
    first call records a template, the next ones run it): check "warm <kind> <policy>", every
    step's collectives and gradients those of no checkpointing; and "warm calls", how many calls
    ran warm (a planner's region runs warm from its third call: the second makes its plan)."""
    from tracedac.policies.plan_cache import plans
    from tracedac.record import warm as warm_path
    from tracedac.record.template import TEMPLATES

    before = warm_path.stats()["warm"]
    for kind in PLAIN:
        block, x = cb.inputs(rank, lambda: MAKE[kind](world))
        fwd, bwd, want = cb.step(block, x)
        for name, policy in cb.POLICIES.items():
            with check(f"warm {kind} {name}"):
                TEMPLATES.clear()
                plans.entries.clear()  # (an earlier part's cached plan would make its template early)
                tracedac.checkpoint(block, policy=policy())
                try:
                    steps = [cb.step(block, x) for _ in range(3)]
                finally:
                    tracedac.unwrap(block)
                for got_fwd, got_bwd, got in steps:
                    assert (got_fwd, got_bwd) == (fwd, bwd), (name, got_fwd, got_bwd)
                    assert cb.difference(got, want) == 0.0, (name, cb.difference(got, want))
    with check("warm calls"):
        ran = warm_path.stats()["warm"] - before
        assert ran == 3 * (2 + 2 + 1 + 1), ran


def _keep_collectives_replayed(node):
    """A policy that asks for every collective to be replayed."""
    if "c10d" in node.name:
        return CheckpointPolicy.MUST_RECOMPUTE
    return CheckpointPolicy.PREFER_RECOMPUTE


def refusals(rank, world):
    """Checks "must replay" (a policy that must replay a collective) and "written" (a region
    that writes a collective's result in place where backward needs the value from before):
    each a CheckpointError saying why and what to do."""
    block, x = cb.inputs(rank, cb.RowParallel)
    tracedac.checkpoint(block, policy=_keep_collectives_replayed)
    with check("must replay"):
        message = message_of(CheckpointError, block, x.clone().requires_grad_())
        assert "MUST_RECOMPUTE" in message and "a collective" in message, message
        assert "PREFER_RECOMPUTE" in message, message
    tracedac.unwrap(block)

    def written(x):
        y = fc.all_reduce(x * 2, "sum", dist.group.WORLD)
        s = y.sigmoid()  # replayed in backward: from y as it was before the write below
        y.mul_(3)
        return s * y

    with check("written"):
        message = message_of(CheckpointError, tracedac.checkpoint(written), x.clone().requires_grad_())
        assert "all_reduce" in message and "clone()" in message, message


def compiled(rank, world, names):
    """The MoE compiled fullgraph with ``aot_eager_decomp_partition``, without checkpointing
    (check "compiled plain") and under each policy of ``names`` (check "compiled <policy>")."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from tracedac.compile.vocab import DECISION
    from tracedac.inspect.compiled import partition

    block, x = cb.inputs(rank, lambda: cb.MoE(world))
    sizes = cb.sizes_of(block, x)
    *_, want = cb.step(block, x, sizes)

    def collectives(graph) -> dict:
        ops = [
            str(n.target)
            for n in graph.nodes
            if n.op == "call_function" and getattr(n.target, "namespace", None) == "_c10d_functional"
        ]
        return {op: ops.count(op) for op in sorted(set(ops))}

    plain = None
    for name in ("plain", *names):
        if name != "plain":
            tracedac.checkpoint(block, policy=cb.POLICIES[name]())
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
        tracedac.unwrap(block)
        forward, backward = collectives(part.fw.graph), collectives(part.bw.graph)
        breaks, difference = sum(counters["graph_break"].values()), cb.difference(got, want)
        with check(f"compiled {name}"):
            if name == "plain":
                plain = forward, backward
                assert backward == {
                    "_c10d_functional.all_to_all_single.default": 2,
                    "_c10d_functional.wait_tensor.default": 2,
                }, backward
                assert breaks == 0 and difference < 1e-5, (breaks, difference)
                continue
            assert (forward, backward) == plain, (name, (forward, backward), plain)
            assert tags == {(CheckpointPolicy.MUST_SAVE, CheckpointPolicy.MUST_SAVE)}, (name, tags)
            assert recomputed == [] and breaks == 0, (name, recomputed, breaks)
            assert difference < 1e-5, (name, difference)


@pytest.fixture(scope="module")
def eager_ranks():
    parts = [(eager, kind) for kind in PLAIN] + [(outside,), (refusals,), (warm,)]
    return run_parts(2, parts, timeout=180)


@pytest.fixture(scope="module", params=[POLICIES[:2], POLICIES[2:]], ids=", ".join)
def compiled_ranks(request):
    """Two policies per spawn (and the block compiled without checkpointing): under 30 s each."""
    return request.param, run_parts(2, [(compiled, request.param)], timeout=180)


def test_the_moe_block_routes_with_uneven_splits_that_differ_between_ranks(eager_ranks):
    """What makes replay dangerous: each rank plans from its own shapes."""
    eager_ranks.passed("moe splits")


@pytest.mark.parametrize("policy", POLICIES)
def test_a_checkpointed_moe_block_issues_as_many_all_to_alls_as_without_checkpointing(eager_ranks, policy):
    """Forward: the split sizes' all-to-all and the tokens' two; backward: the two tokens'
    gradients', none replayed. Gradients equal the block's without checkpointing."""
    eager_ranks.passed(f"moe {policy}")


def test_a_region_repeated_warm_issues_its_collectives_once_and_keeps_them(eager_ranks):
    """The warm path (record/warm.py) runs a region's collectives once per forward, as the
    forward does, and keeps their results as a recorded call does: every step's collectives and
    gradients those of no checkpointing, under every policy, with the steps after the first (a
    planner's: the second) run warm. Without keeping them, backward would issue them again."""
    eager_ranks.passed(*(f"warm {kind} {name}" for kind in PLAIN for name in POLICIES), "warm calls")


@pytest.mark.parametrize("policy", POLICIES)
def test_an_all_reduce_in_a_region_runs_once_in_forward_and_once_in_backward(eager_ranks, policy):
    """The all-reduce's result is kept; backward's all-reduce is its gradient's, as without
    checkpointing."""
    eager_ranks.passed(f"all_reduce {policy}")


@pytest.mark.parametrize("policy", POLICIES)
def test_an_in_place_torch_distributed_all_reduce_in_a_region_is_kept_not_lost(eager_ranks, policy):
    """c10d's schema hides the write: unrecorded, backward rebuilt the statistic from before
    the all-reduce (this rank's own sum) and the gradients were wrong on two ranks."""
    eager_ranks.passed(f"c10d {policy}")


@pytest.mark.parametrize("policy", POLICIES)
def test_a_region_takes_a_functional_collectives_async_result_made_outside_it(eager_ranks, policy):
    """An expert checkpointed between two all-to-alls gets the first one's AsyncCollectiveTensor
    (a tensor subclass that waits at its first use): its own dispatch waits, and the region
    records the plain ops beneath it (docs/design.md, "Tensor subclasses"). Nothing is sent
    again; gradients are the uncheckpointed expert's."""
    eager_ranks.passed(f"outside {policy}")


def test_a_policy_that_must_replay_a_collective_is_refused_with_why(eager_ranks):
    """Replaying is not offered: a rank's plan depends on its own shapes, so ranks could
    replay different collectives (and deadlock)."""
    eager_ranks.passed("must replay")


def test_a_collective_result_written_in_place_that_backward_needs_unwritten_is_refused(eager_ranks):
    """Rebuilding the value from before the write would run the all-reduce again: the region
    says so and how to avoid it, instead of sending it twice."""
    eager_ranks.passed("written")


def test_a_compiled_moe_block_recomputes_no_collective_and_matches_eager(compiled_ranks):
    """fullgraph, aot_eager_decomp_partition: the joint-graph pass tags each collective
    MUST_SAVE, so the backward graph holds the collectives of the uncheckpointed compiled
    block and recomputes none; no graph break; gradients equal eager without checkpointing (to
    1e-5: the compiled graph's decompositions sum in another order, 1e-6 off without
    checkpointing too)."""
    policies, ranks = compiled_ranks
    ranks.passed("compiled plain", *(f"compiled {policy}" for policy in policies))
