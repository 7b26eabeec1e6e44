"""Collectives inside a checkpointed region run once: their results are kept under every
policy and planner, never replayed (docs/design.md, "Collectives are effects").

On 2 gloo ranks (tests/zero/spawn.py): an expert-parallel MoE block (tokens sent to the rank
their router picks with uneven all-to-all splits, through its expert, and back) and a
tensor-parallel MLP (an all-reduce), each checkpointed under four policies, against the same
block without checkpointing: the collectives counted in forward and in backward
(``CommDebugMode``) and the gradients. Then the MoE compiled fullgraph. Before the rule,
backward replayed both all-to-alls (4 in backward where the block issues 2), and under
``min_cut`` the two ranks, planning from their own split sizes, replayed different ones and
gloo aborted on the mismatch.
"""

from __future__ import annotations

import pytest

from . import collective_workers as cw
from .zero.spawn import part, run_ranks

pytestmark = pytest.mark.slow  # the quick loop (pytest -m "not slow") leaves this file out

POLICIES = tuple(cw.POLICIES)


@pytest.fixture(scope="module")
def eager_ranks():
    parts = [("moe", ()), ("all_reduce", ()), ("c10d", ()), ("outside", ()), ("refusals", ()), ("warm", ())]
    return run_ranks(cw.several, 2, parts, timeout=120)


@pytest.fixture(scope="module", params=[POLICIES[:2], POLICIES[2:]], ids=", ".join)
def compiled_ranks(request):
    """Two policies per spawn (and the block compiled without checkpointing): under 30 s each."""
    return request.param, run_ranks(cw.several, 2, [("compiled", (request.param,))], timeout=180)


def test_the_moe_block_routes_with_uneven_splits_that_differ_between_ranks(eager_ranks):
    """What makes replay dangerous: each rank plans from its own shapes."""
    sizes = [r["sizes"] for r in part(eager_ranks, "moe")]
    assert all(len(set(send)) > 1 for send, _ in sizes), sizes
    assert sizes[0] != sizes[1]


@pytest.mark.parametrize("policy", POLICIES)
def test_a_checkpointed_moe_block_issues_as_many_all_to_alls_as_without_checkpointing(eager_ranks, policy):
    """Forward: the split sizes' all-to-all and the tokens' two; backward: the two tokens'
    gradients', none replayed. Gradients equal the block's without checkpointing."""
    for r in part(eager_ranks, "moe"):
        forward, backward = r["plain"]
        assert forward == {"c10d_functional.all_to_all_single": 3}, forward
        assert backward == {"c10d_functional.all_to_all_single": 2}, backward
        assert r[policy][:2] == (forward, backward), r[policy]
        assert r[policy][2] == 0.0, r[policy]


def test_a_region_repeated_warm_issues_its_collectives_once_and_keeps_them(eager_ranks):
    """The warm path (record/warm.py) runs a region's collectives once per forward, as the
    forward does, and keeps their results as a recorded call does: every step's collectives and
    gradients those of no checkpointing, under every policy, with the steps after the first (a
    planner's: the second) run warm. Without keeping them, backward would issue them again."""
    for r in part(eager_ranks, "warm"):
        for kind in ("moe", "all_reduce", "c10d"):
            plain = r[kind]["plain"]
            for policy in POLICIES:
                for forward, backward, difference in r[kind][policy]:
                    assert (forward, backward) == plain and difference == 0.0, (kind, policy, r[kind][policy])
        assert r["warm"] == 3 * (2 + 2 + 1 + 1), r["warm"]


@pytest.mark.parametrize("policy", POLICIES)
def test_an_all_reduce_in_a_region_runs_once_in_forward_and_once_in_backward(eager_ranks, policy):
    """The all-reduce's result is kept; backward's all-reduce is its gradient's, as without
    checkpointing."""
    for r in part(eager_ranks, "all_reduce"):
        forward, backward = r["plain"]
        assert forward == backward == {"c10d_functional.all_reduce": 1}, r["plain"]
        assert r[policy][:2] == (forward, backward), r[policy]
        assert r[policy][2] == 0.0, r[policy]


@pytest.mark.parametrize("policy", POLICIES)
def test_an_in_place_torch_distributed_all_reduce_in_a_region_is_kept_not_lost(eager_ranks, policy):
    """c10d's schema hides the write: unrecorded, backward rebuilt the statistic from before
    the all-reduce (this rank's own sum) and the gradients were wrong on two ranks."""
    for r in part(eager_ranks, "c10d"):
        forward, backward = r["plain"]
        assert forward == {"c10d.allreduce_": 1} and backward == {}, r["plain"]
        assert r[policy][:2] == (forward, backward), r[policy]
        assert r[policy][2] == 0.0, r[policy]


@pytest.mark.parametrize("policy", POLICIES)
def test_a_region_takes_a_functional_collectives_async_result_made_outside_it(eager_ranks, policy):
    """An expert checkpointed between two all-to-alls gets the first one's AsyncCollectiveTensor
    (a tensor subclass that waits at its first use): its own dispatch waits, and the region
    records the plain ops beneath it (docs/design.md, "Tensor subclasses"). Nothing is sent
    again; gradients are the uncheckpointed expert's."""
    for r in part(eager_ranks, "outside"):
        assert r["type"] == "AsyncCollectiveTensor", r["type"]
        assert r[policy][:2] == r["plain"], (r["plain"], r[policy])
        assert r[policy][2] == 0.0, r[policy]


def test_a_policy_that_must_replay_a_collective_is_refused_with_why(eager_ranks):
    """Replaying is not offered: a rank's plan depends on its own shapes, so ranks could
    replay different collectives (and deadlock)."""
    for r in part(eager_ranks, "refusals"):
        message = r["must_recompute"]
        assert "MUST_RECOMPUTE" in message and "a collective" in message, message
        assert "PREFER_RECOMPUTE" in message, message


def test_a_collective_result_written_in_place_that_backward_needs_unwritten_is_refused(eager_ranks):
    """Rebuilding the value from before the write would run the all-reduce again: the region
    says so and how to avoid it, instead of sending it twice."""
    for r in part(eager_ranks, "refusals"):
        message = r["written"]
        assert "all_reduce" in message and "clone()" in message, message


def test_a_compiled_moe_block_recomputes_no_collective_and_matches_eager(compiled_ranks):
    """fullgraph, aot_eager_decomp_partition: the joint-graph pass tags each collective
    MUST_SAVE, so the backward graph holds the collectives of the uncheckpointed compiled
    block and recomputes none; no graph break; gradients equal eager without checkpointing (to
    1e-5: the compiled graph's decompositions sum in another order, 1e-6 off without
    checkpointing too)."""
    from torch.utils.checkpoint import CheckpointPolicy

    policies, results = compiled_ranks
    for r in part(results, "compiled"):
        plain = r["plain"]
        assert plain[1] == {
            "_c10d_functional.all_to_all_single.default": 2,
            "_c10d_functional.wait_tensor.default": 2,
        }, plain
        assert plain[4] == 0 and plain[5] < 1e-5, plain
        for policy in policies:
            forward, backward, tags, recomputed, breaks, difference = r[policy]
            assert (forward, backward) == plain[:2], (policy, r[policy])
            assert tags == {(CheckpointPolicy.MUST_SAVE, CheckpointPolicy.MUST_SAVE)}, (policy, tags)
            assert recomputed == [] and breaks == 0, (policy, r[policy])
            assert difference < 1e-5, (policy, difference)
