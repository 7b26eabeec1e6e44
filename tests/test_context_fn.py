"""A ``context_fn`` that is not torch's selective checkpointing: its pair of contexts entered
as torch's checkpoint enters them (``tracedac.policies.selective.Contexts``). The forward context
around the forward, once; the recompute context around each replay of the region, in
backward. torch's own run of the same program, and eager without checkpointing, are the
oracles for what the forward context sees and for the gradients."""

import contextlib
import gc
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from tracedac import CheckpointError, checkpoint_call, policies

aten = torch.ops.aten


class OpLog(TorchDispatchMode):
    """Records the name of every op that reaches it, in order."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, dtype=torch.float64, generator=g)
    w = torch.randn(4, 4, dtype=torch.float64, generator=g)
    return x, w


def program(x, w):
    # backward reads mm's inputs (held: they come from outside), tanh's result and sin's input
    # (the same tensor): replay reruns mm and tanh, never sin
    return (x @ w).tanh().sin()


def _run(run, x0, w0, **kwargs):
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    out = run(program, x, w, **kwargs)
    return out, (x, w)


def test_the_forward_context_sees_the_programs_ops_once_and_the_recompute_context_what_replay_runs():
    """torch enters the forward context around the forward and the recompute context around
    its recomputation. Under tracedac the forward runs once, inside the region and below the
    user's mode (what the mode runs is what is recorded), so the forward context sees exactly
    the ops torch's does; the recompute context sees, in backward only, the ops replay reruns:
    mm and tanh here, without the detach torch's recomputation adds for each saved tensor."""
    x0, w0 = _inputs()
    torch_forward, torch_recompute = OpLog(), OpLog()
    out, args = _run(
        torch_checkpoint, x0, w0, use_reentrant=False, context_fn=lambda: (torch_forward, torch_recompute)
    )
    want = torch.autograd.grad(out.sum(), args)

    forward, recompute = OpLog(), OpLog()
    out, args = _run(checkpoint_call, x0, w0, use_reentrant=False, context_fn=lambda: (forward, recompute))
    assert forward.ops == torch_forward.ops == ["mm.default", "tanh.default", "sin.default"]
    assert recompute.ops == []  # nothing replays in the forward
    got = torch.autograd.grad(out.sum(), args)
    assert forward.ops == ["mm.default", "tanh.default", "sin.default"]  # not entered again
    assert recompute.ops == ["mm.default", "tanh.default"]
    assert [op for op in torch_recompute.ops if op != "detach.default"] == recompute.ops
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


class TanhAsSigmoid(TorchDispatchMode):
    """Runs sigmoid wherever tanh is asked for: a mode that changes what the forward computes
    (as one that runs matmuls in lower precision would)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is aten.tanh.default:
            func = aten.sigmoid.default
        return func(*args, **(kwargs or {}))


def test_what_the_forward_context_runs_is_what_is_recorded_and_replayed():
    """The forward context is entered inside the region, above its recorder, so the recorder
    records the ops the context runs (sigmoid), and replay, which needs no context to repeat
    them, gives eager's gradients under the same mode. Entered below the recorder, replay would
    rerun tanh where the forward ran sigmoid."""
    x0, w0 = _inputs()
    with TanhAsSigmoid():
        eager_out, eager_args = _run(lambda f, *a: f(*a), x0, w0)
    want = torch.autograd.grad(eager_out.sum(), eager_args)
    out, args = _run(checkpoint_call, x0, w0, context_fn=lambda: (TanhAsSigmoid(), contextlib.nullcontext()))
    assert torch.equal(out, eager_out)
    got = torch.autograd.grad(out.sum(), args)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_the_policy_still_decides_what_is_kept_and_so_what_the_recompute_context_sees():
    """A foreign context_fn says nothing about what to keep: ``policy=`` does. Keeping the
    matmul leaves tanh to replay; keeping everything replays nothing, so the recompute context
    is never entered."""
    x0, w0 = _inputs()
    eager_out, eager_args = _run(lambda f, *a: f(*a), x0, w0)
    want = torch.autograd.grad(eager_out.sum(), eager_args)
    entered = []

    class Recompute(OpLog):
        def __enter__(self):
            entered.append(self)
            return super().__enter__()

    for policy, replayed in ((policies.save_matmuls(), ["tanh.default"]), (policies.save_all(), [])):
        recompute = Recompute()
        entered.clear()
        out, args = _run(checkpoint_call, x0, w0, policy=policy, context_fn=lambda: (OpLog(), recompute))
        got = torch.autograd.grad(out.sum(), args)
        assert recompute.ops == replayed and len(entered) == (1 if replayed else 0)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_a_contextmanager_recompute_context_is_entered_afresh_for_each_backward_pass():
    """``context_fn`` is called once per checkpoint call, as torch calls it, and a
    ``@contextmanager`` context can be entered only once: torch enters the same object at the
    second recomputation of a ``retain_graph=True`` backward and fails with an AttributeError.
    tracedac enters a fresh one from the same generator function per replay pass, so the
    second backward runs inside it too and gives eager's gradients again."""
    x0, w0 = _inputs()
    eager_out, eager_args = _run(lambda f, *a: f(*a), x0, w0)
    want = torch.autograd.grad(eager_out.sum(), eager_args)
    log = []

    @contextlib.contextmanager
    def recompute(tag):
        log.append(f"enter {tag}")
        try:
            yield
        finally:
            log.append(f"exit {tag}")

    def context_fn():
        log.append("context_fn")
        return contextlib.nullcontext(), recompute("r")

    out, args = _run(checkpoint_call, x0, w0, context_fn=context_fn)
    assert log == ["context_fn"]
    for _ in range(2):
        got = torch.autograd.grad(out.sum(), args, retain_graph=True)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert log == ["context_fn", "enter r", "exit r", "enter r", "exit r"]

    # the same generator context returned as both: the forward enters it, replay a fresh copy
    log.clear()
    shared = lambda: (lambda cm: (cm, cm))(recompute("both"))  # noqa: E731
    out, args = _run(checkpoint_call, x0, w0, context_fn=shared)
    torch.autograd.grad(out.sum(), args)
    assert log == ["enter both", "exit both", "enter both", "exit both"]


