"""The warm path (docs/design.md, "The warm path"): a region whose recorded structure repeats
runs its template instead of recording, and records in full from the moment a call differs.

Each test repeats a region with one thing changed and holds every call to the gradients of no
checkpointing (bitwise); a test named for a guard fails on a warm path without that guard (the
test's docstring says which, and what goes wrong without it).
"""

from __future__ import annotations

import contextlib
import functools
import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing._internal.two_tensor import TwoTensor
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import tracedac
from tracedac import CheckpointError, policies
from tracedac.record import warm
from tracedac.record.template import MAX_MISSES, TEMPLATES, same

from .support.probe import allocated_bytes as allocated
from .util import OpCounter

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def fresh_templates():
    """Each test starts with no template (a region key another test made is not this one's)."""
    TEMPLATES.clear()
    yield
    TEMPLATES.clear()


class Counting:
    """``warm.stats()`` differences since the block began: ``.warm``, ``.fell_back``..."""

    def __enter__(self):
        self.before = warm.stats()
        return self

    def __exit__(self, *exc):
        return False

    def __getattr__(self, name):
        return warm.stats().get(name, 0) - self.before.get(name, 0)


def _grads(fn, args, seed):
    torch.manual_seed(seed)
    out = fn(*args)
    inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    return (out, *torch.autograd.grad(out.sum(), inputs, allow_unused=True, materialize_grads=True))


def check(fn, calls, policy=None, seeds=None):
    """Run ``fn`` plainly and checkpointed on each argument tuple of ``calls`` (in order: the
    first records, the others may run warm; a callable makes a fresh tuple for each run), after
    the same seed; bitwise equal results."""
    region = tracedac.checkpoint(fn, policy=policy)
    for k, args in enumerate(calls):
        seed = k if seeds is None else seeds[k]
        want = _grads(fn, args() if callable(args) else args, seed)
        got = _grads(region, args() if callable(args) else args, seed)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), f"call {k}: {(a - b).abs().max()}"
    return region


def _x(seed, shape=(4, 8)):
    torch.manual_seed(100 + seed)
    return torch.randn(shape, requires_grad=True)


W = torch.randn(8, 8) / 3


def mlp(x, w):
    return (F.gelu(x @ w) @ w.t()).tanh()


# --- the warm path runs, and gives eager's gradients ------------------------------------------

POLICIES = {
    "recompute_all": policies.recompute_all,
    "save_all": policies.save_all,
    "save_matmuls": policies.save_matmuls,
    "memory_budget(0.5)": lambda: policies.memory_budget(0.5),
    "min_cut": policies.min_cut,
    "either(save_names, save_matmuls)": lambda: policies.either(
        policies.save_names("h"), policies.save_matmuls()
    ),
}


@pytest.mark.parametrize("name", POLICIES)
def test_a_repeated_region_runs_warm_with_the_gradients_of_no_checkpointing(name):
    """Every call after the first runs its template (a planner's, after the call that used its
    cached plan), on new values each time."""
    w = W.clone().requires_grad_()

    def block(x, w):
        h = tracedac.name(x @ w, "h")
        return (F.gelu(h) @ w.t()).tanh()

    with Counting() as c:
        check(block, [(_x(k), w) for k in range(5)], policy=POLICIES[name]())
    planner = name.startswith(("memory_budget", "min_cut"))
    assert c.warm == (3 if planner else 4) and c.fell_back == 0, warm.stats()


