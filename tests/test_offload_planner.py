"""The planner chooses among keep, offload and replay (``memory_budget(b, offload=...)``,
``min_cut(offload=...)``; the cost model is ``tracedac.policies.placement``'s).

Oracles: brute force over every choice of every item (the solver is the least estimated time
within both capacities); the plan without offload (a link too slow to use gives it exactly);
eager autograd (values and gradients, bitwise, under every mix of the three choices);
storage weak references (the bytes the device still holds after the forward, measured
outside the region) and the allocator (the host copies' bytes). On the CPU the "device" is
the host: the figures passed in (``Link``) only steer the decisions, which is what is tested.
"""

from __future__ import annotations

import gc
import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import tracedac
from tracedac import CheckpointError, checkpoint, policies
from tracedac.inspect.saved import record
from tracedac.inspect.tradeoff import _Region
from tracedac.integrations import hf
from tracedac.offload import link
from tracedac.policies import Link, placement
from tracedac.policies.placement import place

from .support.probe import allocated_bytes
from .test_offload import args, block, run
from .test_planners import Block

aten = torch.ops.aten
MM = 2 * 16 * 32 * 64  # FLOPs of each of the block's two matmuls ([16, 32] @ [32, 64], [16, 64] @ [64, 32])
SLOW = Link(bandwidth=1.0, flop_rate=1e9)  # a copy of one byte costs as much as a GFLOP
FAST = Link(bandwidth=1e15, flop_rate=1e9)  # copies cost next to nothing


def problem(fn=block, a=None):
    regions, out = record(fn, a if a is not None else args(), {}, policies.memory_budget(1.0))
    del out
    (region,) = regions
    return _Region(region)


def report(policy, fn=block, a=None):
    return tracedac.saved_report(fn, *(a if a is not None else args()), policy=policy)


def offloaded_ops(r) -> list:
    return sorted((row.op, row.bytes) for row in r.rows if row.kind == "offloaded")


# --- the solver against brute force ------------------------------------------------------


def _brute(weights, keep, hidden, exposed, capacity, hide):
    """The best summed value over every choice (0 replay, 1 keep, 2 hidden, 3 paid), and the
    least device bytes reaching it."""
    best = None
    for choice in itertools.product(range(4), repeat=len(weights)):
        if any(c >= 2 and hidden[i] is None or c == 3 and exposed[i] is None for i, c in enumerate(choice)):
            continue
        kept = sum(w for w, c in zip(weights, choice) if c == 1)
        if kept > capacity or sum(w for w, c in zip(weights, choice) if c == 2) > hide:
            continue
        table = (None, keep, hidden, exposed)
        value = tuple(sum(table[c][i][k] for i, c in enumerate(choice) if c) for k in range(len(keep[0])))
        key = (value, -kept)
        best = key if best is None or key > best else best
    return best[0], -best[1]


def _value_of(kept, moved, weights, keep, hidden, exposed, hide):
    """A plan's value: its offloads split between hidden and paid copies as well as can be."""
    value = [sum(keep[i][k] for i in kept) for k in range(len(keep[0]))]
    best = None
    for r in range(len(moved) + 1):
        for hid in itertools.combinations(moved, r):
            if sum(weights[i] for i in hid) > hide or any(exposed[i] is None for i in moved if i not in hid):
                continue
            v = tuple(
                value[k] + sum(hidden[i][k] for i in hid) + sum(exposed[i][k] for i in moved if i not in hid)
                for k in range(len(value))
            )
            best = v if best is None or v > best else best
    return best


@settings(max_examples=150, deadline=None)
@given(
    items=st.lists(
        st.tuples(
            st.integers(1, 8),  # bytes, in units
            st.integers(0, 50),  # replay cost
            st.integers(0, 30),  # copy cost out and back when paid
            st.integers(0, 3),  # ops
            st.booleans(),  # may be offloaded
        ),
        min_size=1,
        max_size=6,
    ),
    unit=st.sampled_from([1, 64, 4096]),
    capacity=st.integers(0, 24),
    hide=st.integers(0, 24),
)
def test_place_finds_the_least_estimated_time_of_every_choice_within_both_capacities(
    items, unit, capacity, hide
):
    """Keep (device bytes), offload hidden by compute (hidden bytes), offload paid, or replay:
    the solver's plan has the best value brute force finds, within both capacities, and of
    equal plans holds the fewest device bytes."""
    weights = [w * unit for w, *_ in items]
    keep = [(r, 0, o) for _, r, _, o, _ in items]
    hidden = [(r, -w * unit, o) if m else None for w, r, _, o, m in items]
    exposed = [(r - c, -w * unit, o) if m else None for w, r, c, o, m in items]
    capacity, hide = capacity * unit, hide * unit
    kept, moved = place(weights, keep, hidden, exposed, capacity, hide, 4096)
    assert not set(kept) & set(moved) and all(hidden[i] is not None for i in moved)
    assert sum(weights[i] for i in kept) <= capacity
    want, least = _brute(weights, keep, hidden, exposed, capacity, hide)
    assert _value_of(kept, moved, weights, keep, hidden, exposed, hide) == want
    assert sum(weights[i] for i in kept) == least


