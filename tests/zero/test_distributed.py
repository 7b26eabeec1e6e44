"""tracedac.zero on real gloo process groups of 2 to 4 spawned ranks (file init, hard timeouts).

Each rank trains on its slice of the batch with the loss averaged over its slice; the
gradient is averaged over ranks (as DDP and FSDP do), so with equal slices sharded training
equals single-process training on the combined batch (tests/support/zero_model.py). Starting a
rank costs seconds, so one spawn runs the rank functions below, each checking what it computes
(tests/support/ranks.py); every test reports its check.
"""

from __future__ import annotations

import collections
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tracedac.zero as zero
from tracedac.zero import group as zgroup

from ..support.ranks import check, message_of, run_parts, run_ranks
from ..support.zero_logs import CheckLog, GatherLog, live_gathered, train_logged
from ..support.zero_model import (
    D,
    Model,
    Skipping,
    data,
    equivalence,
    flat_grads,
    full_grads,
    max_diff,
    model,
    rank_batch,
    reference,
    train,
    with_checkpoint,
)

pytestmark = pytest.mark.slow  # the quick loop (pytest -m "not slow") leaves this file out

VARIANTS = ("plain", "wrap-before", "wrap-after", "inside-unit")


def trains_as_one_process(rank, world, variants=VARIANTS):
    """Each variant (regions around the units, wrapped before or after sharding, or inside
    them) within 1e-5 of single-process training on the combined batch; the blocks count their
    calls in a buffer, which the full state dict compares too: once per step."""
    for where, diff in equivalence(rank, world, variants).items():
        assert diff < 1e-5, (where, diff)


def memory(rank, world):
    """After forward no gathered buffer is alive; backward gathers each group once per use;
    from the second step on, gathers are prefetched and none is wasted. Three checks per
    variant: "<variant> alive", "<variant> gathers", "<variant> prefetched"."""
    for where in VARIANTS:
        m = with_checkpoint(model(), where)
        z = m._tracedac_zero
        train(m, rank, world, steps=1)  # learns the order of gathers; the step changes the shards
        x, y = data(1)
        log = GatherLog()
        try:
            loss = F.mse_loss(m(x), y)
            alive = log.alive()
            live = live_gathered()
            forward = dict(log.counts)
            log.counts.clear()
            loss.backward()
            backward = dict(log.counts)
        finally:
            log.close()
        # how many units gather each group: its owner, and units borrowing a shared parameter
        users = dict(collections.Counter(g.key for u in z.all_units for g in u.groups))
        grads = all(p.grad is not None for p in m.parameters() if p.requires_grad)
        with check(f"{where} alive"):
            assert alive == 0 and live == 0, (alive, live)
            assert grads
        with check(f"{where} gathers"):
            assert forward == users, (forward, users)
            assert backward, backward
            assert all(backward[k] == users[k] for k in backward), (backward, users)
        with check(f"{where} prefetched"):
            gathers = sum(forward.values()) + sum(backward.values())
            assert log.starts == gathers, (log.starts, gathers)
            assert log.prefetched >= gathers // 2, (log.prefetched, gathers)


def unconsumed(rank, world):
    """The order changes (a layer skipped, on every rank): the gather prefetched for it is
    waited for and dropped when the forward (root post-hook) or the backward (engine callback)
    ends, not left in flight until the next pass."""
    torch.manual_seed(0)
    ref = Skipping()
    m = zero.shard(Skipping())
    zero.load_full_state_dict(m, ref.state_dict())
    x = torch.randn(3, 4)  # every rank the same batch: gradients average to the same
    z = m._tracedac_zero
    m(x).sum().backward()  # learns the orders: forward 0, 1, 2; backward 2, 1 (0's input x needs no grad)

    def in_flight():
        return [g.name for g in z.all_groups if g.pending is not None] + [g.name for g in z.state.inflight]

    passes = []  # per pass: (gathers started beyond those consumed, what is in flight after it)
    log = GatherLog()
    try:
        with torch.no_grad():
            m(x, skip=2)  # layer 1's gather prefetches layer 2's, never used
        passes.append((log.starts - sum(log.counts.values()), in_flight()))
        for p in m.parameters():
            p.grad = None
        log.starts, log.counts = 0, collections.Counter()
        m(x, skip=0).sum().backward()  # backward: 2 prefetches 1, which now reads x: never used
        passes.append((log.starts - sum(log.counts.values()), in_flight()))
    finally:
        log.close()
    ref(x, skip=0).sum().backward()
    diff = (m.layers[1].weight.grad.full_tensor() - ref.layers[1].weight.grad).abs().max().item()
    assert passes == [(1, []), (1, [])], passes  # one more start than gathers: the one dropped
    assert diff < 1e-6 and m.layers[0].weight.grad is None, (diff, m.layers[0].weight.grad)