def test_under_no_grad_context_fn_is_called_and_its_contexts_are_not_entered():
    """As torch: the call asks ``context_fn`` for its pair, and without a gradient to record
    there is no region, no forward context and nothing to replay."""
    x0, w0 = _inputs()
    forward, recompute, calls = OpLog(), OpLog(), []

    def context_fn():
        calls.append(1)
        return forward, recompute

    with torch.no_grad():
        out = checkpoint_call(program, x0, w0, context_fn=context_fn)
    assert torch.equal(out, program(x0, w0)) and calls == [1]
    assert forward.ops == recompute.ops == []


def test_a_forward_context_that_swallows_the_forwards_exception_is_an_error_not_a_none_result():
    """torch raises here too: there is no output to return from a forward that failed."""

    class Swallow:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return True

    def fails(x):
        raise ValueError("the forward failed")

    x = torch.randn(3, requires_grad=True)
    with pytest.raises(CheckpointError, match="suppressed an exception"):
        checkpoint_call(fails, x, context_fn=lambda: (Swallow(), contextlib.nullcontext()))


def test_torchs_selective_checkpointing_inside_other_contexts_is_refused_by_name():
    """Returned as it is, torch's pair becomes a policy (test_selective.py). Wrapped in other
    contexts it would run as torch's caching modes around tracedac's forward and replay, handing
    back cached results in torch's recompute order: refused, saying how to combine the two."""

    def context_fn():
        forward, recompute = create_selective_checkpoint_contexts([aten.sin.default])

        @contextlib.contextmanager
        def both(mode):
            with OpLog(), mode:
                yield

        return both(forward), both(recompute)

    x = torch.randn(3, requires_grad=True)
    with pytest.raises(CheckpointError, match=r"policy=tracedac\.selective\.torch_selective"):
        checkpoint_call(lambda y: y.sin().exp(), x, context_fn=context_fn)


@pytest.mark.parametrize(
    ("context_fn", "message"),
    [
        (lambda: None, "returned NoneType, not a pair"),
        (lambda: (contextlib.nullcontext(),), "returned tuple, not a pair"),
        (lambda: (contextlib.nullcontext(), 3), "returned tuple, not a pair"),
        (3, "which is not callable"),
    ],
    ids=["None", "one context", "not a context", "not callable"],
)
def test_a_context_fn_that_does_not_return_a_pair_of_contexts_is_refused(context_fn, message):
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(CheckpointError, match=message):
        checkpoint_call(torch.sin, x, context_fn=context_fn)


def test_reentrant_checkpointing_with_a_context_fn_is_refused_with_torchs_reason():
    x = torch.randn(3, requires_grad=True)
    pair = lambda: (contextlib.nullcontext(), contextlib.nullcontext())  # noqa: E731
    with pytest.raises(CheckpointError, match="only supported when use_reentrant=False"):
        checkpoint_call(torch.sin, x, use_reentrant=True, context_fn=pair)


def test_a_foreign_context_fn_under_torch_compile_is_refused_saying_why():
    """torch's compiled checkpoint enters such contexts around its trace, on fake tensors, and
    never at run time (its recompute context never runs): tracedac refuses instead of
    pretending, at trace time under dynamo and under make_fx alike."""
    from torch.fx.experimental.proxy_tensor import make_fx

    x = torch.randn(3, requires_grad=True)

    def f(x):
        return checkpoint_call(torch.sin, x, context_fn=lambda: (OpLog(), OpLog()))

    torch._dynamo.reset()
    with pytest.raises(CheckpointError, match="only run while the region is traced"):
        torch.compile(f, backend="aot_eager", fullgraph=True)(x)
    with pytest.raises(CheckpointError, match="only run while the region is traced"):
        make_fx(f)(x)


def test_a_region_with_contexts_is_freed_with_its_output_by_reference_counting():
    """The region's graph holds the recompute context (to enter at each replay), and nothing
    of the contexts holds the graph: dropping the output frees it, with or without backward,
    and with the cyclic garbage collector off."""
    from tracedac.region import reporting

    def context_fn():
        return OpLog(), OpLog()

    def region(x):
        with reporting() as regions:
            out = checkpoint_call(lambda y: y.exp().sin(), x, context_fn=context_fn)
        graph = weakref.ref(regions[0].graph)
        regions.clear()
        return out, graph

    x = torch.randn(3, requires_grad=True)
    # the first dispatch through a Python mode imports torch._dynamo (and sympy): something in that
    # import keeps the calling frames, and with them this first region, alive
    region(x)
    gc.disable()
    try:
        out, graph = region(x)
        del out
        assert graph() is None
        out, graph = region(x)
        out.sum().backward()
        assert graph() is None
    finally:
        gc.enable()
