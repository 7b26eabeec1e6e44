"""tracedac.zero on real gloo process groups of 2 to 4 spawned ranks (file init, hard timeouts).

Each rank trains on its slice of the batch with the loss averaged over its slice; the
gradient is averaged over ranks (as DDP and FSDP do), so with equal slices sharded training
equals single-process training on the combined batch. Starting a rank costs seconds, so
a few spawns run several workers each (``workers.several``); every test reads its part.
"""

from __future__ import annotations

import pytest

from . import workers as w
from .spawn import part, run_ranks

pytestmark = pytest.mark.slow  # the quick loop (pytest -m "not slow") leaves this file out

VARIANTS = ("plain", "wrap-before", "wrap-after", "inside-unit")


def _part(two_ranks, name):
    return part(two_ranks[0], name)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("dcp"))
    parts = [
        ("mismatched", ()),
        ("diverge", ()),
        ("diverge_after_a_step", ()),
        ("diverge_in_backward", ()),
        ("twin_checks", ()),
        ("checks", ()),
        ("equivalence", (VARIANTS,)),
        ("memory", ()),
        ("unconsumed", ()),
        ("mixed", ()),
        ("state_dicts", (tmp,)),
    ]
    results = run_ranks(w.several, 2, parts, timeout=240)
    return results, tmp


def test_two_ranks_train_as_one_process_on_the_combined_batch_with_and_without_checkpoint_regions(two_ranks):
    """Regions around the units (wrapped before or after sharding) and inside them; the
    blocks count their calls in a buffer, which full_state_dict compares too: once per step."""
    for result in _part(two_ranks, "equivalence"):
        assert all(result[v] < 1e-5 for v in VARIANTS), result


@pytest.mark.parametrize("world, variants", [(3, ("plain", "wrap-after")), (4, ("inside-unit",))])
def test_three_and_four_ranks_train_as_one_process(world, variants):
    for result in run_ranks(w.equivalence, world, variants, timeout=180):
        assert all(result[v] < 1e-5 for v in variants), result


@pytest.mark.parametrize("where", VARIANTS)
def test_after_forward_no_gathered_buffer_is_alive(two_ranks, where):
    for result in _part(two_ranks, "memory"):
        r = result[where]
        assert r["alive"] == 0 and r["live"] == 0, r
        assert r["grads"]


@pytest.mark.parametrize("where", VARIANTS)
def test_backward_gathers_each_group_once_for_each_unit_that_uses_it(two_ranks, where):
    """Frozen groups are never saved for backward, so they are not gathered again."""
    for result in _part(two_ranks, "memory"):
        r = result[where]
        assert r["forward"] == r["users"], r
        assert r["backward"], r
        assert all(r["backward"][k] == r["users"][k] for k in r["backward"]), r


def test_a_prefetched_gather_nobody_consumes_completes_when_its_pass_ends(two_ranks):
    """The order changes (a layer skipped): the gather prefetched for it is waited for and
    dropped when the forward or the backward ends, not left in flight until the next pass
    (one more start than gathers in each pass: the one dropped); gradients still equal the
    unsharded model's."""
    for r in _part(two_ranks, "unconsumed"):
        assert r["passes"] == [(1, []), (1, [])], r
        assert r["diff"] < 1e-6 and r["skipped_grad"], r


@pytest.mark.parametrize("where", VARIANTS)
def test_gathers_are_prefetched_and_none_is_wasted(two_ranks, where):
    for result in _part(two_ranks, "memory"):
        r = result[where]
        gathers = sum(r["forward"].values()) + sum(r["backward"].values())
        assert r["starts"] == gathers, r
        assert r["prefetched"] >= gathers // 2, r


