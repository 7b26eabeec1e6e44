"""``policies.peak(budget)``: one budget for a whole model's step, measured from outside tracedac.

Every peak here is read by ``tests/support/live_bytes.LivePeak``: the bytes of every live tensor
storage of the process, counted by a dispatch mode and weak references around the whole step
(forward, backward, optimizer), apart from the library's own meter.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import itertools
import random
import re

import pytest
import torch

import tracedac
from tracedac import CheckpointError, policies
from tracedac.integrations import hf
from tracedac.policies import meter as meters
from tracedac.policies.peak import Point, allocate, knapsack_frontier, parse_bytes
from tracedac.policies.plan_cache import plans
from tracedac.policies.planners import knapsack

from .support.decoders import Block, DecoderLayer, llama, moe
from .support.hf_models import batch as hf_batch
from .support.hf_models import build, needs_switch
from .support.hf_models import loss as hf_loss
from .support.live_bytes import LivePeak

MiB = 1 << 20


def alive() -> int:
    """The bytes of every live tensor storage of the process now."""
    gc.collect()
    return LivePeak.everything().level


# What the process held before the test began: the tests before it in the same process may
# leave tensors alive (caches, fixtures: ~250 MiB in one CI run), which count on the device as
# any other bytes do. Each slack below is a fraction of what the test's own model adds to it,
# never of the process's total (1 % of 250 MiB would cover this model's whole range).
FLOOR = [0]


def fits(measured: int, budget: int, slack: float = 0.01) -> bool:
    """``measured`` within ``budget``, up to ``slack`` of what is above the floor."""
    return measured - FLOOR[0] <= (budget - FLOOR[0]) * (1 + slack)


def above(a: int, b: int, frac: float) -> bool:
    """``a`` exceeds ``b`` by more than ``frac`` of what ``b`` holds above the floor."""
    return a - FLOOR[0] > (b - FLOOR[0]) * (1 + frac)


def grown(b: int, frac: float) -> int:
    """``b`` plus ``frac`` of what it holds above the floor."""
    return FLOOR[0] + int((b - FLOOR[0]) * (1 + frac))


@pytest.fixture(autouse=True)
def floor():
    FLOOR[0] = alive()
    return FLOOR[0]


@pytest.fixture(autouse=True)
def no_meter_left():
    """The CPU meter is a dispatch mode: a test that leaves one running would slow and change
    every test after it. Each test ends its measured steps (an optimizer step, or close())."""
    yield
    assert torch._C._len_torch_dispatch_stack() == 0, "a measured step was left open"


def train(model, batch, steps: int, opt=None, measure: bool = True) -> list[int]:
    """The peak of each of ``steps`` training steps (AdamW), everything on the device counted."""
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-3)
    peaks = []
    for _ in range(steps):
        gc.collect()
        with LivePeak.everything() if measure else contextlib.nullcontext() as live:
            loss = model(*batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del loss
        peaks.append(live.peak if measure else None)
    return peaks


def steady_peak(make, policy=None, steps: int = 3) -> int:
    """The peak of a trained step (optimizer state made) of ``make()``'s model under ``policy``."""
    model, batch = make()
    if policy is not None:
        tracedac.wrap(model, (DecoderLayer, Block), policy=policy)
    peak = train(model, batch, steps)[-1]
    del model
    gc.collect()
    return peak


@pytest.fixture(scope="module")
def llama_excess():
    """Full recompute's and no checkpointing's peaks of the small Llama, as trained steps, less
    what the process held before."""
    base = alive()
    return steady_peak(llama, policies.recompute_all()) - base, steady_peak(llama) - base


@pytest.fixture
def llama_range(llama_excess, floor):
    """The two peaks over what the process holds at the test's start."""
    return floor + llama_excess[0], floor + llama_excess[1]