def mixed(rank, world):
    """bf16 gradients within 2% of fp32 ones (relative norm), reduce-scattered in bf16 too;
    all-gathers move <= 0.55x the bytes. Only Linear parameters travel in bf16."""
    ref = model()
    x, y = data(0)
    F.mse_loss(ref(x), y).backward()
    ref_grads = flat_grads(ref)
    x, y = rank_batch(0, rank, world)
    res = {}
    for name, mp in (
        ("fp32", None),
        ("bf16", zero.MixedPrecision()),
        ("bf16-reduce", zero.MixedPrecision(reduce_dtype=torch.bfloat16)),
    ):
        m = zero.shard(model(), mixed_precision=mp)
        log = GatherLog()
        try:
            F.mse_loss(m(x), y).backward()
        finally:
            log.close()
        error = ((full_grads(m) - ref_grads).norm() / ref_grads.norm()).item()
        res[name] = (error, log.bytes)
    (fp32_error, fp32_bytes), (bf16_error, bf16_bytes) = res["fp32"], res["bf16"]
    assert fp32_error < 1e-6, res
    assert 0 < bf16_error < 2e-2, res
    assert 0 < res["bf16-reduce"][0] < 2e-2, res  # gradients reduce-scattered in bf16 too
    assert bf16_bytes <= 0.55 * fp32_bytes, res


def state_dicts(rank, world, tmp):
    """Full, rank-0-only and DCP round trips exact; clip_grad_norm_ equals torch's; each
    element on one rank, each rank about 1/world of them. Returns rank 0's full state dict (what
    the DCP checkpoint in ``tmp`` holds), for a load on another world size."""
    import torch.distributed.checkpoint as dcp

    ref_sd, ref_norm = reference(steps=2, clip=0.05)
    m = zero.shard(model())
    norm = train(m, rank, world, steps=2, clip=0.05)
    clip = (abs(norm.item() - ref_norm.item()), max_diff(zero.full_state_dict(m), ref_sd))

    full = zero.full_state_dict(m)
    keys = list(full) == list(model().state_dict())
    rank0_only = len(zero.full_state_dict(m, rank0_only=True))
    fresh = zero.shard(model(seed=1))
    zero.load_full_state_dict(fresh, full)
    roundtrips = {"full_roundtrip": max_diff(zero.full_state_dict(fresh), full)}

    dcp.save(m.state_dict(), checkpoint_id=tmp)  # the model's own DTensors: DCP as is
    other = zero.shard(model(seed=2))
    sd = other.state_dict()
    dcp.load(sd, checkpoint_id=tmp)
    other.load_state_dict(sd)
    roundtrips["dcp_roundtrip"] = max_diff(zero.full_state_dict(other), full)
    # the loaded model trains on exactly as the saved one
    train(m, rank, world, steps=1)
    train(other, rank, world, steps=1)
    roundtrips["after_step"] = max_diff(zero.full_state_dict(other), zero.full_state_dict(m))
    shard_numel = sum(p.to_local().numel() for p in m.parameters())
    total = sum(p.numel() for p in {id(p): p for p in model().parameters()}.values())
    every = torch.tensor(shard_numel)
    dist.all_reduce(every)
    assert every.item() == total, (every, total)  # each element on one rank
    norm_diff, params_diff = clip
    assert norm_diff < 1e-5 and params_diff < 1e-5, clip
    assert keys
    assert rank0_only == (31 if rank == 0 else 0), rank0_only
    assert roundtrips == dict.fromkeys(roundtrips, 0.0), roundtrips
    assert 0.4 * total <= shard_numel <= 0.6 * total, (
        shard_numel,
        total,
    )  # about 1/world: rows, not elements
    return full