# --- the decisions -----------------------------------------------------------------------


@pytest.mark.parametrize("b", [0.0, 0.3, 0.6, 1.0, 4096])
@pytest.mark.parametrize("slow", [SLOW, Link(bandwidth=0, flop_rate=1e9)], ids=["slow", "no link"])
def test_a_link_too_slow_to_use_offloads_nothing_and_gives_the_plan_without_offload(b, slow):
    """A copy that costs more than any replay is never chosen, nor one the compute could hide
    (the link moves no byte in the region's compute time): the plan is the one without offload,
    exactly. ``bandwidth=0`` is no link at all."""
    p = problem()
    assert p.place(policies.memory_budget(b, offload=slow)) == (p.plan(policies.memory_budget(b)), set())
    pairs = [(policies.memory_budget(b), policies.memory_budget(b, offload=slow))]
    if b == 0.0:
        pairs.append((policies.min_cut(), policies.min_cut(offload=slow)))
    for plain, slowed in pairs:
        want, got = report(plain), report(slowed)
        assert got.offloaded_bytes == 0
        assert (got.kept_bytes, got.replay_flops, got.replay_ops) == (
            want.kept_bytes,
            want.replay_flops,
            want.replay_ops,
        )


def test_a_fast_link_and_a_tight_budget_offload_what_would_be_replayed():
    """At a budget of nothing, memory_budget replays both matmuls; with a link fast enough that
    a copy costs less than any replay, they go to host memory and replay runs no FLOP."""
    plain = report(policies.memory_budget(0.0))
    assert plain.replay_flops == 2 * MM and plain.kept_bytes == 0
    fast = report(policies.memory_budget(0.0, offload=FAST))
    assert fast.replay_flops == 0 and fast.kept_bytes == 0
    assert offloaded_ops(fast) == [("aten.mm.default", 16 * 32 * 4), ("aten.mm.default", 16 * 64 * 4)]
    assert fast.offloaded_bytes == (16 * 32 + 16 * 64) * 4
    assert fast.replay_ops < plain.replay_ops


def test_an_infinite_bandwidth_offloads_what_replay_would_cost_flops_and_keeps_within_the_budget_first():
    """Copies that cost nothing: whatever has FLOPs to replay and does not fit the budget goes
    to the host. What fits the budget is kept (equal time, no bytes over the link): at the whole
    budget the plan is memory_budget's, nothing offloaded. Ops with no FLOPs (gelu, tanh) cost
    nothing to replay in this model either: they are replayed rather than moved."""
    free = Link(bandwidth=float("inf"), flop_rate=1e9)
    at_zero = report(policies.memory_budget(0.0, offload=free))
    assert at_zero.replay_flops == 0 and at_zero.kept_bytes == 0
    assert [op for op, _ in offloaded_ops(at_zero)] == ["aten.mm.default"] * 2
    whole, plain = report(policies.memory_budget(1.0, offload=free)), report(policies.memory_budget(1.0))
    assert whole.offloaded_bytes == 0 and whole.kept_bytes == plain.kept_bytes and whole.replay_ops == 0
    cut = report(policies.min_cut(offload=free))
    assert cut.kept_bytes == 0 and cut.offloaded_bytes == report(policies.min_cut()).kept_bytes


def _hiding(ratio: float) -> Link:
    """A link over which a byte costs ``ratio`` FLOPs of the device each way."""
    return Link(bandwidth=1e9 / ratio, flop_rate=1e9)


