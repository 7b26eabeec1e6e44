"""``replay_collectives(policy)``: a region's functional collectives replayed on request, every
rank alike (docs/design.md, "Collectives are effects"). Without it a region keeps every
collective (tests/test_collectives_in_regions.py); with it backward issues them again, as
torch's checkpoint does, and the ranks check at each region's end that they replay the same
ones. On 2 gloo ranks: an expert-parallel MoE block, a sequence-parallel DTensor block, and a
block with an in-place ``dist.all_reduce`` (which stays kept)."""

from __future__ import annotations

import pytest
import torch

import tracedac
from tracedac import policies

from . import tensor_parallel_workers as tw
from .zero.spawn import part, run_ranks

A2A = "c10d_functional.all_to_all_single"
GATHER = "c10d_functional.all_gather_into_tensor"
CHECK = "c10d.allreduce_"  # the check at each region's end: one all-reduce of two integers


@pytest.fixture(scope="module")
def ranks():
    return part(run_ranks(tw.several, 2, [("replayed", ())], timeout=180), "replayed")


@pytest.mark.slow
def test_replayed_all_to_alls_are_issued_again_in_backward_with_the_gradients_of_no_checkpointing(ranks):
    for r in ranks:
        (fwd, bwd), (got_fwd, got_bwd, difference) = r["moe plain"], r["moe recompute_all"]
        assert got_bwd[A2A] == bwd[A2A] + 2  # the two routed all-to-alls, again
        assert got_fwd[A2A] == fwd[A2A] and got_fwd[CHECK] > 0
        assert difference == 0.0
        # the request holds inside either() too (and offload_kept(), HF's offload=True)
        _, got_bwd, difference = r["moe either"]
        assert got_bwd[A2A] == bwd[A2A] + 2 and difference == 0.0


@pytest.mark.slow
def test_a_sequence_parallel_block_gathers_again_instead_of_keeping_the_gathers(ranks):
    for r in ranks:
        (_, bwd), (_, got_bwd, difference) = r["sp plain"], r["sp recompute_all"]
        assert got_bwd[GATHER] > bwd[GATHER]
        assert difference == 0.0


@pytest.mark.slow
def test_plans_that_replay_different_collectives_on_each_rank_are_refused_on_every_rank(ranks):
    """min_cut plans from each rank's own bytes, and the MoE's splits differ per rank: before
    the check, gloo would have hung or aborted in backward."""
    for r in ranks:
        message = r["moe min_cut"]
        assert isinstance(message, str), "refused, not run"
        assert "would replay different collectives on different ranks" in message
        assert "rank 0" in message and "rank 1" in message and "replays" in message


@pytest.mark.slow
def test_a_region_replaying_a_collective_nests_in_another_region_with_eagers_gradients(ranks):
    """(A functional collective in nested regions once failed as a storage swap: the inner
    recorder's wait made its result with set_, which the outer recorder saw.)"""
    for r in ranks:
        assert r["nested"] == 0.0


@pytest.mark.slow
def test_an_in_place_torch_distributed_collective_stays_kept(ranks):
    for r in ranks:
        (fwd, bwd), (got_fwd, got_bwd, difference) = r["c10d plain"], r["c10d recompute_all"]
        assert got_fwd == fwd  # (no functional collective in the region: nothing to check)
        assert got_bwd == bwd and difference == 0.0


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
