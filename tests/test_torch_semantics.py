"""Autograd's own semantics, kept through a region: saved tensors read in grad mode, and
``torch.autograd.grad`` called inside a checkpointed function.

Every test runs the program three ways: eager (no checkpoint), torch's
``checkpoint(use_reentrant=False)`` and tracedac, and asks for the same values and the same
gradients, bitwise, in float64. Policies with a whole-graph planner are run twice: the first
call plans at the region's end (holding everything meanwhile), the second decides each op as
it records from the cached plan, so only the second replays what it does not hold.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import tracedac
from tracedac import CheckpointError, checkpoint_call, policies
from tracedac.region import reporting

from .util import OpCounter

POLICIES = {
    "recompute_all": policies.recompute_all(),
    "save_all": policies.save_all(),
    "save_matmuls": policies.save_matmuls(),
    "memory_budget": policies.memory_budget(0.3),
    "min_cut": policies.min_cut(),
}
# Ops whose backward reads their own result (autograd saves the output, not the input).
SAVES_ITS_OUTPUT = {"exp": torch.exp, "sigmoid": torch.sigmoid, "tanh": torch.tanh}
CALLS = 2  # see the module docstring: the second call of a planner decides from its cached plan


def _x(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, dtype=torch.float64, generator=g)


def _run(mode, fn, *args, policy=None):
    if mode == "eager":
        return fn(*args)
    if mode == "torch":
        return torch_checkpoint(fn, *args, use_reentrant=False)
    return checkpoint_call(fn, *args, policy=policy)


def _value_and_grad(mode, fn, x0, policy=None):
    x = x0.clone().requires_grad_()
    out = _run(mode, fn, x, policy=policy)
    out.backward()
    return out.detach(), x.grad


def _assert_all_agree(fn, x0, policy):
    eager = _value_and_grad("eager", fn, x0)
    torchs = _value_and_grad("torch", fn, x0)
    assert torch.equal(eager[0], torchs[0]) and torch.equal(eager[1], torchs[1])  # the oracles agree
    for _ in range(CALLS):
        out, grad = _value_and_grad("tracedac", fn, x0, policy)
        assert torch.equal(out, eager[0])
        assert torch.equal(grad, eager[1]), (grad - eager[1]).abs().max()


# --- a saved tensor unpacked in grad mode, with no double backward --------------------------


@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
@pytest.mark.parametrize("op", SAVES_ITS_OUTPUT.values(), ids=SAVES_ITS_OUTPUT.keys())
def test_a_saved_result_read_through_grad_fn_after_the_forward_is_eagers(op, policy):
    """Reading ``out.grad_fn._saved_result`` unpacks the saved tensor outside any backward,
    in grad mode (the default). That is no gradient of a gradient, and it was refused as one:
    the handle took "grad mode is on" for "create_graph=True". The value must be eager's, with
    eager's history (autograd attaches it to what the handle returns), and reading it must
    not disturb the backward that follows."""
    x0 = _x()
    for _ in range(CALLS):
        values = {}
        for mode in ("eager", "torch", "tracedac"):
            x = x0.clone().requires_grad_()
            y = _run(mode, op, x, policy=policy)
            saved = y.grad_fn._saved_result
            assert saved.requires_grad and saved.grad_fn is y.grad_fn  # eager's history
            (g,) = torch.autograd.grad(y.sum(), x)
            values[mode] = (saved.detach(), g)
        for mode in ("torch", "tracedac"):
            assert torch.equal(values[mode][0], values["eager"][0])
            assert torch.equal(values[mode][1], values["eager"][1])


@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
def test_a_saved_result_read_through_grad_fn_in_a_checkpointed_module_is_eagers(policy):
    """The same read on the output of a checkpointed module (the hooks path, not
    checkpoint_call), where the saved result is an intermediate a layer down the graph."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 6, dtype=torch.float64)

        def forward(self, x):
            return torch.tanh(self.lin(x)) * 2

    torch.manual_seed(0)
    net = Net()
    x = _x().view(1, 6)
    want = torch.tanh(net.lin(x)).detach()
    want_grads = torch.autograd.grad(net(x).sum(), list(net.parameters()))
    tracedac.checkpoint(net, policy=policy)
    try:
        for _ in range(CALLS):
            out = net(x)
            tanh_node = out.grad_fn.next_functions[0][0]
            assert type(tanh_node).__name__ == "TanhBackward0"
            assert torch.equal(tanh_node._saved_result, want)
            for a, b in zip(torch.autograd.grad(out.sum(), list(net.parameters())), want_grads, strict=True):
                assert torch.equal(a, b)
    finally:
        tracedac.unwrap(net)