def test_a_budget_is_bytes_or_a_string_with_a_unit_and_nothing_else():
    """A float would be read as memory_budget's fraction by one user and as bytes by another."""
    assert parse_bytes("70GiB") == 70 * 2**30
    assert parse_bytes("1.5 GB") == 1_500_000_000
    assert parse_bytes("512mib") == 512 * MiB
    assert parse_bytes(12345) == 12345
    assert repr(policies.peak("70GiB")) == "peak('70GiB')"
    with pytest.raises(TypeError, match=r"peak\(70000000000\)"):
        policies.peak(70e9)
    with pytest.raises(TypeError, match="int of bytes"):
        policies.peak(True)
    with pytest.raises(ValueError, match="KiB, MiB, GiB"):
        policies.peak("70 gigs")
    with pytest.raises(ValueError, match="positive"):
        policies.peak(0)
    with pytest.raises(TypeError, match="Meter"):
        policies.peak("1GiB", meter=3)


def test_one_peak_object_per_model_compares_by_identity():
    """It coordinates the regions that share it: two models must not share plans by equality."""
    a, b = policies.peak("1GiB"), policies.peak("1GiB")
    assert a == a and a != b and len({a, b}) == 2
    assert copy.deepcopy(a).state is not a.state


@pytest.mark.slow
def test_the_measured_peak_stays_within_every_budget_from_full_recompute_to_none_and_grows_with_it(
    llama_range,
):
    """The promise is the device's: measured from outside, at eight budgets spanning the range,
    each trained step within its budget (+1 %) and a larger budget never peaking lower."""
    least, most = llama_range
    budgets = [least + (most - least) * i // 7 for i in range(8)]
    peaks = []
    for budget in budgets:
        policy = policies.peak(budget)
        measured = steady_peak(llama, policy, steps=4)
        assert fits(measured, budget), (budget, measured, str(policy.report()))
        peaks.append(measured)
    assert peaks == sorted(peaks), peaks
    assert peaks[-1] > peaks[0], "the largest budget kept nothing more than the least"


def test_within_its_budget_a_plan_replays_less_and_steps_bitwise_as_without_checkpointing(llama_range):
    """A budget halfway keeps something (less replay than full recompute), and what it keeps or
    replays never changes a value: the losses and weights of three steps equal no checkpointing's."""
    least, most = llama_range

    def steps(model, batch):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for _ in range(3):
            loss = model(*batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        return torch.stack(losses), torch.cat([p.detach().flatten() for p in model.parameters()])

    plain_losses, plain_weights = steps(*llama())
    model, batch = llama()
    policy = policies.peak((least + most) // 2 + plain_weights.nbytes)  # (those weights are alive too)
    tracedac.wrap(model, DecoderLayer, policy=policy)
    losses, weights = steps(model, batch)
    assert torch.equal(plain_losses, losses) and torch.equal(plain_weights, weights)
    report = policy.report()
    assert report is not None and report.estimate <= policy.budget
    assert sum(extra for _, extra, _, _ in report.regions) > 0
    assert sum(c[0] for _, _, c, _ in report.regions) < sum(c[0] for _, _, _, c in report.regions)
    assert repr(policy) in str(report) and "layers.0" in str(report)


def test_the_measuring_step_runs_as_full_recompute_so_planning_never_exceeds_the_budget(llama_range):
    """A user at the edge of the device must not run out of memory while tracedac learns: the
    first step keeps what full recompute keeps, whatever the budget."""
    least, _ = llama_range
    model, batch = llama()
    first = train(model, batch, 1)[0]
    del model
    recompute, batch = llama()
    tracedac.wrap(recompute, DecoderLayer, policy=policies.recompute_all())
    full_recompute_first = train(recompute, batch, 1)[0]
    del recompute
    model, batch = llama()
    policy = policies.peak(grown(least, 0.01))  # at the edge
    tracedac.wrap(model, DecoderLayer, policy=policy)
    peaks = train(model, batch, 3)
    assert fits(peaks[0], full_recompute_first, 0.001) and above(first, full_recompute_first, 0.001)
    assert fits(max(peaks), least)


def test_a_budget_below_the_least_reachable_peak_names_the_least_and_what_holds_it(llama_range):
    """The user learns the number to ask for, and where the step peaks, in the step after the
    one that measured it (which ran keeping the least, so it fit if anything does)."""
    least, _ = llama_range
    model, batch = llama()
    tracedac.wrap(model, DecoderLayer, policy=policies.peak(grown(least, -0.1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, batch, 1, opt)
    with pytest.raises(CheckpointError, match="cannot be met") as e:
        train(model, batch, 1, opt)
    said = re.search(r"least peak tracedac reaches on this step is ([0-9.]+) MiB", str(e.value))
    assert said is not None, str(e.value)
    assert abs(float(said.group(1)) * MiB - least) <= 0.01 * (least - FLOOR[0]), (said.group(1), least / MiB)
    assert "It occurs from" in str(e.value) and "raise the budget to at least" in str(e.value)
    # it said so once; the model still trains, keeping the least
    assert fits(train(model, batch, 2, opt)[-1], least)


def test_a_step_over_its_budget_is_planned_again_once_and_the_next_fits(llama_range):
    """The plan is made from one step: what that step could not show (here a tensor the
    program starts keeping in the middle of the next step, after the plan was made) shows in the
    step after planning, which is measured; the plan is made again from both, and holds."""
    least, most = llama_range
    model, batch = llama()
    budget = (least + most) // 2
    policy = policies.peak(budget)
    tracedac.wrap(model, DecoderLayer, policy=policy)
    ballast = []
    calls = []

    def keep_more(module, args):  # from the second step on, between the layers and the head
        calls.append(1)
        if len(calls) == 2:
            ballast.append(torch.empty((most - least) // 4, dtype=torch.uint8))

    model.norm.register_forward_pre_hook(keep_more)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    peaks = train(model, batch, 4, opt)
    report = policy.report()
    assert report.replanned
    assert report.measured[0] > budget >= report.measured[1], report.measured
    assert fits(peaks[-1], budget)


def test_after_planning_no_meter_is_left_and_regions_decide_from_the_cached_plan(llama_range):
    """The CPU meter is a dispatch mode: once the plan holds, nothing of it runs any more, and a
    planned region never plans again (its plan was put in the plan cache for it)."""
    least, most = llama_range
    model, batch = llama()
    tracedac.wrap(model, DecoderLayer, policy=policies.peak((least + most) // 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, batch, 3, opt, measure=False)
    assert torch._C._len_torch_dispatch_stack() == 0
    made = plans.made
    train(model, batch, 2, opt, measure=False)
    assert plans.made == made


def test_a_program_stopped_in_a_measured_step_leaves_no_mode_after_close():
    """The meter is removed at the end of the step's optimizer step; a step that never gets there
    (the last one, an exception) is ended by close() or when the policy goes."""
    model, batch = llama(layers=1)
    policy = policies.peak("1GiB")
    tracedac.wrap(model, DecoderLayer, policy=policy)
    model(*batch).backward()  # no optimizer: the measured step is still open
    assert torch._C._len_torch_dispatch_stack() == 1
    policy.close()
    assert torch._C._len_torch_dispatch_stack() == 0


def test_the_cpu_meter_counts_live_storages_and_their_peak_between_marks():
    meter = meters.TensorMeter()
    x = torch.randn(64, 64)  # 16 KiB, alive before
    start = meter.start()
    assert start >= x.nbytes
    y = x @ x  # +16 KiB
    z = (y * 2).relu()  # +16 KiB kept, +16 KiB passing (the product before relu)
    now, most = meter.mark()
    assert now - start == 2 * x.nbytes and most - start == 3 * x.nbytes
    del y, z
    now, most = meter.mark()
    assert now == start and most - start == 2 * x.nbytes
    meter.stop()
    assert torch._C._len_torch_dispatch_stack() == 0


@pytest.mark.parametrize("seed", range(20))
def test_allocate_finds_the_cheapest_plan_within_the_budget_and_its_estimate_grows_with_it(seed):
    """Checked against every choice of three regions' points: the least summed cost whose
    estimate (each prefix's base plus the prefix's extra bytes) is within the budget; and over
    budgets, the estimate never falls as the budget grows (the monotone promise)."""
    rng = random.Random(seed)
    frontiers = []
    for _ in range(3):
        extras = sorted(rng.sample(range(1, 40), 3))
        costs = sorted((rng.randrange(100) for _ in range(3)), reverse=True)
        frontiers.append(
            [Point(0, 0, (100 + rng.randrange(50), 0, 0))]
            + [Point(e, e, (c, 0, 0)) for e, c in zip(extras, costs)]
        )
    bases = {p: rng.randrange(50) for p in range(-1, 3) if rng.random() < 0.8}

    def estimate(choice):
        extra = [frontiers[j][i].extra for j, i in enumerate(choice)]
        return max(b + sum(extra[: p + 1]) for p, b in bases.items()) if bases else 0

    last = -1
    for budget in range(0, 200, 7):
        feasible = [
            (sum(frontiers[j][i].cost[0] for j, i in enumerate(c)), estimate(c))
            for c in itertools.product(range(4), repeat=3)
            if estimate(c) <= budget
        ]
        found = allocate(frontiers, bases, budget)
        if not feasible:
            assert found is None
            continue
        picked, est = found
        cost = sum(frontiers[j][i].cost[0] for j, i in enumerate(picked))
        assert (cost, est) == min(feasible)
        assert est == estimate(picked) and est >= last
        last = est


@pytest.mark.parametrize("seed", range(10))
def test_a_regions_frontier_is_the_knapsacks_choice_at_each_capacity_it_lists(seed):
    """Read back from one table, each subset must be what memory_budget's knapsack keeps at
    that capacity (the same value, the least weight reaching it), most weight first, and no
    capacity between two listed ones may reach a value the list skips."""
    rng = random.Random(seed)
    weights = [rng.randrange(1, 30) for _ in range(8)]
    values = [(rng.randrange(50), rng.randrange(5)) for _ in range(8)]
    subsets = knapsack_frontier(weights, values, points=1000)

    def value(chosen):
        return tuple(sum(values[i][k] for i in chosen) for k in range(2))

    sizes = [sum(weights[i] for i in c) for c in subsets]
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] == 0
    for c, size in zip(subsets, sizes):
        best, _ = knapsack(weights, values, size)
        assert value(c) == value(best) and sum(weights[i] for i in best) == size
    for capacity in range(sum(weights) + 1):
        best, _ = knapsack(weights, values, capacity)
        listed = max(value(c) for c, size in zip(subsets, sizes) if size <= capacity)
        assert listed == value(best)


@pytest.mark.slow
def test_the_moe_model_whose_expert_shapes_change_every_step_stays_within_budgets():
    """Routing changes the experts' shapes each step, so a cached plan seldom applies whole:
    regions plan again at their end, within the bytes their share allows, and the re-plan after
    the checked step absorbs what holding the forward costs. The step's own peak moves with the
    routing (dropout draws anew each step), by a few KiB here: monotone up to that (1 %)."""
    least = steady_peak(moe, policies.recompute_all())
    most = steady_peak(moe)
    peaks = []
    for budget in (least + (most - least) // 3, least + 2 * (most - least) // 3, most):
        measured = steady_peak(moe, policies.peak(budget), steps=5)
        assert fits(measured, budget), (budget, measured)
        peaks.append(measured)
    assert all(above(b, a, -0.01) for a, b in zip(peaks, peaks[1:])), peaks
    assert above(peaks[-1], peaks[0], 0.01), peaks


@pytest.mark.slow
def test_moe_gradients_under_a_peak_budget_equal_no_checkpointing_bitwise():
    """Dropout and data-dependent expert shapes: replay draws the same numbers and rebuilds
    the same shapes, so every gradient is the one without checkpointing."""
    plain, batch = moe(layers=2)
    model = copy.deepcopy(plain)
    least = steady_peak(lambda: moe(layers=2), policies.recompute_all())
    policy = policies.peak(int(least * 1.3))
    tracedac.wrap(model, Block, policy=policy)
    for step in range(3):
        torch.manual_seed(step)
        g0 = torch.autograd.grad(plain(*batch), list(plain.parameters()))
        torch.manual_seed(step)
        g1 = torch.autograd.grad(model(*batch), list(model.parameters()))
        for a, b in zip(g0, g1, strict=True):
            assert torch.equal(a, b)
    policy.close()  # (no optimizer step ends the step being checked)


def _hf_steps(model, inputs, steps, measure=True):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    peaks = []
    for _ in range(steps):
        gc.collect()
        with LivePeak.everything() if measure else contextlib.nullcontext() as live:
            hf_loss(model, inputs).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        peaks.append(live.peak if measure else None)
    return peaks


@needs_switch
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_hf_enable_takes_a_peak_budget_and_keeps_the_step_within_it():
    """Through transformers' own switch (hf.enable), the layers are the regions the budget plans."""
    inputs = hf_batch(4, 64)

    def run(policy, steps=3):
        model = build("llama", hidden=64, layers=3)
        if policy is not None:
            hf.enable(model, policy)
        peaks = _hf_steps(model, inputs, steps)
        del model
        gc.collect()
        return peaks[-1]

    least, most = run(policies.recompute_all()), run(None)
    budget = (least + most) // 2
    policy = policies.peak(budget)
    assert fits(run(policy, steps=4), budget)
    names = [name for name, *_ in policy.report().regions]
    assert names == ["model.layers.0", "model.layers.1", "model.layers.2"]
    assert sum(extra for _, extra, _, _ in policy.report().regions) > 0


def test_under_tracedac_zero_the_budget_counts_gathered_parameters_and_holds(world1):
    """ZeRO-3's gathered buffers are on the device during the step: measured with the rest,
    so the plan fits around them; the losses are those of the sharded model without checkpointing."""
    import tracedac.zero as zero

    def run(policy, steps=4):
        model, batch = llama()
        zero.shard(model, units=DecoderLayer)
        if policy is not None:
            tracedac.wrap(model, DecoderLayer, policy=policy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        peaks, losses = [], []
        for _ in range(steps):
            gc.collect()
            with LivePeak.everything() as live:
                loss = model(*batch)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            peaks.append(live.peak)
            losses.append(loss.detach())
        del model, opt, loss
        gc.collect()
        return peaks[-1], torch.stack(losses)

    most, plain = run(None)
    least, _ = run(policies.recompute_all())
    budget = (least + most) // 2
    measured, losses = run(policies.peak(budget))
    assert fits(measured, budget)
    assert torch.equal(losses, plain)


def test_compiled_regions_take_the_eager_plans_bytes_and_are_refused_before_one_exists():
    """Compiled, no step is measured per region (the partitioner decides from the graph): a
    region keeps at most the least bytes the eager plan gave a region, memory_budget's way, and
    before any eager step there is nothing to plan from, which the error says with the way out."""
    import torch._dynamo

    torch._dynamo.reset()
    try:
        model, batch = llama(layers=2)
        policy = policies.peak("1GiB")
        tracedac.wrap(model, DecoderLayer, policy=policy)
        compiled = torch.compile(model, backend="aot_eager_decomp_partition")
        with pytest.raises(Exception) as err:
            compiled(*batch)
        cause = getattr(err.value, "inner_exception", err.value)  # dynamo wraps a backend's error
        assert isinstance(cause, CheckpointError) and "Run one training step eagerly first" in str(cause)
        torch._dynamo.reset()
        plain, _ = llama(layers=2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        train(model, batch, 2, opt, measure=False)  # measured and planned eagerly
        plain.load_state_dict(model.state_dict())
        expected = torch.autograd.grad(plain(*batch), list(plain.parameters()))
        got = torch.autograd.grad(compiled(*batch), list(model.parameters()))
        for a, b in zip(expected, got, strict=True):
            torch.testing.assert_close(a, b)
        assert policy.compiled_budget("DecoderLayer") == min(
            policy.state.plan.point(j).budget for j in range(2)
        )
    finally:
        torch._dynamo.reset()


@pytest.mark.slow
def test_peak_trade_off_measures_every_variant_and_each_budget_stays_within_itself():
    """The whole model's frontier: every variant trains on a copy, its peak read by the CPU
    allocator's profiled events (not the meter peak plans with), and the table reads the ratio
    to the fastest torch option within each budget's peak."""
    import torch._dynamo

    model, batch = llama(layers=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    frontier = tracedac.peak_trade_off(
        model,
        DecoderLayer,
        lambda m: m(*batch),
        budgets=3,
        steps=1,
        torch_budgets=(0.0, 1.0),
        compile_backend="aot_eager_decomp_partition",
    )
    torch._dynamo.reset()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "the model was trained"
    labels = [r.label for r in frontier]
    assert {"no checkpoint", "torch checkpoint", "torch selective (matmuls)", "torch compiled (0.0)"} <= set(
        labels
    )
    budgets = [r for r in frontier if r.kind == "tracedac" and r.budget is not None]
    assert len(budgets) == 3 and all(r.error is None for r in budgets)
    for r in budgets:
        assert fits(r.peak, r.budget), (r.label, r.peak, r.budget)
    ordered = sorted(budgets, key=lambda r: r.budget)
    assert [r.peak for r in ordered] == sorted(r.peak for r in ordered)
    plain = next(r for r in frontier if r.kind == "none")
    assert frontier.within(plain.peak) is min(
        (r for r in frontier if r.peak <= plain.peak), key=lambda r: r.step_s
    )
    table = str(frontier)
    assert "x best torch within" in table and "torch.profiler" in table
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    ax = frontier.plot()
    assert ax.get_xlabel().startswith("measured peak")


def test_a_policys_musts_bind_the_plan_and_count_in_the_least_it_can_reach(llama_range):
    """either(save_matmuls(), peak(...)): the matmuls are kept in every step, the measured one
    included, so the least reachable peak is full recompute's plus them, and a budget between
    full recompute's peak and that least is refused, saying so."""
    least, most = llama_range
    model, batch = llama()
    policy = policies.either(policies.save_matmuls(), policies.peak(most))
    tracedac.wrap(model, DecoderLayer, policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    peaks = train(model, batch, 3, opt)
    peak_policy = policy.planner
    assert fits(peaks[-1], most)
    with_matmuls = peak_policy.report().least
    assert above(with_matmuls, least, 0.01)  # the matmuls are kept in the least plan too
    del model, opt
    gc.collect()
    model, batch = llama()
    squeezed = policies.either(policies.save_matmuls(), policies.peak((least + with_matmuls) // 2))
    tracedac.wrap(model, DecoderLayer, policy=squeezed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, batch, 1, opt, measure=False)
    with pytest.raises(CheckpointError, match="cannot be met"):
        train(model, batch, 1, opt, measure=False)


def test_peak_trade_off_of_a_model_tracedac_already_wraps_measures_each_variant_on_a_plain_copy():
    """A user who wrapped the model first (as the guide's loop does) gets the same frontier: each
    copy is made plain before its variant applies (else "no checkpoint" would still replay, and
    wrapping again would nest), and the model itself keeps its regions."""
    plain, batch = llama(layers=1)
    wrapped = copy.deepcopy(plain)
    tracedac.wrap(wrapped, DecoderLayer, policy=policies.recompute_all())

    def frontier(model):
        rows = tracedac.peak_trade_off(
            model, DecoderLayer, lambda m: m(*batch), budgets=1, steps=1, compile_backend=None
        )
        return {r.label: r.peak for r in rows}

    assert frontier(wrapped) == frontier(plain)
    assert tracedac.is_checkpointed(wrapped.layers[0])