def test_warm_and_recorded_calls_keep_the_same_bytes_and_replay_the_same_ops():
    """A warm call holds what a recorded call holds (the same held storages, the same handles
    kept) and backward replays the same ops: a warm call is a recorded call's graph, made
    without recording."""
    w = W.clone().requires_grad_()

    def held_and_replayed(region, x):
        out = region(x, w)
        with OpCounter() as ops:
            out.sum().backward()
        return ops.counts

    for policy in (policies.recompute_all(), policies.save_matmuls(), policies.min_cut()):
        TEMPLATES.clear()
        region = tracedac.checkpoint(mlp, policy=policy)
        held_and_replayed(region, _x(0))  # records
        held_and_replayed(region, _x(1))  # (a planner's cached plan: this one makes the template)
        with Counting() as c:
            warm_counts = held_and_replayed(region, _x(2))
        assert c.warm == 1
        before = warm.enable(False)
        try:
            recorded_counts = held_and_replayed(region, _x(3))
        finally:
            warm.enable(before)
        assert warm_counts == recorded_counts, (policy, warm_counts, recorded_counts)


def test_a_warm_call_holds_after_its_forward_what_a_recorded_call_holds():
    """Bytes held once the forward returned (glibc's count: tensors and Python objects alike) are
    a recorded call's. The mode outlives its region (autograd keeps the pack hook with every
    tensor it saved), so it must let go of the call: it once kept the call's generator states,
    5 KiB each, 40 KiB a layer of a Hugging Face model above torch's checkpoint."""
    torch.manual_seed(0)
    w = torch.randn(256, 256, requires_grad=True)

    def block(x):
        h = F.dropout(x @ w, 0.2)
        return (F.gelu(h) @ w).tanh() + F.dropout(x, 0.1)

    def held(region, x):
        gc.collect()
        before = allocated()
        out = region(x)
        gc.collect()
        after = allocated() - before
        out.sum().backward()
        return after

    for policy in (policies.recompute_all(), policies.save_matmuls()):
        TEMPLATES.clear()
        region = tracedac.checkpoint(block, policy=policy)
        x = torch.randn(64, 256, requires_grad=True)
        held(region, x)  # records the template
        with Counting() as c:
            warm_bytes = min(held(region, x) for _ in range(3))
        assert c.warm == 3
        before = warm.enable(False)
        try:
            recorded_bytes = min(held(region, x) for _ in range(3))
        finally:
            warm.enable(before)
        assert warm_bytes <= recorded_bytes + 512, (policy, warm_bytes, recorded_bytes)


# --- guards: what a call must repeat to run warm ------------------------------------------------


def test_another_op_falls_back_where_it_differs():
    """Guard: the op. The template expected ``cos``; a call that runs ``sin`` there records from
    that op on. Without the check, the sin's result would be taken for the cos's and backward
    would replay cos."""

    def f(x, w, flag):
        h = x @ w
        return (h.sin() if flag else h.cos()) * h

    w = W.clone().requires_grad_()
    with Counting() as c:
        check(f, [(_x(0), w, False), (_x(1), w, True), (_x(2), w, True), (_x(3), w, True)])
    # the third call records the region's own template (``TemplateCache``), the fourth runs it
    assert c.fell_back == 1 and c.warm == 1


@pytest.mark.parametrize("change", ["shape", "dtype", "strides"])
def test_an_outside_tensor_of_another_shape_dtype_or_layout_falls_back(change):
    """Guard: a tensor first seen in the region (a weight the function closes over) is checked
    for the geometry the template recorded. Without it, ops on a transposed copy of the weight
    (same shape, other strides) or on a wider one would be replayed with the old layout."""
    torch.manual_seed(0)
    first, other = {
        "shape": (torch.randn(8, 8), torch.randn(8, 6)),
        "dtype": (torch.randn(8), torch.randn(8, dtype=torch.float64)),
        "strides": (torch.randn(8, 8), torch.randn(8, 8).t()),
    }[change]
    state = {}

    def f(x):
        s = state["s"]
        return ((x @ s) if s.dim() == 2 else (x * s)).tanh() * 2

    region = tracedac.checkpoint(f)
    with Counting() as c:
        for k, s in enumerate((first, first, other, other)):
            state["s"] = s.requires_grad_()
            x = _x(k)
            want = _grads(f, (x,), k)
            got = _grads(region, (x,), k)
            for a, b in zip(got, want, strict=True):
                assert torch.equal(a, b), change
    assert c.fell_back >= 1