def test_copies_hide_behind_the_regions_compute_and_beyond_it_are_paid_in_full():
    """The overlap assumption: each way, copies overlap the region's forward compute time C.
    The block's forward is 2 * MM FLOPs; at 50 FLOPs a byte the link moves 2 * MM / 50 = 2621
    bytes in C: the 2 KiB matmul result hides, the 4 KiB one does not, and paid in full
    (2 * 4096 * 50 FLOPs out and back) it costs more than its replay (MM): replayed. At 10
    FLOPs a byte both hide. Copies the policy itself asks for (offload_names) fill C first."""
    p = problem()
    assert sum(n.flops for n in p.graph.nodes) == 2 * MM
    r = report(policies.memory_budget(0.0, offload=_hiding(50)))
    assert offloaded_ops(r) == [("aten.mm.default", 16 * 32 * 4)]
    assert r.replay_flops == MM
    r = report(policies.memory_budget(0.0, offload=_hiding(10)))
    assert offloaded_ops(r) == [("aten.mm.default", 16 * 32 * 4), ("aten.mm.default", 16 * 64 * 4)]
    r = report(
        policies.either(policies.offload_names("up"), policies.memory_budget(0.0, offload=_hiding(50)))
    )
    assert offloaded_ops(r) == [("aten.mm.default", 16 * 64 * 4)], "C is spent on the policy's own copy"
    r = report(policies.min_cut(offload=_hiding(50)))
    assert offloaded_ops(r) == [("aten.mm.default", 16 * 32 * 4)], "min_cut moves only what hides"


# --- values, bytes, reports --------------------------------------------------------------

MIXES = {
    "budget 0.0, fast": policies.memory_budget(0.0, offload=FAST),
    "budget 0.3, medium": policies.memory_budget(0.3, offload=Link(1e12, 1e9)),
    "budget 0.3, hiding one": policies.memory_budget(0.3, offload=_hiding(50)),
    "budget 4096 bytes, free": policies.memory_budget(4096, offload=Link(float("inf"), 1e9)),
    "budget 0.6, slow": policies.memory_budget(0.6, offload=SLOW),
    "time cost": policies.memory_budget(0.2, cost="time", offload=Link(1e12, 1e9)),
    "min_cut hiding one": policies.min_cut(offload=_hiding(50)),
    "min_cut replaying matmuls": policies.min_cut(replay_matmuls=True, offload=FAST),
    "with offload_names": policies.either(
        policies.offload_names("up"), policies.memory_budget(0.3, offload=FAST)
    ),
    "with save_names": policies.either(policies.save_names("up"), policies.memory_budget(0.5, offload=FAST)),
}


@pytest.mark.parametrize("policy", MIXES.values(), ids=MIXES.keys())
def test_every_mix_of_keep_offload_and_replay_gives_eagers_values_and_gradients_bitwise(policy):
    """The three choices move or rebuild a tensor and never change a bit. Twice: the first call
    plans at the region's end (and moves its choice to the host there), the second decides each
    node from the cached plan while recording (copying at once)."""
    a = args()
    eager = run(block, a)
    f = checkpoint(block, policy=policy)
    for _ in range(2):
        got = run(f, a)
        assert torch.equal(got[0], eager[0])
        assert all(torch.equal(x, y) for x, y in zip(got[1], eager[1], strict=True))
    torch.manual_seed(0)
    m, x = Block(), torch.randn(2, 8, 32, requires_grad=True)
    want = run(lambda x: m(x).square().sum(), [x])
    g = checkpoint(lambda x: m(x).square().sum(), policy=policy)
    for _ in range(2):
        got = run(g, [x])
        assert torch.equal(got[0], want[0]) and torch.equal(got[1][0], want[1][0])


STEADY = {**MIXES, "offload_kept(memory_budget(0.3))": policies.offload_kept(policies.memory_budget(0.3))}
OFFLOADS_NOTHING = {"budget 0.6, slow", "min_cut replaying matmuls", "with save_names"}  # in ``block``


@pytest.mark.parametrize("name", STEADY)
def test_the_plan_made_at_the_first_step_is_followed_at_every_step_after(monkeypatch, host_copies, name):
    """Every step copies the same storages to the host, plans nothing again, and gives eager's
    gradients. (The offloads a cached plan made while recording were once taken for the
    policy's own: the plan looked stale, was made again around them, and from the third
    step on nothing was offloaded and those values were replayed.)"""
    from tracedac.policies import plan_cache

    copied = []  # per step: the bytes of each host copy made
    f = checkpoint(block, policy=STEADY[name])
    want = run(block, args())
    monkeypatch.setattr(plan_cache, "plans", plan_cache.PlanCache())  # none from the tests before
    for _ in range(4):
        host_copies.clear()
        got = run(f, args())
        assert all(torch.equal(x, y) for x, y in zip(got[1], want[1], strict=True))
        copied.append([c.nbytes for c in host_copies])
    assert plan_cache.plans.made == 1
    assert bool(copied[0]) == (name not in OFFLOADS_NOTHING)
    assert all(sorted(c) == sorted(copied[0]) for c in copied)