class _SinRecomputed(torch.autograd.Function):
    """A custom op whose backward differentiates a recomputation: it unpacks ``saved_tensors``
    under ``torch.enable_grad()`` in an ordinary (create_graph=False) backward. Its saved
    tensors are an input and the output: autograd's two kinds of saved variable."""

    @staticmethod
    def forward(ctx, a):
        out = a.sin()
        ctx.save_for_backward(a, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        with torch.enable_grad():
            a, out = ctx.saved_tensors
            a = a.detach().requires_grad_()
            (g,) = torch.autograd.grad(a.sin(), a, grad)
        return g + 0 * out.detach()


def _custom_program(x):
    h = torch.exp(x) * 3  # the Function's input: computed in the region, replayed in backward
    return (_SinRecomputed.apply(h) * h.sigmoid()).sum()


@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
def test_a_custom_backward_that_unpacks_under_enable_grad_gets_eagers_values_and_gradients(policy):
    """``ctx.saved_tensors`` read under ``enable_grad`` inside a plain ``.backward()`` was
    refused as a double backward. Nothing is differentiated twice through the region there;
    the gradients must be eager's and torch's checkpoint's."""
    _assert_all_agree(_custom_program, _x(), policy)


def test_a_custom_backward_under_enable_grad_may_differentiate_through_the_unpacked_tensor():
    """Grad mode on at unpack means only that the reader may build a graph from the value.
    When it does, through the saved tensor's own history (here the gradient reaches the
    region's input ``x`` through ``ctx.saved_tensors``), eager's result comes out: autograd
    takes that history from the saved variable, never from the handle's tensor."""

    class ThroughHistory(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, x):
            ctx.save_for_backward(a, x)
            return a.sin()

        @staticmethod
        def backward(ctx, grad):
            with torch.enable_grad():
                a, x = ctx.saved_tensors  # a: computed in the region, with its grad_fn
                (dx,) = torch.autograd.grad(
                    (a.cos() * grad).sum(), x, retain_graph=True
                )  # through a's history
            return grad * a.detach().cos(), dx

    def f(x):
        a = torch.tanh(x) * 2
        return ThroughHistory.apply(a, x).sum()

    for policy in POLICIES.values():
        _assert_all_agree(f, _x(), policy)


class _ReadsSavedTwice(torch.autograd.Function):
    """torch's test program: a backward that reads ``ctx.saved_tensors`` twice. torch's
    checkpoint raises at the second read ("Unpack is being triggered for a tensor that was
    already unpacked once": it frees each recomputed tensor when unpacked); eager gives the
    same tensors again."""

    @staticmethod
    def forward(ctx, x, y, z):
        w = x * y * z
        out = w + w
        ctx.save_for_backward(x, y, z, w, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        first = ctx.saved_tensors
        second = ctx.saved_tensors
        ctx.reads = [t.detach().clone() for t in (*first, *second)]
        x, y, z, w, out = second
        return grad * y * z + w, grad * x * z + out, grad * x * y


@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
def test_a_custom_backward_that_reads_its_saved_tensors_twice_gets_eagers_values_both_times(policy):
    """A handle's value is rebuilt for as long as autograd holds it (and a pass rebuilds what
    is missing), so a second read is a second unpack like any other: eager's values and
    gradients, where torch's checkpoint refuses."""

    def program(x, y, z):
        x, y, z = x * y * z, y * y * z, z * z
        out = _ReadsSavedTwice.apply(x, y, z)
        nodes.append(out.grad_fn)  # the Function's ctx: its backward leaves ``reads`` there
        return out

    inputs = [torch.tensor(v, dtype=torch.float64) for v in (1.5, 2.0, 3.0)]
    results = []
    for mode in ("eager", "tracedac", "tracedac"):  # (a planner decides from its plan the second time)
        nodes = []
        args = [t.clone().requires_grad_() for t in inputs]
        out = program(*args) if mode == "eager" else checkpoint_call(program, *args, policy=policy)
        grads = torch.autograd.grad(out, args)
        results.append((nodes[0].reads, grads))
    (want_reads, want_grads), *got = results
    for reads, grads in got:
        assert len(reads) == 10 and all(torch.equal(a, b) for a, b in zip(reads, want_reads, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(grads, want_grads, strict=True))


def test_a_second_order_gradient_through_a_region_matches_eagers():
    """A genuine ``create_graph=True`` backward through regions (kept, replayed and
    nested-region tensors, views, an in-place write, dropout) gives eager's first- and
    second-order gradients: the handle supplies values, and autograd wraps each with the
    saved variable's grad_fn, as it does for torch's checkpoint (whose recomputed tensors
    are detached). No unpack needs a rebuild with autograd history."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(8, dtype=torch.float64)
            self.l1 = nn.Linear(8, 16, dtype=torch.float64)
            self.l2 = nn.Linear(16, 8, dtype=torch.float64)

        def forward(self, x):
            h = F.gelu(self.l1(self.norm(x)))
            h = h.view(-1, 4, 4).transpose(1, 2).reshape(-1, 16)
            h = F.dropout(h, 0.3, training=True)
            h.mul_(1.5)
            return x + torch.sigmoid(self.l2(h.tanh())).softmax(-1)

    def head(mode, policy):
        def f(z):  # a region nested in this one
            return _run(mode, lambda t: t.exp().tanh(), z, policy=policy) * z.sigmoid()

        return f

    torch.manual_seed(1)
    block = Block()
    x0 = torch.randn(3, 8, dtype=torch.float64)

    def run(mode, policy=None):
        x = x0.clone().requires_grad_()
        torch.manual_seed(5)
        y = _run(mode, block, x, policy=policy)
        y = _run(mode, head(mode, policy), y, policy=policy)
        wrt = [x, *block.parameters()]
        first = torch.autograd.grad(y.square().sum(), wrt, create_graph=True)
        second = torch.autograd.grad(sum(g.square().sum() for g in first), wrt)
        return first, second

    want = run("eager")
    oracle = run("torch")
    for a, b in zip((*want[0], *want[1]), (*oracle[0], *oracle[1]), strict=True):
        assert torch.equal(a, b)
    for policy in POLICIES.values():
        for _ in range(CALLS):
            got = run("tracedac", policy)
            for a, b in zip((*want[0], *want[1]), (*got[0], *got[1]), strict=True):
                assert torch.equal(a, b), (a - b).abs().max()


# --- torch.autograd.grad inside a checkpointed function ------------------------------------


def _grad_inside(op, create_graph):
    def f(x):
        y = op(x)
        (g,) = torch.autograd.grad(y.sum(), x, create_graph=create_graph, retain_graph=True)
        return (g * y).sum()

    return f


@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
@pytest.mark.parametrize("create_graph", [True, False], ids=["create_graph", "no_create_graph"])
@pytest.mark.parametrize("op", [*SAVES_ITS_OUTPUT.values(), lambda x: x * x], ids=[*SAVES_ITS_OUTPUT, "x*x"])
def test_autograd_grad_inside_a_region_through_an_op_that_saves_its_output_matches_eager(
    op, create_graph, policy
):
    """The inner ``autograd.grad`` unpacks what the region saved while it still records. A
    result it did not keep (exp's, sigmoid's, tanh's: they save their output) had to be
    replayed from the region's input, and replay took that input for modified ("version 0,
    read at -1"): the version each storage is checked against is read when the region
    ends. While it records, every write is recorded as it runs, so a live tensor is current.
    ``x * x`` saves only inputs, kept as they came: it never needed a replay."""
    _assert_all_agree(_grad_inside(op, create_graph), _x(), policy)


@pytest.mark.parametrize("op", SAVES_ITS_OUTPUT.values(), ids=SAVES_ITS_OUTPUT.keys())
def test_without_retain_graph_the_outer_backward_fails_as_eagers_does(op):
    """The program of the report verbatim, with create_graph=False and no retain_graph: the
    inner ``autograd.grad`` frees ``y``'s graph, so the outer backward through ``y`` fails in
    eager and in torch's checkpoint. tracedac gives the same error, no CheckpointError."""

    def f(x):
        y = op(x)
        (g,) = torch.autograd.grad(y.sum(), x)
        return (g * y).sum()

    for mode in ("eager", "torch", "tracedac"):
        x = _x().requires_grad_()
        out = _run(mode, f, x)
        with pytest.raises(RuntimeError, match="backward through the graph a second time") as info:
            out.backward()
        assert not isinstance(info.value, CheckpointError)


def test_a_replay_during_the_forward_is_not_recorded_and_rebuilds_only_what_was_asked():
    """Replay inside a recording region runs its ops past the recorder: recorded, they would
    enter the graph as a second copy of what they rebuild. It rebuilds the one handle asked
    for, not every handle waiting (that would hold their values until backward), and it
    leaves the random generator where the forward had it."""

    def f(x):
        h = torch.sigmoid(x) * 2  # saved by the mul below: waits for backward
        y = torch.exp(x)
        (g,) = torch.autograd.grad(y.sum(), x, retain_graph=True)  # exp's result: replayed now
        return (g * y * h).sum() + F.dropout(x, 0.5).sum()  # dropout after the replay

    x0 = _x()
    torch.manual_seed(3)
    want = _value_and_grad("eager", f, x0)
    torch.manual_seed(3)
    with reporting() as regions, OpCounter() as ops:
        x = x0.clone().requires_grad_()
        out = checkpoint_call(f, x)
    graph = regions[0].graph
    assert [n.name for n in graph.nodes].count("aten.exp.default") == 1  # the replayed exp: not recorded
    assert ops.counts[torch.ops.aten.exp] == 2  # the forward's, and the one replay ran
    assert ops.counts[torch.ops.aten.sigmoid] == 1  # not rebuilt by that replay
    assert graph.passes == 1
    out.backward()
    assert torch.equal(out.detach(), want[0]) and torch.equal(x.grad, want[1])


def test_autograd_grad_through_a_finished_nested_region_inside_an_outer_region_matches_eager():
    """A region finished inside another is replayed while the outer one records. Its replay
    lays views onto fresh storages with ``set_``; recorded by the outer region, that was
    refused as a storage swap. The inner region's input is the outer's input, or a tensor
    the outer computed (then rebuilt through the outer's handle, while the outer records)."""

    def inner(z):
        return z.t().exp().t().sigmoid()[1:]  # saved results, on views

    for create_graph, computed_input in ((True, False), (False, False), (True, True), (False, True)):

        def f(x, checkpointed, create_graph=create_graph, computed_input=computed_input):
            z = x.tanh() * 2 if computed_input else x
            y = checkpoint_call(inner, z) if checkpointed else inner(z)
            (g,) = torch.autograd.grad(y.sum(), x, create_graph=create_graph, retain_graph=True)
            return (g.sum(0) * y.sum()).sum()

        x0 = torch.randn(4, 3, dtype=torch.float64)
        want = _value_and_grad("eager", lambda x: f(x, False), x0)
        oracle = _value_and_grad("torch", lambda x: f(x, False), x0)
        assert torch.equal(want[1], oracle[1])
        for policy in POLICIES.values():
            got = _value_and_grad("tracedac", lambda x: f(x, True), x0, policy)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_a_random_op_replayed_during_the_forward_draws_the_forwards_numbers():
    """Dropout's backward reads its mask, an output of the op: the inner ``autograd.grad``
    replays it during the forward with the generator state it recorded, and restores the
    generator, so a later dropout in the same forward draws what eager's draws."""

    def f(x):
        y = F.dropout(torch.exp(x), 0.5)
        (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        return (F.dropout(g, 0.5) * y).sum()

    x0 = _x(64)
    torch.manual_seed(7)
    want = _value_and_grad("eager", f, x0)
    torch.manual_seed(7)
    oracle = _value_and_grad("torch", f, x0)
    assert torch.equal(want[1], oracle[1])
    for policy in POLICIES.values():
        torch.manual_seed(7)
        got = _value_and_grad("tracedac", f, x0, policy)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
def test_a_checkpointed_module_whose_forward_returns_a_gradient_trains_as_in_eager(policy):
    """An energy model that returns forces, ``-d energy / d positions`` with create_graph=True,
    as force fields and physics-informed networks do: training it differentiates the forces
    with respect to the parameters, a second-order gradient through the tanh layers' saved
    results, rebuilt by the region."""

    class Energy(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1 = nn.Linear(3, 16, dtype=torch.float64)
            self.l2 = nn.Linear(16, 1, dtype=torch.float64)

        def forward(self, pos):
            energy = self.l2(torch.tanh(self.l1(pos))).sum()
            (forces,) = torch.autograd.grad(-energy, pos, create_graph=True)
            return forces

    torch.manual_seed(0)
    model = Energy()
    pos0 = torch.randn(5, 3, dtype=torch.float64)

    def step(call):
        pos = pos0.clone().requires_grad_()
        forces = call(pos)
        loss = forces.square().sum()
        wrt = [pos, model.l1.weight, model.l1.bias, model.l2.weight]  # (forces do not depend on l2's bias)
        return (forces.detach(), *torch.autograd.grad(loss, wrt))

    want = step(model)
    oracle = step(lambda p: torch_checkpoint(model, p, use_reentrant=False))
    for a, b in zip(want, oracle, strict=True):
        assert torch.equal(a, b)
    tracedac.checkpoint(model, policy=policy)
    try:
        for _ in range(CALLS):
            for a, b in zip(want, step(model), strict=True):
                assert torch.equal(a, b), (a - b).abs().max()
    finally:
        tracedac.unwrap(model)


class _SizesSubclass(torch.Tensor):
    """A wrapper subclass whose sizes come from Python (``dispatch_sizes_strides_policy``):
    reading ``.size()`` dispatches ``aten.sym_size`` from C++, as torch's own selective
    checkpoint test ``test_subclass_dispatching_sizes`` does."""

    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(
            cls, elem.size(), dtype=elem.dtype, dispatch_sizes_strides_policy="sizes"
        )

    def __init__(self, elem):
        self.elem = elem

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.sym_size.default:
            return args[0].elem.size()
        unwrap = lambda t: t.elem if isinstance(t, _SizesSubclass) else t  # noqa: E731
        return func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in (kwargs or {}).items()})


def test_a_subclass_whose_sizes_come_from_python_runs_in_a_region_with_eagers_result():
    """``sym_size`` returns ``SymInt[]``, not tensors: it is metadata, and it reaches the
    recorder from C++, where an exception aborts the process (it once did: counted as a
    tensor-returning op, then refused). The subclass's own dispatch runs it now, as every
    subclass op, and the region records the plain ops beneath (docs/design.md, "Tensor
    subclasses"); the subclass cannot be taken apart, so autograd's copy is held as is."""
    fn = lambda t: t.size(0) * t.sin()  # noqa: E731
    x = _SizesSubclass(torch.randn(3, 4))
    assert torch.equal(tracedac.checkpoint_call(fn, x), fn(x))