def mismatched(rank, world):
    """Ranks with different models: refused at shard time, naming the parameter and both shapes."""
    message = message_of(zero.ZeroError, zero.shard, Model(d=D + 4 * rank))
    assert "embed.weight" in message and "(16, 16)" in message and "(20, 20)" in message, message


def dead_rank(rank, world):
    """Rank 1 dies before the step's first all-gather: rank 0 raises within its timeout."""
    m = zero.shard(model(), timeout=3)
    if rank == 1:
        os._exit(0)  # dies before the step's first all-gather
    x, y = data(0)
    start = time.monotonic()
    try:
        m(x).sum().backward()
    except zero.ZeroError as e:
        elapsed, message = time.monotonic() - start, str(e)
    else:
        raise AssertionError("rank 0 ran its step without its partner")
    assert "all-gather" in message and "rank 0 of 2" in message, message
    assert elapsed < 3 + 5, elapsed


def absent_rank(rank, world):
    """Rank 1 never calls shard(): rank 0 raises within shard's timeout."""
    if rank == 1:
        time.sleep(4)  # alive, but elsewhere, past rank 0's timeout
        os._exit(0)
    start = time.monotonic()
    try:
        zero.shard(model(), timeout=2)
    except zero.ZeroError as e:
        elapsed, message = time.monotonic() - start, str(e)
    else:
        raise AssertionError("rank 0 sharded without its partner")
    assert "shard()" in message and "within 2 s" in message and "Ranks 1" in message, message
    assert elapsed < 2 + 5, elapsed


def _diverge(rank, world, learned=False):
    """Rank 1 skips block 1: every rank raises ZeroError at the first collective that differs.
    ``learned``: both ranks train a step first (the order of gathers is learned: a unit's
    groups then start together after one check, and the next unit's are prefetched).
    Returns (seconds, message, gathered buffers a unit still holds)."""
    m = zero.shard(model(tie=False), timeout=20)
    if learned:
        train(m, rank, world, steps=1)
    m.skip = (1,) if rank == 1 else ()
    x, y = rank_batch(int(learned), rank, world)
    start = time.monotonic()
    try:
        F.mse_loss(m(x), y).backward()
    except zero.ZeroError as e:
        return time.monotonic() - start, str(e), live_gathered()
    return time.monotonic() - start, None, live_gathered()


def diverge(rank, world):
    """Blocks 1 and 2 have the same sizes: without the order check the ranks would pair their
    gathers silently; with other sizes gloo would abort the process."""
    elapsed, message, live = _diverge(rank, world)
    assert message is not None and "blocks.1" in message and "blocks.2" in message, message
    assert elapsed < 10, elapsed  # at once, not after the 20 s timeout
    assert live == 0, live


def diverge_after_a_step(rank, world):
    elapsed, message, live = _diverge(rank, world, learned=True)
    assert message is not None and "blocks.2" in message and "last pass's order" in message, message
    assert elapsed < 10, elapsed
    assert live == 0, live


def diverge_in_backward(rank, world):
    """Under "auto" (three groups a block), after a step has taught the order in which a
    unit's groups reduce together: rank 1's block 2 reads its own parameter detached, so that
    group gets no gradient there. Every rank raises ZeroError at the first collective that
    differs. Both raise, naming the reduce-scatter."""
    m = zero.shard(model(tie=False), mixed_precision=zero.MixedPrecision("auto"), timeout=20)
    train(m, rank, world, steps=1)
    m.blocks[2].odd_constant = rank == 1
    x, y = rank_batch(1, rank, world)
    start = time.monotonic()
    try:
        F.mse_loss(m(x), y).backward()
    except zero.ZeroError as e:
        elapsed, message = time.monotonic() - start, str(e)
    else:
        elapsed, message = time.monotonic() - start, None
    assert message is not None and "reduce-scatter" in message and "blocks.2" in message, message
    assert elapsed < 10, elapsed


