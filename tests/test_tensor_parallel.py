"""Tensor subclasses in regions, on 2 gloo ranks: a tensor-parallel and a sequence-parallel
block (DTensor weights and activations, torch's ``parallelize_module``) checkpointed by
tracedac under every policy, eager and compiled fullgraph, against the same block without
checkpointing (docs/design.md, "Tensor subclasses").

Before: ``CheckpointError: a DTensor (a tensor subclass) reached an op inside a checkpointed
region``. Now the region records the local ops DTensor dispatches to; its redistributions
(all-gather, reduce-scatter, all-reduce) are collectives, kept and never issued again.
"""

from __future__ import annotations

import pytest
from torch.utils.checkpoint import CheckpointPolicy

from . import tensor_parallel_workers as tw
from .zero.spawn import part, run_ranks

pytestmark = pytest.mark.slow  # the quick loop (pytest -m "not slow") leaves this file out

KINDS = ("tp", "sp")
POLICIES = ("recompute_all", "save_matmuls", "memory_budget(0.3)", "min_cut")


@pytest.fixture(scope="module")
def eager_ranks():
    parts = [(f"eager_{kind}", ()) for kind in KINDS] + [("async_input", ())]
    return run_ranks(tw.several, 2, parts, timeout=120)


@pytest.fixture(scope="module")
def compiled_ranks():
    """Each policy compiled once, on alternating blocks (a compile is ~10 s on 2 cores)."""
    parts = [("compiled_tp", (POLICIES[0::2],)), ("compiled_sp", (POLICIES[1::2],))]
    return run_ranks(tw.several, 2, parts, timeout=300)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("policy", POLICIES)
def test_a_dtensor_block_in_a_region_issues_the_collectives_of_no_checkpointing_with_its_gradients(
    eager_ranks, kind, policy
):
    for rank in part(eager_ranks, f"eager_{kind}"):
        assert "DTensor" in rank["types"]
        fwd, bwd = rank["plain"]
        assert any("all_reduce" in op or "reduce_scatter" in op for op in fwd)
        got_fwd, got_bwd, difference = rank[policy]
        assert (got_fwd, got_bwd) == (fwd, bwd)
        assert difference == 0.0


def test_a_module_region_takes_a_collectives_async_result_made_before_it(eager_ranks):
    for kind, difference in part(eager_ranks, "async_input"):
        assert kind == "AsyncCollectiveTensor"
        assert difference == 0.0


def test_a_compiled_dtensor_block_in_a_region_recomputes_no_collective_and_matches_eager(compiled_ranks):
    """The region's collectives tagged MUST_SAVE, and the compiled backward issuing no collective
    the uncheckpointed block's backward does not (counted by op: torch 2.14's partitioner
    merges a backward all-gather with its forward twin, so a name alone cannot tell a recompute
    from the backward's own)."""
    for kind, names in (("tp", POLICIES[0::2]), ("sp", POLICIES[1::2])):
        for rank in part(compiled_ranks, f"compiled_{kind}"):
            for name in names:
                forward, tags, backward, eager_backward, breaks, difference = rank[name]
                assert forward, "the region's collectives are in the forward graph"
                assert {recompute for recompute, _ in tags} == {CheckpointPolicy.MUST_SAVE}
                assert all(n <= eager_backward.get(op, 0) for op, n in backward.items()), (
                    backward,
                    eager_backward,
                )
                assert breaks == 0
                assert difference < 1e-5
