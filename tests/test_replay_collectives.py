"""``replay_collectives(policy)``: a region's functional collectives replayed on request, every
rank alike (docs/design.md, "Collectives are effects"). Without it a region keeps every
collective (tests/test_collectives_in_regions.py); with it backward issues them again, as
torch's checkpoint does, and the ranks check at each region's end that they replay the same
ones. On 2 gloo ranks: an expert-parallel MoE block, a sequence-parallel DTensor block, and a
block with an in-place ``dist.all_reduce`` (which stays kept). The rank function checks what it
computes; each test reports its check (tests/support/ranks.py)."""

from __future__ import annotations

import pytest
import torch

import tracedac
from tracedac import CheckpointError, policies

from .support import collective_blocks as cb
from .support import tp_block as tb
from .support.ranks import check, run_parts

A2A = "c10d_functional.all_to_all_single"
GATHER = "c10d_functional.all_gather_into_tensor"
CHECK = "c10d.allreduce_"  # the check at each region's end: one all-reduce of two integers


def _run(make, policy):
    """(forward counts, backward counts, gradient difference from plain) of the block ``make``
    gives under ``policy``, and plain's counts; or the CheckpointError's message where refused."""
    block, x = make()
    *plain, want = cb.step(block, x)
    tracedac.checkpoint(block, policy=policy)
    try:
        *counts, got = cb.step(block, x)
        return tuple(plain), (*counts, cb.difference(got, want))
    except CheckpointError as e:
        return tuple(plain), str(e)
    finally:
        tracedac.unwrap(block)


def replayed(rank, world):
    """``replay_collectives`` on an expert-parallel MoE, a block with an in-place
    ``dist.all_reduce``, nested regions and a sequence-parallel block: one check per test below."""
    import torch.distributed as dist
    from torch.distributed import _functional_collectives as fc

    rc = policies.replay_collectives

    def moe():
        return cb.inputs(rank, lambda: cb.MoE(world))

    (fwd, bwd), (got_fwd, got_bwd, difference) = _run(moe, rc(policies.recompute_all()))
    # the request holds inside either() too (and offload_kept(), HF's offload=True)
    _, (_, either_bwd, either_difference) = _run(
        moe, policies.either(rc(policies.recompute_all()), policies.save_names("none"))
    )
    with check("moe replayed"):
        assert got_bwd[A2A] == bwd[A2A] + 2, (bwd, got_bwd)  # the two routed all-to-alls, again
        assert got_fwd[A2A] == fwd[A2A] and got_fwd[CHECK] > 0, (fwd, got_fwd)
        assert difference == 0.0, difference
        assert either_bwd[A2A] == bwd[A2A] + 2 and either_difference == 0.0, (either_bwd, either_difference)

    _, refused = _run(moe, rc(policies.min_cut()))  # plans from each rank's own splits
    with check("moe min_cut"):
        assert isinstance(refused, str), f"refused, not run: {refused}"
        assert "would replay different collectives on different ranks" in refused, refused
        assert "rank 0" in refused and "rank 1" in refused and "replays" in refused, refused

    (fwd, bwd), (got_fwd, got_bwd, difference) = _run(
        lambda: cb.inputs(rank, cb.GlobalScale), rc(policies.recompute_all())
    )
    with check("c10d kept"):
        assert got_fwd == fwd, (fwd, got_fwd)  # (no functional collective in the region: nothing to check)
        assert got_bwd == bwd and difference == 0.0, (bwd, got_bwd, difference)

    # a region replaying its all-reduce inside a region that keeps everything it can
    def inner(t):
        return fc.all_reduce(t.sin(), "sum", dist.group.WORLD).cos()

    def outer(f):
        return lambda t: f(t.exp()) * 2

    x = torch.randn(4, requires_grad=True)
    (want,) = torch.autograd.grad(outer(inner)(x).sum(), x)
    nested = tracedac.checkpoint(outer(tracedac.checkpoint(inner, policy=rc(policies.recompute_all()))))
    (got,) = torch.autograd.grad(nested(x).sum(), x)
    with check("nested"):
        assert float((got - want).abs().max()) == 0.0, (got, want)

    block, x, inputs = tb.setup(rank, world, "sp")
    _, bwd, want = tb.step(block, block, x, inputs)
    _, got_bwd, got = tb.step(
        tracedac.checkpoint(block, policy=rc(policies.recompute_all())), block, x, inputs
    )
    with check("sp gathers again"):
        assert got_bwd[GATHER] > bwd[GATHER], (bwd, got_bwd)
        assert tb.difference(got, want) == 0.0, tb.difference(got, want)


@pytest.fixture(scope="module")
def ranks():
    return run_parts(2, [(replayed,)], timeout=180)


@pytest.mark.slow
def test_replayed_all_to_alls_are_issued_again_in_backward_with_the_gradients_of_no_checkpointing(ranks):
    ranks.passed("moe replayed")


@pytest.mark.slow
def test_a_sequence_parallel_block_gathers_again_instead_of_keeping_the_gathers(ranks):
    ranks.passed("sp gathers again")


@pytest.mark.slow
def test_plans_that_replay_different_collectives_on_each_rank_are_refused_on_every_rank(ranks):
    """min_cut plans from each rank's own bytes, and the MoE's splits differ per rank: before
    the check, gloo would have hung or aborted in backward."""
    ranks.passed("moe min_cut")


@pytest.mark.slow
def test_a_region_replaying_a_collective_nests_in_another_region_with_eagers_gradients(ranks):
    """(A functional collective in nested regions once failed as a storage swap: the inner
    recorder's wait made its result with set_, which the outer recorder saw.)"""
    ranks.passed("nested")


@pytest.mark.slow
def test_an_in_place_torch_distributed_collective_stays_kept(ranks):
    ranks.passed("c10d kept")


def test_replay_collectives_prints_as_its_call_and_wraps_once():
    p = policies.replay_collectives(policies.recompute_all())
    assert repr(p) == "replay_collectives(recompute_all())"
    assert policies.replay_collectives(p) is p
    assert p == policies.replay_collectives(policies.recompute_all())
    with pytest.raises(TypeError, match="takes a policy"):
        policies.replay_collectives("recompute_all")


def test_a_planner_inside_replay_collectives_still_plans():
    p = policies.replay_collectives(policies.memory_budget(0.3))
    assert p.planner == policies.memory_budget(0.3)
    x = torch.randn(8, 8, requires_grad=True)
    f = lambda t: (t @ t).sin().exp()  # noqa: E731
    (want,) = torch.autograd.grad(f(x).sum(), x)
    (got,) = torch.autograd.grad(tracedac.checkpoint(f, policy=p)(x).sum(), x)
    assert torch.equal(got, want)


def test_replay_collectives_under_torch_compile_is_refused_with_why():
    f = tracedac.checkpoint(
        lambda t: t.sin().cos(), policy=policies.replay_collectives(policies.recompute_all())
    )
    x = torch.randn(4, requires_grad=True)
    with pytest.raises(Exception, match="replaying collectives is eager only"):
        torch.compile(f, backend="aot_eager", fullgraph=True)(x).sum().backward()