def twin_checks(rank, world):
    """The ranks' agreements through a gloo twin of the process group, as on NCCL (the group
    reported as NCCL to ``host_group``): "auto" trains as with its checks on the group itself,
    every order check's rows go through the twin and none through the group, and ranks that
    diverge after a step still all raise."""
    from tracedac import agreements as hg

    want, _ = train_logged(
        zero.shard(model(tie=False), mixed_precision=zero.MixedPrecision("auto")), rank, world
    )
    real_backend, real_gather, routes = hg._backend, zgroup._all_gather, collections.Counter()
    group = zero.shard(model(tie=False))._tracedac_zero.all_groups[0].group  # the model's

    def gather(out, src, **kw):
        if out.dtype == torch.int64:  # an order check's rows
            routes["group" if kw["group"] is group else "twin"] += 1
        return real_gather(out, src, **kw)

    hg._backend = lambda g: "nccl" if g is group else real_backend(g)
    zgroup._all_gather = gather
    try:
        m = zero.shard(model(tie=False), mixed_precision=zero.MixedPrecision("auto"))
        losses, _ = train_logged(m, rank, world)
        _, message, _ = _diverge(rank, world, learned=True)
    finally:
        hg._backend, zgroup._all_gather = real_backend, real_gather
    assert losses == want, (losses, want)
    assert routes.get("twin", 0) > 0 and "group" not in routes, routes
    assert message is not None and "blocks.2" in message and "last pass's order" in message, message


def checks(rank, world):
    """Order checks, groups gathered and reduced, and collectives sent per step under "auto"
    (three groups per block), with prefetching (a unit's groups start together and reduce
    together) and without (each checked and sent alone), and under the module list; the
    losses of each, and the parameters after. The fourth of five steps skips block 1 on every
    rank: the order learned from the third no longer holds, and the fifth's was learned from
    the fourth."""
    out, params = {}, {}
    for name, mp, prefetch in (
        ("listed", zero.MixedPrecision(), True),
        ("auto", zero.MixedPrecision("auto"), True),
        ("auto-alone", zero.MixedPrecision("auto"), False),
    ):
        m = zero.shard(model(tie=False), mixed_precision=mp, prefetch=prefetch)

        def read(log, m=m):
            m.skip = (1,) if len(m.logged) == 2 else ()  # for the next step
            m.logged.append(None)
            return dict(log.counted)

        m.logged = []
        losses, counts = train_logged(m, rank, world, steps=5, log=CheckLog, read=read)
        params[name] = zero.full_state_dict(m)
        out[name] = dict(
            losses=losses, counts=counts, groups=len({g.key for g in m._tracedac_zero.all_groups})
        )
    diff = max_diff(params["auto"], params["auto-alone"])
    auto, alone, listed = out["auto"], out["auto-alone"], out["listed"]
    assert auto["losses"] == alone["losses"] == listed["losses"], out
    assert diff == 0.0, diff
    assert auto["groups"] > listed["groups"], out
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
    assert learned["all-gather"] == one_each["all-gather"], out  # the same groups gathered
    assert learned["sent all-gather"] == as_listed["sent all-gather"] < learned["all-gather"] // 2, out
    assert learned["sent reduce-scatter"] == as_listed["sent reduce-scatter"], out
    assert learned["sent reduce-scatter"] == learned["sent all-gather"] // 2, out  # one a unit
    assert learned["sent reduce-scatter"] < learned["reduce-scatter"] // 2, out
    # The step without block 1 ran out of the learned order (it would send two fewer
    # all-gathers than a learned step if every unit's still went as one): some went alone.
    broken = auto["counts"][3]
    assert broken["sent all-gather"] > learned["sent all-gather"] - 2, out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("dcp"))
    parts = [
        (mismatched,),
        (diverge,),
        (diverge_after_a_step,),
        (diverge_in_backward,),
        (twin_checks,),
        (checks,),
        (trains_as_one_process,),
        (memory,),
        (unconsumed,),
        (mixed,),
        (state_dicts, tmp),
    ]
    return run_parts(2, parts, timeout=240), tmp


def test_two_ranks_train_as_one_process_on_the_combined_batch_with_and_without_checkpoint_regions(two_ranks):
    """Regions around the units (wrapped before or after sharding) and inside them; the
    blocks count their calls in a buffer, which full_state_dict compares too: once per step."""
    two_ranks[0].passed("trains_as_one_process")


@pytest.mark.parametrize("world, variants", [(3, ("plain", "wrap-after")), (4, ("inside-unit",))])
def test_three_and_four_ranks_train_as_one_process(world, variants):
    run_ranks(trains_as_one_process, world, variants, timeout=180)