def test_bf16_trains_close_to_fp32_and_gathers_at_most_055_of_the_bytes(two_ranks):
    """Only Linear parameters travel in bf16; the LayerNorms, the odd and frozen ones stay fp32."""
    for result in _part(two_ranks, "mixed"):
        (fp32_error, fp32_bytes), (bf16_error, bf16_bytes) = result["fp32"], result["bf16"]
        assert fp32_error < 1e-6
        assert 0 < bf16_error < 2e-2, result
        assert 0 < result["bf16-reduce"][0] < 2e-2, result  # gradients reduce-scattered in bf16 too
        assert bf16_bytes <= 0.55 * fp32_bytes, result


def test_state_dicts_round_trip_and_clipping_matches_torch(two_ranks):
    parts = _part(two_ranks, "state_dicts")
    assert sum(r["numel"][0] for r in parts) == parts[0]["numel"][1]  # each element on one rank
    for rank, r in enumerate(parts):
        norm_diff, params_diff = r["clip"]
        assert norm_diff < 1e-5 and params_diff < 1e-5, r["clip"]
        assert r["keys"]
        assert r["rank0_only"] == (31 if rank == 0 else 0)
        roundtrips = {k: r[k] for k in ("full_roundtrip", "dcp_roundtrip", "after_step")}
        assert roundtrips == dict.fromkeys(roundtrips, 0.0), roundtrips
        shard_numel, total = r["numel"]
        assert 0.4 * total <= shard_numel <= 0.6 * total, r["numel"]  # about 1/world: rows, not elements


def test_a_dcp_checkpoint_saved_by_two_ranks_loads_into_one(two_ranks, world1):
    """The parameters are Shard(0) DTensors, so DCP reshards them to another world size."""
    import torch.distributed.checkpoint as dcp

    import tracedac.zero as zero

    saved = _part(two_ranks, "state_dicts")[0]["saved"]
    m = zero.shard(w.model(seed=3))
    sd = m.state_dict()
    dcp.load(sd, checkpoint_id=two_ranks[1])
    m.load_state_dict(sd)
    loaded = zero.full_state_dict(m)
    assert [k for k in saved if not (loaded[k] == saved[k]).all()] == []


def test_ranks_with_different_models_are_refused_at_shard_time_naming_the_parameter(two_ranks):
    for message in _part(two_ranks, "mismatched"):
        assert (
            message is not None
            and "embed.weight" in message
            and "(16, 16)" in message
            and "(20, 20)" in message
        )


def test_ranks_that_run_different_units_all_raise_at_once_instead_of_exchanging_wrong_values(two_ranks):
    """Blocks 1 and 2 have the same sizes: without the order check the ranks would pair
    their gathers silently; with other sizes gloo would abort the process."""
    for rank, (elapsed, message, live) in enumerate(_part(two_ranks, "diverge")):
        assert message is not None and "blocks.1" in message and "blocks.2" in message, message
        assert elapsed < 10, elapsed  # at once, not after the 20 s timeout
        assert live == 0


def test_ranks_that_diverge_after_the_order_is_learned_raise_too(two_ranks):
    """From the second step a unit's groups start together after one check, and the next
    unit's are prefetched, as the last pass ran them: both ranks prefetch block 1; rank 0
    uses it and prefetches block 2's two groups together, rank 1 (block 1 skipped) is at
    block 2's first group out of that order. Both raise there, naming it; no process is
    left holding a gathered unit."""
    for rank, (elapsed, message, live) in enumerate(_part(two_ranks, "diverge_after_a_step")):
        assert message is not None and "blocks.2" in message and "last pass's order" in message, message
        assert elapsed < 10, elapsed
        assert live == 0


def test_ranks_whose_unit_reduces_other_groups_raise_instead_of_pairing_reductions(two_ranks):
    """A unit's groups reduce in one collective once the order is learned; where one of them
    gets no gradient on one rank, the ranks would pair reduce-scatters of different sizes.
    Both raise, naming the reduce-scatter, before anything is exchanged."""
    for rank, (elapsed, message) in enumerate(_part(two_ranks, "diverge_in_backward")):
        assert message is not None and "reduce-scatter" in message and "blocks.2" in message, message
        assert elapsed < 10, elapsed