@pytest.mark.parametrize("which", ["scalar", "view size"])
def test_a_constant_that_changes_falls_back(which):
    """Guard: every non-tensor argument. ``x * c`` with another ``c``, or a view with another
    size, is another computation on the same tensors; without the check backward would replay
    the template's."""
    w = W.clone().requires_grad_()

    def scaled(x, w, c):
        return ((x @ w) * c).tanh() * x

    def viewed(x, w, n):
        return ((x @ w).view(n, -1).softmax(-1).view(4, 8)) * x

    fn, values = (scaled, (2.0, 2.0, 3.0)) if which == "scalar" else (viewed, (4, 4, 2))
    with Counting() as c:
        check(fn, [(_x(k), w, v) for k, v in enumerate(values)])
    assert c.warm == 1 and c.fell_back == 1


def test_constants_compare_by_value_type_and_sign_of_zero():
    """Guard: a Scalar 2 is not 2.0 (an integer tensor times 2.0 is a float tensor), and
    ``x * -0.0`` is not ``x * 0.0``; two NaNs are the same constant."""
    assert not same(2, 2.0) and not same(True, 1) and not same(0.0, -0.0)
    assert same(float("nan"), float("nan")) and same([1, 2.5], [1, 2.5]) and not same([1, 2], [1, 2.0])
    assert not same(torch.ones(1), 1.0) and same(None, None) and not same(None, 0)


def test_a_tensor_read_where_the_template_read_another_falls_back():
    """Guard: the dataflow. The template's second matmul read ``a`` (a tensor it had seen), this
    call's reads ``b``, an outside tensor of the same shape; and in-region, ``u`` where the
    template read ``v``. Without the identity check backward would replay from ``a`` and ``v``."""
    torch.manual_seed(0)
    a, b = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)

    def outside(x, flag):
        h = x @ a
        return (h @ (a if flag else b)).tanh()

    def inside(x, flag):
        u, v = x.sin(), x.cos()
        return (u if flag else v).exp() * 2

    for fn in (outside, inside):
        TEMPLATES.clear()
        with Counting() as c:
            check(fn, [(_x(0), True), (_x(1), True), (_x(2), False)])
        assert c.warm == 1 and c.fell_back == 1, fn.__name__


def test_an_outside_tensor_replaced_between_calls_is_the_one_replay_reads():
    """Guard: outside tensors are bound per call. A weight the function closes over replaced
    by another tensor between calls (an optimizer that assigns, a cache rebuilt) is this call's
    outside tensor; a template that kept the first call's would replay with it."""
    state = {"w": W.clone().requires_grad_()}

    def f(x):
        return (x @ state["w"]).tanh() * x

    region = tracedac.checkpoint(f)
    with Counting() as c:
        for k in range(3):
            state["w"] = (W * (k + 1)).requires_grad_()
            want, got = _grads(f, (_x(k),), k), _grads(region, (_x(k),), k)
            for p, q in zip(got, want, strict=True):
                assert torch.equal(p, q)
    assert c.warm == 2


def test_an_outside_tensor_written_in_the_region_is_copied_before_the_write_on_every_call():
    """Guard: an outside storage the region writes is copied before the write on every call
    (its first write): backward replays the ops that read it before the write from this
    call's copy. Without it replay would read the value after the write."""
    w = W.clone().requires_grad_()

    def f(x, buf):
        h = (x @ w) + buf  # reads buf before the write (and saves nothing of it, so eager runs)
        buf.add_(x.detach().sum(0))
        return h.tanh() * buf

    with Counting() as c:
        check(f, [functools.partial(lambda k: (_x(k), torch.full((8,), k + 1.0)), k) for k in range(3)])
    assert c.warm == 2