@pytest.mark.parametrize("where", VARIANTS)
def test_after_forward_no_gathered_buffer_is_alive(two_ranks, where):
    two_ranks[0].passed(f"{where} alive")


@pytest.mark.parametrize("where", VARIANTS)
def test_backward_gathers_each_group_once_for_each_unit_that_uses_it(two_ranks, where):
    """Frozen groups are never saved for backward, so they are not gathered again."""
    two_ranks[0].passed(f"{where} gathers")


def test_a_prefetched_gather_nobody_consumes_completes_when_its_pass_ends(two_ranks):
    """The order changes (a layer skipped): the gather prefetched for it is waited for and
    dropped when the forward or the backward ends, not left in flight until the next pass
    (one more start than gathers in each pass: the one dropped); gradients still equal the
    unsharded model's."""
    two_ranks[0].passed("unconsumed")


@pytest.mark.parametrize("where", VARIANTS)
def test_gathers_are_prefetched_and_none_is_wasted(two_ranks, where):
    two_ranks[0].passed(f"{where} prefetched")


def test_bf16_trains_close_to_fp32_and_gathers_at_most_055_of_the_bytes(two_ranks):
    """Only Linear parameters travel in bf16; the LayerNorms, the odd and frozen ones stay fp32."""
    two_ranks[0].passed("mixed")


def test_state_dicts_round_trip_and_clipping_matches_torch(two_ranks):
    two_ranks[0].passed("state_dicts")


def test_a_dcp_checkpoint_saved_by_two_ranks_loads_into_one(two_ranks, world1):
    """The parameters are Shard(0) DTensors, so DCP reshards them to another world size."""
    import torch.distributed.checkpoint as dcp

    saved = two_ranks[0].values("state_dicts")[0]  # rank 0's full state dict, which it saved
    m = zero.shard(model(seed=3))
    sd = m.state_dict()
    dcp.load(sd, checkpoint_id=two_ranks[1])
    m.load_state_dict(sd)
    loaded = zero.full_state_dict(m)
    assert [k for k in saved if not (loaded[k] == saved[k]).all()] == []


def test_ranks_with_different_models_are_refused_at_shard_time_naming_the_parameter(two_ranks):
    two_ranks[0].passed("mismatched")


def test_ranks_that_run_different_units_all_raise_at_once_instead_of_exchanging_wrong_values(two_ranks):
    """Blocks 1 and 2 have the same sizes: without the order check the ranks would pair
    their gathers silently; with other sizes gloo would abort the process."""
    two_ranks[0].passed("diverge")


def test_ranks_that_diverge_after_the_order_is_learned_raise_too(two_ranks):
    """From the second step a unit's groups start together after one check, and the next
    unit's are prefetched, as the last pass ran them: both ranks prefetch block 1; rank 0
    uses it and prefetches block 2's two groups together, rank 1 (block 1 skipped) is at
    block 2's first group out of that order. Both raise there, naming it; no process is
    left holding a gathered unit."""
    two_ranks[0].passed("diverge_after_a_step")


def test_ranks_whose_unit_reduces_other_groups_raise_instead_of_pairing_reductions(two_ranks):
    """A unit's groups reduce in one collective once the order is learned; where one of them
    gets no gradient on one rank, the ranks would pair reduce-scatters of different sizes.
    Both raise, naming the reduce-scatter, before anything is exchanged."""
    two_ranks[0].passed("diverge_in_backward")


def test_on_nccl_the_order_checks_go_through_a_gloo_twin_and_still_catch_ranks_that_diverge(two_ranks):
    """On NCCL a check's rows on the GPU made the host wait for every kernel queued before each
    collective; they go through a gloo twin of the group instead (``host_group``), here with
    the gloo group reported as NCCL: the same losses, every check on the twin, and ranks that
    leave the learned order raise as before."""
    two_ranks[0].passed("twin_checks")


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
    two_ranks[0].passed("checks")


def test_a_rank_that_dies_makes_the_others_fail_within_the_timeout():
    run_ranks(dead_rank, 2, timeout=60)


def test_a_rank_that_never_reaches_shard_makes_the_others_fail_within_the_timeout():
    run_ranks(absent_rank, 2, timeout=60)