def test_on_nccl_the_order_checks_go_through_a_gloo_twin_and_still_catch_ranks_that_diverge(two_ranks):
    """On NCCL a check's rows on the GPU made the host wait for every kernel queued before each
    collective; they go through a gloo twin of the group instead (``host_group``), here with
    the gloo group reported as NCCL: the same losses, every check on the twin, and ranks that
    leave the learned order raise as before."""
    for result in _part(two_ranks, "twin_checks"):
        assert result["losses"] == result["want"], result
        assert result["routes"].get("twin", 0) > 0 and "group" not in result["routes"], result
        message = result["message"]
        assert message is not None and "blocks.2" in message and "last pass's order" in message, message


def test_a_units_groups_are_checked_once_sent_once_and_train_as_before(two_ranks):
    """Under "auto" each block is three groups (LayerNorm, Linear, the Block's own). Once a
    pass has taught the order, one order check covers a unit's all-gathers, which start
    together as one collective, and one covers its reductions, one reduce-scatter: per step,
    one all-gather per unit and pass and one reduce-scatter per unit, as under the module list
    (two groups a block), where the same model without prefetching sends one per group.
    Every check precedes exactly one collective. A step whose order differs from the last
    (block 1 skipped on every rank) and the step after it send more, alone where the order
    broke, and train the same: losses equal, parameters bit for bit. Eager, a unit's one
    all-gather in flight holds its byte buffer only: the groups' outputs are allocated at its
    wait, when the bytes are copied into them."""
    for result in _part(two_ranks, "checks"):
        auto, alone, listed = result["auto"], result["auto-alone"], result["listed"]
        assert auto["losses"] == alone["losses"] == listed["losses"], result
        assert result["params"] == 0.0, result
        assert auto["groups"] > listed["groups"], result
        for r in (auto, alone, listed):
            first = r["counts"][0]
            assert first["checks"] == first["all-gather"] + first["reduce-scatter"], r  # nothing learned yet
            for c in r["counts"]:
                assert c["checks"] == c["sent all-gather"] + c["sent reduce-scatter"], r
                assert c.get("allocated in flight", 0) == 0, r
        for c in alone["counts"]:
            assert c["sent all-gather"] == c["all-gather"], alone
            assert c["sent reduce-scatter"] == c["reduce-scatter"], alone
        learned, as_listed, one_each = auto["counts"][2], listed["counts"][2], alone["counts"][2]
        assert learned["all-gather"] == one_each["all-gather"], result  # the same groups gathered
        assert learned["sent all-gather"] == as_listed["sent all-gather"] < learned["all-gather"] // 2, result
        assert learned["sent reduce-scatter"] == as_listed["sent reduce-scatter"], result
        assert learned["sent reduce-scatter"] == learned["sent all-gather"] // 2, result  # one a unit
        assert learned["sent reduce-scatter"] < learned["reduce-scatter"] // 2, result
        # The step without block 1 ran out of the learned order (it would send two fewer
        # all-gathers than a learned step if every unit's still went as one): some went alone.
        broken = auto["counts"][3]
        assert broken["sent all-gather"] > learned["sent all-gather"] - 2, result


def test_a_rank_that_dies_makes_the_others_fail_within_the_timeout():
    results = run_ranks(w.dead_rank, 2, timeout=60)
    elapsed, message = results[0]
    assert message is not None and "all-gather" in message and "rank 0 of 2" in message, message
    assert elapsed < 3 + 5


def test_a_rank_that_never_reaches_shard_makes_the_others_fail_within_the_timeout():
    elapsed, message = run_ranks(w.absent_rank, 2, timeout=60)[0]
    assert (
        message is not None and "shard()" in message and "within 2 s" in message and "Ranks 1" in message
    ), message
    assert elapsed < 2 + 5