def test_an_outside_tensor_written_after_a_warm_forward_is_refused_as_after_a_recorded_one():
    """A warm call's graph knows the version of every outside tensor it kept, as a recorded
    one's does: a write after the forward that backward would read is refused, naming it."""
    w = W.clone().requires_grad_()
    region = tracedac.checkpoint(lambda x, w: (x * w).tanh())
    for _ in range(2):
        w2 = w.clone().detach().requires_grad_()
        x = _x(0)
        out = region(x, w2.view(4, 16)[:, :8].contiguous())
        out.sum().backward()
    with Counting() as c:
        x = _x(1)
        y = _x(2)
        out = region(x, y)
        with torch.no_grad():
            y.mul_(2)
        with pytest.raises(CheckpointError, match="modified in place after the forward"):
            out.sum().backward()
    assert c.warm == 1


def test_a_policy_that_reads_values_is_asked_on_every_call():
    """Guard: torch's selective checkpointing with a policy function reads the op's values, so
    a call with other values may be decided otherwise: such a region never runs warm. Here the
    matmul is kept only when its input is large; a template's decision reused would replay it."""

    def policy_fn(ctx, op, *args, **kwargs):
        if op is aten.mm.default and args[0].abs().max() > 10:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    w = W.clone().requires_grad_()
    context_fn = functools.partial(create_selective_checkpoint_contexts, policy_fn)

    def replayed_matmuls(scale):
        x = (_x(0) * scale).detach().requires_grad_()
        out = tracedac.checkpoint_call(lambda x: (x @ w).tanh(), x, context_fn=context_fn)
        with OpCounter() as ops:
            out.sum().backward()
        return ops.counts[aten.mm]

    with Counting() as c:
        small, large, small_again = replayed_matmuls(1.0), replayed_matmuls(100.0), replayed_matmuls(1.0)
    assert large == small - 1 and small_again == small  # the large call kept its matmul
    assert c.warm == 0


def test_random_ops_replay_the_numbers_this_call_drew():
    """Guard: a random op's generator state is taken on every call. Without it backward would
    replay the template call's dropout mask."""
    w = W.clone().requires_grad_()

    def f(x, w):
        return F.dropout(x @ w, 0.5).tanh() * F.dropout(x, 0.3)

    with Counting() as c:
        check(f, [(_x(k), w) for k in range(4)], seeds=[7, 8, 9, 10])
    assert c.warm == 3


def test_a_tensor_subclass_in_a_warm_call_falls_back():
    """Guard: tensor subclasses. A region recorded on plain tensors and called with a
    ``TwoTensor`` of the same shape (the same key: shapes and dtypes agree) records that call,
    beneath the subclass, as it always does."""
    w = W.clone().requires_grad_()

    def f(x, w):
        return (x @ w).sin()

    torch.manual_seed(0)
    two = TwoTensor(torch.randn(4, 8), torch.randn(4, 8)).requires_grad_()
    region = tracedac.checkpoint(f)
    with Counting() as c:
        for x in (_x(0), _x(1), two):
            want, got = _grads(f, (x, w), 0), _grads(region, (x, w), 0)
            for a, b in zip(got, want, strict=True):
                if isinstance(a, TwoTensor):
                    assert torch.equal(a.a, b.a) and torch.equal(a.b, b.b)
                else:
                    assert torch.equal(a, b)
    assert c.warm == 1 and c.fell_back == 1