def test_one_plan_keeps_offloads_and_replays_at_once():
    """The mix the tests above rely on is real: kept, offloaded and replayed tensors together."""
    r = report(MIXES["budget 0.3, medium"])
    assert r.kept_bytes > 0 and r.offloaded_bytes > 0 and r.replay_ops > 0


def _held(fn, a):
    """(bytes of the storages made in the forward still alive after it, the allocator's growth
    over the forward), the output's storage left out of both. A dispatch mode outside the
    region sees every op the region runs, not the host copies (made below dispatch)."""
    refs = []

    class Watch(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                    refs.append((t.untyped_storage()._weak_ref(), t.untyped_storage().nbytes()))
            return out

    gc.collect()
    before = allocated_bytes()
    with Watch():
        out = fn(*a)
    gc.collect()
    grown = allocated_bytes() - before
    mine = out.untyped_storage()._cdata
    alive = {}
    for ref, n in refs:
        if not torch.UntypedStorage._expired(ref):
            s = torch.UntypedStorage._new_with_weak_ptr(ref)
            if s._cdata != mine:
                alive[s._cdata] = n
        torch.UntypedStorage._free_weak_ref(ref)
    return out, sum(alive.values()), grown


def mlp(x, w1, w2):
    h = F.gelu(x @ w1) * 1.5  # [256, 512]: 512 KiB each
    return (torch.tanh(h @ w2) + x).square().mean()


@pytest.mark.parametrize("budget", [0, 1 << 19])
def test_the_device_holds_no_more_than_the_budget_and_the_host_holds_what_the_report_says(budget):
    """Measured outside the region: the storages made in the forward still alive after it (the
    device's bytes) fit the budget, first call and cached plan alike; the allocator grew by those
    plus the host copies, which are what ``saved_report`` counts as offloaded. Without offload
    the same budget replays more."""
    torch.manual_seed(0)
    a = [torch.randn(256, 512, requires_grad=True), torch.randn(512, 512) / 20, torch.randn(512, 512) / 20]
    a[1].requires_grad_(), a[2].requires_grad_()
    policy = policies.memory_budget(budget, offload=FAST)
    r = tracedac.saved_report(mlp, *a, policy=policy)
    assert r.offloaded_bytes >= (1 << 19), "at least one matmul result goes to the host"
    _held(checkpoint(mlp, policy=policies.memory_budget(budget)), a)[0].backward()  # torch's caches, once
    f = checkpoint(mlp, policy=policy)
    for _ in range(2):
        out, device, grown = _held(f, a)
        assert device <= budget, (device, budget)
        assert abs(grown - device - r.offloaded_bytes) < (64 << 10), (grown, device, r.offloaded_bytes)
        out.backward()
    plain = tracedac.saved_report(mlp, *a, policy=policies.memory_budget(budget))
    assert plain.replay_flops > r.replay_flops


def test_print_saved_names_the_planner_that_offloaded():
    r = report(policies.memory_budget(0.0, offload=FAST))
    rows = [row for row in r.rows if row.kind == "offloaded"]
    assert rows and all(
        row.why
        == f"offloaded by {policies.memory_budget(0.0, offload=FAST)!r}; in host memory until backward"
        for row in rows
    )
    assert "offloaded to host 6.00 KiB" in str(r)


def test_trade_off_plans_the_offload_frontier_that_saved_report_confirms():
    import matplotlib

    matplotlib.use("Agg")
    a = args()
    rows = tracedac.trade_off(block, *a, budgets=[0.0, 0.3, 1.0], offload=FAST)
    assert [r.budget for r in rows.offloaded] == [0.0, 0.3, 1.0]
    assert [r.bytes_offloaded for r in rows] == [0, 0, 0]
    for r in rows.offloaded:
        got = report(policies.memory_budget(r.budget, offload=FAST), a=a)
        assert (got.kept_bytes, got.offloaded_bytes, got.replay_flops, got.replay_ops) == (
            r.bytes_kept,
            r.bytes_offloaded,
            r.replay_flops,
            r.ops_replayed,
        )
    assert rows.offloaded[0].bytes_offloaded > 0 and rows.offloaded[0].replay_flops < rows[0].replay_flops
    assert "offloaded" in str(rows).splitlines()[0]
    assert "offloaded" not in str(tracedac.trade_off(block, *a, budgets=[0.3])).splitlines()[0]
    ax = rows.plot()
    assert [line.get_label() for line in ax.lines] == ["memory_budget", f"memory_budget(b, offload={FAST!r})"]
    assert any("host" in t.get_text() for t in ax.texts)


# --- the API -----------------------------------------------------------------------------


def test_planners_that_offload_print_as_their_call_and_key_plans_of_their_own():
    assert repr(policies.memory_budget(0.3, offload=True)) == "memory_budget(0.3, offload=True)"
    assert repr(policies.memory_budget(0.3, offload=Link())) == "memory_budget(0.3, offload=True)"
    fast = policies.memory_budget(4096, cost="time", offload=Link(55e9, 7e14))
    assert repr(fast) == "memory_budget(4096, cost='time', offload=Link(bandwidth=5.5e+10, flop_rate=7e+14))"
    assert eval(repr(fast), {"memory_budget": policies.memory_budget, "Link": Link}) == fast
    assert repr(Link(float("inf"))) == "Link(bandwidth=float('inf'))"
    assert (
        repr(policies.min_cut(replay_matmuls=True, offload=True))
        == "min_cut(replay_matmuls=True, offload=True)"
    )
    assert policies.memory_budget(0.3, offload=True) != policies.memory_budget(0.3)
    assert policies.min_cut(offload=True) != policies.min_cut()
    assert len({policies.memory_budget(0.3, offload=FAST), policies.memory_budget(0.3, offload=FAST)}) == 1


def test_bad_figures_and_options_are_refused_saying_what_to_pass():
    with pytest.raises(
        ValueError, match=r"Link\(bandwidth=-1\): a bandwidth is bytes per second each way, >= 0"
    ):
        Link(bandwidth=-1)
    with pytest.raises(ValueError, match="leave it out to measure it"):
        Link(bandwidth=float("nan"))
    with pytest.raises(ValueError, match=r"Link\(flop_rate=0\): a FLOP rate .* finite and > 0"):
        Link(flop_rate=0)
    with pytest.raises(ValueError, match="finite and > 0"):
        Link(flop_rate=float("inf"))
    with pytest.raises(TypeError, match=r"Link\(bandwidth='fast'\): bandwidth is a number"):
        Link(bandwidth="fast")
    with pytest.raises(TypeError, match=r"offload is True .*Link\(bandwidth=..., flop_rate=...\)"):
        policies.memory_budget(0.3, offload="yes")
    with pytest.raises(TypeError, match=r"min_cut\(offload=3\)"):
        policies.min_cut(offload=3)
    with pytest.raises(ValueError, match="a callable cost has no unit of time"):
        policies.memory_budget(0.3, cost=lambda node: 1, offload=True)
    with pytest.raises(ValueError, match=r"pass both figures, offload=Link\(bandwidth=..., flop_rate=...\)"):
        link.measure("meta")


def test_the_link_is_measured_once_per_device_and_the_plan_uses_it(monkeypatch):
    """On the CPU, where the host is both ends, a memcpy and a matmul: figures that only
    exercise the decisions. Measured the first time a plan needs them (at the region's end,
    drawing nothing from the program's generator), then cached."""
    monkeypatch.setattr(link, "_measured", {})
    monkeypatch.setattr(placement, "_WARNED_CPU", [])
    a = args()
    torch.manual_seed(1)
    block(*a)
    want = torch.get_rng_state()
    torch.manual_seed(1)
    with pytest.warns(UserWarning, match="on the CPU, where host memory is the device's memory"):
        checkpoint(block, policy=policies.memory_budget(0.3, offload=True))(*a).backward()
    assert torch.equal(torch.get_rng_state(), want) and list(link._measured) == [
        (torch.device("cpu"), torch.float32)
    ]
    measured = link.measure("cpu")
    assert 0 < measured.bandwidth < math.inf and 0 < measured.flop_rate < math.inf
    assert link.measure("cpu") is measured
    p = problem()
    # offload=True on the CPU plans without offload (a copy there saves no memory); the measured
    # figures, passed explicitly, still exercise the choice
    assert p.place(policies.memory_budget(0.3, offload=True)) == p.place(policies.memory_budget(0.3))
    assert p.place(policies.memory_budget(0.3, offload=measured)) != p.place(policies.memory_budget(0.3))
    a = args()
    eager = run(block, a)
    got = run(checkpoint(block, policy=policies.memory_budget(0.3, offload=True)), a)
    assert torch.equal(got[0], eager[0]) and all(torch.equal(x, y) for x, y in zip(got[1], eager[1]))


def test_under_torch_compile_a_planner_that_offloads_is_refused_with_what_to_use():
    """torch's partitioner cannot offload (compiled offload is refused, ``test_offload``): a
    planner allowed to offload is refused whatever its plan, rather than planned one way under
    compile and another eagerly, or by how fast the machine measured its link."""
    import torch._dynamo

    w = torch.randn(16, 16, requires_grad=True)
    for policy in (
        policies.memory_budget(0.3, offload=SLOW),
        policies.either(policies.min_cut(offload=FAST)),
    ):
        torch._dynamo.reset()
        f = checkpoint(lambda x: (x @ w).tanh(), policy=policy)
        c = torch.compile(lambda x: f(x).sum(), backend="aot_eager_decomp_partition", fullgraph=True)
        with pytest.raises(Exception) as err:
            c(torch.randn(4, 16, requires_grad=True)).backward()
        cause = getattr(err.value, "inner_exception", err.value)
        assert isinstance(cause, CheckpointError), repr(err.value)
        assert "offload under torch.compile is not supported" in str(cause)
        assert "a planner made with offload=" in str(cause) and "memory_budget without offload=" in str(cause)
    torch._dynamo.reset()


def test_hugging_faces_offload_true_makes_a_planner_offload_and_any_other_policy_offload_what_it_keeps():
    """``hf.enable(..., offload=True)``: the budget stays the device's and the planner weighs the
    link (``memory_budget(b, offload=True)``, inside ``either`` too); a policy that is no planner
    has what it keeps offloaded, as transformers' ``save_on_cpu`` moves what torch saves."""
    mb = policies.memory_budget(0.3)
    inputs = policies.offload_inputs  # each layer's input goes to the host too, whatever the policy
    assert hf._offloading(mb) == inputs(policies.memory_budget(0.3, offload=True))
    assert hf._offloading(policies.memory_budget(0.3, cost="time")) == inputs(
        policies.memory_budget(0.3, cost="time", offload=True)
    )
    named = policies.either(policies.save_names("x"), policies.min_cut())
    assert hf._offloading(named) == inputs(
        policies.either(policies.save_names("x"), policies.min_cut(offload=True))
    )
    given = policies.memory_budget(0.3, offload=FAST)
    assert hf._offloading(given) == inputs(given), "a link the user gave is kept"
    assert hf._offloading(given).policy is given
    assert hf._offloading(policies.save_matmuls()) == inputs(policies.offload_kept(policies.save_matmuls()))
    assert hf._offloading(policies.offload_kept(mb)) == inputs(policies.offload_kept(mb))


# --- composed: tracedac.zero, MoE side effects --------------------------------------------


def _inputs_offloaded(report) -> bool:
    return any(row.kind == "offloaded" and row.op == "input" for row in report.rows)


@pytest.mark.parametrize("inputs", [False, True], ids=["", "offload_inputs"])
def test_zero_sharded_blocks_planned_to_offload_train_with_the_gradients_of_no_checkpointing(world1, inputs):
    """Each sharded block a region under memory_budget(b, offload=...): its gathered weights are
    gathered again (never offloaded: the gather is MUST_RECOMPUTE), its activations kept,
    offloaded or replayed; the gradients are those of the sharded model without checkpointing
    and of the unsharded one, bitwise, and each block's side effect (its call counter, as an
    MoE router's) runs once a step. With ``offload_inputs`` the blocks' inputs go too (the
    gathered weights, a rebuilder's, never do)."""
    import tracedac.zero as zero

    from .support import zero_model as w

    policy = policies.memory_budget(0.1, offload=FAST)
    policy = policies.offload_inputs(policy) if inputs else policy
    plain, ref = zero.shard(w.model()), w.model()
    ck = tracedac.wrap(zero.shard(w.model()), w.Block, policy=policy)
    r = tracedac.saved_report(ck, w.data(0)[0])
    assert r.offloaded_bytes > 0 and r.kept_bytes > 0
    assert _inputs_offloaded(r) == inputs
    for b in ck.blocks:
        b.calls.zero_()
    for step in range(2):
        x, y = w.data(step)
        for m in (plain, ref, ck):
            m.zero_grad()
            F.mse_loss(m(x), y).backward()
        assert torch.equal(w.full_grads(ck), w.full_grads(plain))
        assert torch.equal(w.full_grads(ck), w.flat_grads(ref))
    assert [b.calls.item() for b in ck.blocks] == [2, 2, 2]


@pytest.mark.parametrize("inputs", [False, True], ids=["", "offload_inputs"])
def test_moe_blocks_planned_to_offload_count_each_token_once_and_train_as_eager(world1, inputs):
    """The MoE case (tests/support/moe_model.py): each block counts its tokens per expert in the
    forward (a buffer written in the region) and the bias moves after each step. Sharded, each
    block under memory_budget(b, offload=...): losses, counts and bias step by step equal the
    uncheckpointed, unsharded model's (counts and bias exactly: each token counted once)."""
    import tracedac.zero as zero

    from .support import moe_model as mw

    torch.manual_seed(0)
    oracle, model = mw.Model(), mw.Model()
    model.load_state_dict(oracle.state_dict())
    want = mw.train(oracle, oracle, 0, 1, lambda t: t)
    policy = policies.memory_budget(0.3, offload=Link(1e12, 1e9))
    for b in model.blocks:
        tracedac.checkpoint(b, policy=policies.offload_inputs(policy) if inputs else policy)
    zero.shard(model)
    got = mw.train(model, model, 0, 1, lambda t: t)
    for (loss, counts, bias), (got_loss, got_counts, got_bias) in zip(want, got, strict=True):
        assert abs(loss - got_loss) < 1e-6
        assert all(torch.equal(a, b) for a, b in zip(counts, got_counts, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(bias, got_bias, strict=True))
    r = tracedac.saved_report(model, torch.randn(16, mw.D, requires_grad=True) * 1.0)
    assert r.offloaded_bytes > 0
    assert _inputs_offloaded(r) == inputs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_link_is_measured_and_an_offloading_plan_holds_fewer_device_bytes():
    """CUDA: the measured figures are of a real link and device (a pinned copy each way, a
    matmul), and at the same budget a plan that offloads holds no more device bytes than the
    plan that replays, with eager's gradients bitwise."""
    measured = link.measure("cuda", torch.float32)
    assert 1e8 < measured.bandwidth < 1e13 and 1e11 < measured.flop_rate < 1e16
    a = args(device="cuda")
    eager = run(block, a)
    held = {}
    for name, policy in (
        ("replay", policies.memory_budget(0.0)),
        ("offload", policies.memory_budget(0.0, offload=FAST)),
    ):
        f = checkpoint(block, policy=policy)
        run(f, a)  # the plan, cached; the allocator's pools
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.manual_seed(1)
        out = f(*a)
        torch.cuda.synchronize()
        held[name] = torch.cuda.memory_allocated() - before
        out.backward()
        got = run(f, a)
        assert torch.equal(got[0], eager[0]) and all(torch.equal(x, y) for x, y in zip(got[1], eager[1]))
    assert held["offload"] <= held["replay"]


def test_on_the_cpu_offload_says_it_saves_nothing_planned_or_asked_for(monkeypatch):
    """A user's first hour: ``memory_budget(0.3, offload=True)`` on the CPU held 3x the bytes of
    the plan without offload (the host copy is the same RAM) and ``trade_off(offload=True)``
    printed offload rows equal to the plain ones, with nothing saying why."""
    from tracedac.offload import host

    monkeypatch.setattr(placement, "_WARNED_CPU", [])
    monkeypatch.setattr(host, "_WARNED_CPU", [])
    with pytest.warns(UserWarning, match="plans without offload"):
        frontier = tracedac.trade_off(block, *args(), budgets=[0.3, 0.6], offload=True)
    assert [r.bytes_offloaded for r in frontier.offloaded] == [0, 0]
    with pytest.warns(UserWarning, match="saves no memory"):  # asked for by name: done, and said
        checkpoint(block, policy=policies.offload_kept(policies.save_all()))(*args()).backward()