@pytest.mark.parametrize("which", ["masked select", "nonzero", "bincount", "split sizes from tolist"])
def test_a_shape_read_from_values_falls_back(which):
    """Guard: outputs whose shape depends on values (ops tagged ``dynamic_output_shape``) are
    checked after they run, and sizes read into Python (``.tolist()``) arrive as constants.
    Without it the template's shapes would be replayed for a call whose shapes differ."""
    w = W.clone().requires_grad_()

    def f(x, w):
        h = (x @ w).tanh()
        positive = x > 0  # (the calls below differ in how many entries are positive)
        if which == "masked select":
            return h[positive].exp().sum() + h.sum()
        if which == "nonzero":
            idx = positive.nonzero()[:, 1]
            return h[:, idx].exp().sum()
        if which == "bincount":
            counts = torch.bincount(positive.sum(0))
            return (h * counts.float().square().sum()).exp().sum()
        sizes = positive.sum(1).clamp(min=1).tolist()
        parts = torch.split(h.flatten()[: sum(sizes)], sizes)
        return sum(p.exp().sum() * (i + 1) for i, p in enumerate(parts))

    def signs(k):  # 4 x 8 entries, the first 4 * k of them positive
        return (torch.arange(32.0).view(4, 8) < 4 * k).float().mul(2).sub(1).mul(_x(k).abs()).requires_grad_()

    calls = [(signs(3), w), (signs(3), w), (signs(5), w), (signs(7), w)]
    with Counting() as c:
        check(lambda x, w: f(x, w).reshape(1), calls)
    assert c.warm >= 1 and c.fell_back >= 1


def test_a_change_of_grad_mode_inside_the_region_falls_back():
    """Guard: what autograd saves is an event like an op. A call that computes part of the
    region without grad saves fewer tensors than the template: it records from there."""
    w = W.clone().requires_grad_()

    def f(x, w, frozen):
        with torch.no_grad() if frozen else contextlib.nullcontext():
            h = (x @ w).sigmoid()
        return (h * x).tanh()

    with Counting() as c:
        check(f, [(_x(0), w, False), (_x(1), w, False), (_x(2), w, True)])
    assert c.warm == 1 and c.fell_back == 1


def test_a_label_is_checked_like_an_op():
    """Guard: ``tracedac.name`` is an event. Under ``save_names("h")`` a call that labels ``h``
    keeps it; one that does not must replay it, as a recorded call would. Without the check the
    template's decision would keep it on every call."""
    w = W.clone().requires_grad_()

    def f(x, w, label):
        h = x @ w
        if label:
            tracedac.name(h, "h")
        return h.tanh()

    region = tracedac.checkpoint(f, policy=policies.save_names("h"))

    def replayed(label, k):
        out = region(_x(k), w, label)
        with OpCounter() as ops:
            out.sum().backward()
        return ops.counts[aten.mm]

    with Counting() as c:
        first, second, unlabelled = replayed(True, 0), replayed(True, 1), replayed(False, 2)
    assert c.warm == 1 and c.fell_back == 1
    before = warm.enable(False)
    try:
        assert unlabelled == replayed(False, 3) == first + 1 and second == first
    finally:
        warm.enable(before)


def test_autograd_grad_inside_a_region_records_every_call():
    """A region that takes a gradient inside itself (a gradient penalty) unpacks its own handles
    while it records: replay needs the recorded graph, so such a region records in full."""
    w = W.clone().requires_grad_()

    def f(x, w):
        y = (x @ w).tanh()
        (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        return y + g.square()

    with Counting() as c:
        check(f, [(_x(k), w) for k in range(3)])
    assert c.warm == 0 and c.fell_back == 0


def test_nested_regions_record_every_call_and_stay_exact():
    """A region inside a region reads the enclosing one's groups (its inputs are replayed through
    the enclosing region's handles): both record in full."""
    w = W.clone().requires_grad_()

    def inner(h):
        return (h @ w).sin()

    def outer(inner, x, w):
        return inner((x @ w).tanh()) * x

    region = tracedac.checkpoint(functools.partial(outer, tracedac.checkpoint(inner)))
    with Counting() as c:
        for k in range(3):
            want = _grads(functools.partial(outer, inner), (_x(k), w), k)
            got = _grads(region, (_x(k), w), k)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert c.warm == 0


def test_a_report_sees_a_full_record_after_warm_calls():
    """``saved_report`` records its regions in full: after warm calls it lists what a first call's
    report lists."""
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    tracedac.checkpoint(model, policy=policies.save_matmuls())
    before = tracedac.saved_report(model, _x(0))
    with Counting() as c:
        for k in range(3):
            model(_x(k)).sum().backward()
    after = tracedac.saved_report(model, _x(0))
    assert c.warm == 2
    assert [(r.op, r.kind, r.bytes) for r in after.rows] == [(r.op, r.kind, r.bytes) for r in before.rows]
    assert after.replay_ops == before.replay_ops > 0


@pytest.mark.parametrize(
    "policy",
    [
        lambda: policies.memory_budget(0.5, cost="time"),
        lambda: policies.offload_kept(policies.save_all()),
        lambda: policies.offload_inputs(),
        lambda: policies.replay_collectives(policies.recompute_all()),
    ],
    ids=["cost=time", "offload_kept", "offload_inputs", "replay_collectives"],
)
def test_what_the_warm_path_does_not_serve_records_every_call(policy):
    """A planner that prices replay by measured op times, offloads, and regions that check their
    collectives across ranks record every call in full (docs/design.md, "The warm path")."""
    w = W.clone().requires_grad_()
    with Counting() as c:
        check(mlp, [(_x(k), w) for k in range(3)], policy=policy())
    assert c.warm == 0 and c.templates == 0


def test_a_user_function_policy_records_every_call():
    """A policy function may decide from anything (module paths, a counter): it is asked every
    call, as before the warm path."""
    asked = []

    def policy(node):
        asked.append(node.name)
        return CheckpointPolicy.PREFER_RECOMPUTE

    w = W.clone().requires_grad_()
    check(mlp, [(_x(0), w)], policy=policy)
    per_call = len(asked)
    with Counting() as c:
        check(mlp, [(_x(k), w) for k in range(3)], policy=policy)
    assert len(asked) == 4 * per_call > 0 and c.warm == 0


# --- the cache, fallbacks, the switch -------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, odd=False):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.odd = odd

    def forward(self, x):
        h = self.lin(x)
        return x + (h.sin() if self.odd else h.cos())


def test_layers_of_one_class_share_a_template_and_one_that_differs_gets_its_own():
    """The layers of a model share the template of their class; a layer whose call falls back
    from it (a branch of its own) records a template of its own at its next call, and every
    call after that runs warm."""
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block(), Block(odd=True), Block())
    plain = nn.Sequential(*[Block(odd=b.odd) for b in model])
    plain.load_state_dict(model.state_dict())
    tracedac.wrap(model, Block)
    counts = []
    for step in range(4):
        x = _x(step)
        with Counting() as c:
            got = torch.autograd.grad(model(x).sum(), [x, *model.parameters()])
        want = torch.autograd.grad(plain(x).sum(), [x, *plain.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        counts.append((c.warm, c.fell_back))
    assert counts == [(2, 1), (3, 0), (4, 0), (4, 0)], counts


def test_an_op_that_raises_in_a_warm_call_and_is_caught_records_from_there():
    """An op of the template that raises on this call's values (the program catches it and goes
    on another way) records nothing, as in a recorded call; the call records from there."""
    w = W.clone().requires_grad_()

    def f(x, w, idx):
        h = (x @ w).tanh()
        try:
            picked = h.index_select(1, idx)
        except (IndexError, RuntimeError):  # (out of bounds: an IndexError on some builds)
            picked = h[:, :2] * 3
        return picked.exp().sum(1)

    ok, bad = torch.tensor([0, 1]), torch.tensor([0, 100])
    with Counting() as c:
        check(f, [(_x(0), w, ok), (_x(1), w, ok), (_x(2), w, bad), (_x(3), w, bad)])
    assert c.warm >= 1 and c.fell_back >= 1


def test_an_op_returning_a_list_of_one_view_runs_warm_and_falls_back_after_it():
    """``split`` into one piece returns a list holding one view: a warm call holds the view, not
    the list (it once held the list: the next op's check failed, and the fallback met a list
    where it wanted a tensor; found by tests/zero's one-rank runs)."""
    w = W.clone().requires_grad_()

    def f(x, w, flag):
        (h,) = (x @ w).split(8, dim=1)
        y = h.tanh()
        return (y.sin() if flag else y.cos()) * x

    with Counting() as c:
        check(f, [(_x(0), w, False), (_x(1), w, False), (_x(2), w, True)])
    assert c.warm == 1 and c.fell_back == 1


def test_a_tensor_first_read_for_its_layout_then_for_its_values_is_bound_as_an_outside_tensor():
    """``zeros_like(x)`` reads ``x``'s layout only (no group for it: it is no input of the op);
    an op that then reads ``x``'s values makes it one: a warm call binds it there, not at its
    first sight (found by OpInfo's ``hinge_embedding_loss`` repeated: the graph's end wanted an
    outside tensor never bound)."""

    def f(x, w):
        t = torch.zeros_like(x).fill_(2.0)
        return (t - x).clamp_min(0.5) * (x @ w)

    w = W.clone().requires_grad_()
    with Counting() as c:
        check(f, [(_x(k), w) for k in range(3)])
    assert c.warm == 2


def test_constants_that_are_not_finite_are_compared_as_any():
    """A handler writes a nonzero finite number in its code (``args[1] != 2.5``); an infinite one
    is compared by ``same`` (written in, ``inf`` named nothing: found by OpInfo's ``norm``)."""
    w = W.clone().requires_grad_()

    def f(x, w, top):
        return (x @ w).clamp(None, top).tanh()

    with Counting() as c:
        check(f, [(_x(0), w, float("inf")), (_x(1), w, float("inf")), (_x(2), w, 0.5)])
    assert c.warm == 1 and c.fell_back == 1


def test_a_structure_that_changes_every_call_stops_trying_after_a_few_misses():
    """A region whose shapes follow its values (an MoE's routing) falls back on every call; after
    ``MAX_MISSES`` in a row its key records in full, without trying a template first."""
    w = W.clone().requires_grad_()

    def f(x, w):
        h = (x @ w).tanh()
        return h[x > 0].exp().sum().reshape(1)

    def positives(k):  # k + 1 of the 32 entries positive: another shape every call
        return (torch.arange(32.0).view(4, 8) <= k).float().mul(2).sub(1).mul(_x(k).abs()).requires_grad_()

    with Counting() as c:
        check(f, [(positives(k), w) for k in range(3 + 2 * MAX_MISSES)])
    # the shared template's miss, then the region's own template's (each recorded by the call
    # after a miss) until MAX_MISSES; the calls after that record without trying
    assert c.warm == 0 and c.fell_back == 1 + MAX_MISSES


def test_tensors_made_without_an_op_are_checked_by_storage():
    """``torch.tensor(...)`` in the region is a new outside tensor every call; ``t.data`` is a
    tensor on a storage the region made, which no op returned: both are first seen by the
    template and checked against what it saw."""
    w = W.clone().requires_grad_()

    def f(x, w):
        h = (x @ w).tanh()
        scale = torch.tensor([2.0, 3.0])
        raw = h.data  # (no gradient through it: a constant of this call)
        return (h * raw)[:, :2] * scale

    with Counting() as c:
        check(lambda x, w: f(x, w).sum(1), [(_x(k), w) for k in range(3)])
    assert c.warm == 2


def test_the_warm_path_can_be_turned_off_and_says_so_for_bad_settings(monkeypatch):
    """``warm.enable(False)`` (or ``TRACEDAC_WARM=0`` at import) makes every call record."""
    w = W.clone().requires_grad_()
    before = warm.enable(False)
    try:
        with Counting() as c:
            check(mlp, [(_x(k), w) for k in range(3)])
        assert c.warm == 0 and c.templates == 0
    finally:
        warm.enable(before)
    with pytest.raises(TypeError, match="True, False or None"):
        warm.enable("off")
    monkeypatch.setenv("TRACEDAC_WARM", "sometimes")
    with pytest.raises(ValueError, match="TRACEDAC_WARM='sometimes'"):
        warm._from_environment()
    monkeypatch.setenv("TRACEDAC_WARM", "0")
    assert warm._from_environment() is False
