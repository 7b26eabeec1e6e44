"""torch's selective activation checkpointing taken as it is: a ``context_fn`` made by
``create_selective_checkpoint_contexts`` becomes the tracedac policy deciding the same for
the same ops (``tracedac.policies.selective``). torch's own run of the same ``context_fn`` is the
oracle: the same gradients, the same expensive ops recomputed, the same questions asked."""

import contextlib
import copy
import dataclasses
import functools
import inspect
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.flop_counter import FlopCounterMode

import tracedac
from tracedac import CheckpointError, checkpoint_call, policies
from tracedac.policies.selective import TorchSelective, from_context_fn, torch_selective

from .util import OpCounter

aten = torch.ops.aten


def save_mm(ctx, op, *args, **kwargs):
    """torch's own example of a selective checkpointing policy."""
    return CheckpointPolicy.MUST_SAVE if op == aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE


def recompute_everything(ctx, op, *args, **kwargs):
    return CheckpointPolicy.PREFER_RECOMPUTE


def torchs_example(x, y):
    """The function of create_selective_checkpoint_contexts' docstring."""
    return torch.sigmoid(torch.matmul(torch.matmul(x, y), y)) * y


def _xy():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(10, 10, dtype=torch.float64, generator=g).requires_grad_() for _ in range(2)]


CONTEXT_FNS = {
    "partial(policy_fn)": functools.partial(create_selective_checkpoint_contexts, save_mm),
    "lambda: policy_fn": lambda: create_selective_checkpoint_contexts(save_mm),
    "partial(list)": functools.partial(create_selective_checkpoint_contexts, [aten.mm.default]),
}


def _backward_counts(run, fn, args, context_fn):
    """Output, gradients, the ops run in backward and its FLOPs (torch's counter)."""
    args = [a.detach().requires_grad_() for a in args]
    out = run(fn, *args, use_reentrant=False, context_fn=context_fn)
    with OpCounter() as ops, FlopCounterMode(display=False) as flops:
        grads = torch.autograd.grad(out.sum(), args)
    return out.detach(), grads, ops.counts, flops.get_total_flops()


@pytest.mark.parametrize("context_fn", CONTEXT_FNS.values(), ids=CONTEXT_FNS.keys())
def test_torchs_own_example_recomputes_the_same_matmuls_and_flops_as_torch(context_fn):
    """The point of a context_fn is which expensive ops backward runs again: under tracedac it
    must be the same matmuls, the same FLOPs, and the same gradients as under torch."""
    x, y = _xy()
    want = _backward_counts(torch_checkpoint, torchs_example, (x, y), context_fn)
    got = _backward_counts(checkpoint_call, torchs_example, (x, y), context_fn)
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1], strict=True))
    assert got[2][aten.mm] == want[2][aten.mm]  # backward's own mms: none recomputed in either
    assert got[3] == want[3]
    # tracedac replays only what backward reads, never more than torch reruns
    assert all(got[2][op] <= want[2][op] for op in got[2])


def test_a_policy_that_saves_nothing_recomputes_every_matmul_backward_needs_as_torch_does():
    """PREFER_RECOMPUTE everywhere is plain checkpointing in torch: the matmuls backward needs
    are run again, and tracedac replays the same ones."""
    x, y = _xy()
    context_fn = functools.partial(create_selective_checkpoint_contexts, recompute_everything)
    want = _backward_counts(torch_checkpoint, torchs_example, (x, y), context_fn)
    got = _backward_counts(checkpoint_call, torchs_example, (x, y), context_fn)
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1], strict=True))
    assert got[2][aten.mm] == want[2][aten.mm] > 4  # two replayed, four of backward's own
    assert got[3] == want[3]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16, dtype=torch.float64)
        self.up = nn.Linear(16, 32, dtype=torch.float64)
        self.down = nn.Linear(32, 16, bias=False, dtype=torch.float64)

    def forward(self, x):
        h = self.up(self.norm(x))
        h = F.gelu(h).mul(1.5)
        h = self.down(h.tanh())
        return x + h.softmax(-1)


# torch 2.13 gives the policy function each op's result (ctx.op_output); torch 2.11's context
# has no such attribute, and tracedac's (torch's own class) has none there either.
GIVES_OUTPUT = "op_output" in inspect.signature(SelectiveCheckpointContext).parameters
NO_OUTPUT = "no op_output"  # what _record writes down for a context without one


def _record(calls):
    """A policy function that writes down what it was asked (tensors copied as they were)."""

    def policy_fn(ctx, op, *args, **kwargs):
        copy_ = lambda a: a.detach().clone() if isinstance(a, torch.Tensor) else a  # noqa: E731
        out = getattr(ctx, "op_output", NO_OUTPUT)
        calls.append(
            (
                op,
                ctx.is_recompute,
                [copy_(a) for a in args],
                {k: copy_(v) for k, v in kwargs.items()},
                copy_(out) if isinstance(out, torch.Tensor) else out if out is NO_OUTPUT else None,
            )
        )
        keep = op.overloadpacket in policies.MATMUL_OPS
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy_fn


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor) and a.device == b.device and a.shape == b.shape and torch.equal(a, b)
        )
    return a == b


def test_the_policy_function_is_asked_about_each_op_that_allocates_with_torchs_arguments():
    """A policy function may read the op's arguments and result (their shapes, their values):
    it gets what torch gives it, the real tensors, for every op that makes a new tensor (views
    cost nothing to rebuild and are not asked), in the forward's order, once each."""
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    torch_calls, our_calls = [], []
    sac = create_selective_checkpoint_contexts
    out_t = torch_checkpoint(
        block, x, use_reentrant=False, context_fn=functools.partial(sac, _record(torch_calls))
    )
    out = checkpoint_call(
        block, x, use_reentrant=False, context_fn=functools.partial(sac, _record(our_calls))
    )
    asked_by_torch = [c for c in torch_calls if not c[0].is_view]
    assert [c[0] for c in our_calls] == [c[0] for c in asked_by_torch]
    assert len(our_calls) >= 8
    for (op, recompute, args, kwargs, result), want in zip(our_calls, asked_by_torch, strict=True):
        assert recompute is False and want[1] is False
        assert all(a.device.type == "cpu" for a in args if isinstance(a, torch.Tensor))  # real tensors
        assert len(args) == len(want[2]) and all(_same(a, b) for a, b in zip(args, want[2])), op
        assert kwargs.keys() == want[3].keys() and all(_same(kwargs[k], want[3][k]) for k in kwargs), op
        assert _same(result, want[4]), op
    # the results are given (and compared above) where torch gives them, and only there
    assert any(isinstance(c[4], torch.Tensor) for c in our_calls) is GIVES_OUTPUT
    assert all((c[4] is NO_OUTPUT) is not GIVES_OUTPUT for c in our_calls + asked_by_torch)
    assert torch.equal(out, out_t)
    g, g_t = (torch.autograd.grad(o.sum(), (x, *block.parameters())) for o in (out, out_t))
    assert all(torch.equal(a, b) for a, b in zip(g, g_t, strict=True))


def test_a_policy_function_that_counts_its_calls_decides_as_in_torch():
    """torchtitan's policy saves every other matmul by counting the mms it is asked about:
    tracedac asks about each op once, in order, so the same mms are kept and recomputed."""
    ws = [
        torch.randn(12, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(i)) / 3
        for i in range(4)
    ]

    def chain(x, *ws):
        for w in ws:
            x = torch.tanh(x @ w)
        return x

    def context_fn():
        count = {"mm": 0}

        def every_other_mm(ctx, op, *args, **kwargs):
            if op == aten.mm.default:
                count["mm"] += 1
                return CheckpointPolicy.MUST_SAVE if count["mm"] % 2 else CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(every_other_mm)

    args = (torch.randn(5, 12, dtype=torch.float64), *[w.requires_grad_() for w in ws])
    want = _backward_counts(torch_checkpoint, chain, args, context_fn)
    got = _backward_counts(checkpoint_call, chain, args, context_fn)
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1], strict=True))
    assert got[2][aten.mm] == want[2][aten.mm]
    assert got[3] == want[3]
    recomputed_flops = (
        got[3]
        - _backward_counts(
            checkpoint_call,
            chain,
            args,
            functools.partial(create_selective_checkpoint_contexts, [aten.mm.default]),
        )[3]
    )
    assert recomputed_flops == 2 * 2 * 5 * 12 * 12  # two of the four mms ran again


def test_the_converted_policy_is_a_frozen_value_that_prints_as_its_call():
    """Policies key plan caches and compiled regions' specs, and name themselves in reports:
    like every tracedac policy, the converted one compares, hashes, pickles and prints as the
    call that makes it; a list of ops is tracedac's own save_ops."""
    policy = from_context_fn(functools.partial(create_selective_checkpoint_contexts, save_mm))
    assert policy == torch_selective(save_mm) == TorchSelective(save_mm)
    assert hash(policy) == hash(TorchSelective(save_mm))
    assert repr(policy) == "torch_selective(save_mm)"
    assert copy.deepcopy(policy) == policy and pickle.loads(pickle.dumps(policy)) == policy
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.policy_fn = recompute_everything
    sac = create_selective_checkpoint_contexts
    listed = from_context_fn(lambda: sac([aten.mm.default, aten.bmm.default]))
    assert listed == policies.save_ops(aten.mm.default, aten.bmm.default)
    assert from_context_fn(functools.partial(sac, [])) == policies.recompute_all()
    assert from_context_fn(noop_context_fn) is None and from_context_fn(None) is None
    report = tracedac.saved_report(torchs_example, *_xy(), policy=policy)
    assert "torch_selective(save_mm) -> MUST_SAVE" in str(report)


def test_a_bool_answer_is_read_as_torch_reads_it():
    """torch still accepts True/False from a policy function (True: save)."""
    x, y = _xy()
    context_fn = functools.partial(
        create_selective_checkpoint_contexts, lambda ctx, op, *a, **k: op == aten.mm.default
    )
    want = _backward_counts(torch_checkpoint, torchs_example, (x, y), context_fn)
    got = _backward_counts(checkpoint_call, torchs_example, (x, y), context_fn)
    assert got[2][aten.mm] == want[2][aten.mm] and got[3] == want[3]


@pytest.mark.parametrize(
    "offload",
    [CheckpointPolicy.MUST_CPU_OFFLOAD, CheckpointPolicy.PREFER_CPU_OFFLOAD],
    ids=["MUST_CPU_OFFLOAD", "PREFER_CPU_OFFLOAD"],
)
def test_asking_to_offload_offloads_and_gives_torchs_gradients(offload):
    """An offload decision is carried out (tracedac.offload.host), not refused nor silently kept:
    the matmuls' results leave the region's handles for host copies, nothing is replayed, and
    the gradients are bitwise torch's."""
    x, y = _xy()
    context_fn = functools.partial(
        create_selective_checkpoint_contexts,
        lambda ctx, op, *a, **k: offload if op == aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE,
    )
    want = _backward_counts(torch_checkpoint, torchs_example, (x, y), context_fn)
    got = _backward_counts(checkpoint_call, torchs_example, (x, y), context_fn)
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1], strict=True))
    assert got[2][aten.mm] == 4, "backward's own matmuls only: none replayed"
    report = tracedac.saved_report(
        lambda x, y: checkpoint_call(torchs_example, x, y, context_fn=context_fn), x, y
    )
    assert [r.op for r in report.rows if r.kind == "offloaded"] == ["aten.mm.default"] * 2
    assert report.kept_bytes == 0 and report.offloaded_bytes == 2 * 10 * 10 * 8


# A context_fn that is not torch's selective checkpointing: its contexts are entered around the
# forward and each replay (tests/test_context_fn.py); here only where it meets a policy.
NULL_PAIR = lambda: (contextlib.nullcontext(), contextlib.nullcontext())  # noqa: E731


def save_sin(ctx, op, *args, **kwargs):
    """The policy of torch's tests of a kept result: keep sin's, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op == aten.sin.default else CheckpointPolicy.PREFER_RECOMPUTE


def _eager_and_tracedac(fn, context_fn, backwards=1):
    """Output and gradients (``backwards`` of them, with retain_graph) of ``fn`` run eagerly and
    under tracedac with ``context_fn``."""
    runs = []
    for run in (
        lambda f, x: f(x),
        lambda f, x: checkpoint_call(f, x, use_reentrant=False, context_fn=context_fn),
    ):
        x = torch.randn(5, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).requires_grad_()
        out = run(fn, x)
        grads = [torch.autograd.grad(out.sum(), x, retain_graph=True)[0] for _ in range(backwards)]
        runs.append((out.detach(), grads))
    return runs


def test_a_second_backward_through_a_selective_region_gives_eagers_gradients_again():
    """torch's selective checkpointing raises "Trying to backward an extra time" at the second
    ``backward(retain_graph=True)`` (its cached results are consumed by the first): a
    limitation it states, not a rule of autograd. A replay pass needs no cache, so tracedac
    runs another and gives eager's gradients, as eager does with retain_graph."""
    context_fn = functools.partial(create_selective_checkpoint_contexts, save_sin)
    (want, want_grads), (got, got_grads) = _eager_and_tracedac(
        lambda x: x.sin().cos().exp(), context_fn, backwards=2
    )
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(got_grads, want_grads, strict=True))


@pytest.mark.parametrize("allow_cache_entry_mutation", [False, True])
def test_a_kept_result_the_region_then_changes_in_place_gives_eagers_gradients(allow_cache_entry_mutation):
    """``x.sin().mul_(2)`` with sin's result kept: torch's selective checkpointing raises
    ("has been mutated"), or with ``allow_cache_entry_mutation=True`` replays ``mul_`` on the
    kept tensor, already doubled, so that ``cos`` reads 4 sin(x) (torch 2.13's gradient then
    differs from eager's). tracedac records the write and replays it on a private copy of the
    state sin left (docs/design.md, "Mutation"): eager's gradients, either way."""
    context_fn = functools.partial(
        create_selective_checkpoint_contexts, save_sin, allow_cache_entry_mutation=allow_cache_entry_mutation
    )
    (want, want_grads), (got, got_grads) = _eager_and_tracedac(
        lambda x: x.sin().mul_(2).cos().exp(), context_fn
    )
    assert torch.equal(got, want) and torch.equal(got_grads[0], want_grads[0])


def test_a_policy_and_a_context_fn_together_are_refused():
    """Both say what to keep; picking one silently would ignore the other."""
    x, y = _xy()
    with pytest.raises(CheckpointError, match="Pass one of them"):
        checkpoint_call(
            torchs_example,
            x,
            y,
            policy=policies.save_matmuls(),
            context_fn=functools.partial(create_selective_checkpoint_contexts, save_mm),
        )
    # torch's default context_fn asks for nothing: no conflict
    checkpoint_call(torchs_example, x, y, policy=policies.save_matmuls(), context_fn=noop_context_fn)


def test_torchs_checkpoint_wrapper_with_tracedac_as_checkpoint_fn_takes_a_context_fn():
    """FSDP-era code checkpoints blocks with checkpoint_wrapper(module, checkpoint_fn=...,
    context_fn=...) or a partial of the checkpoint function: both reach checkpoint_call."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    context_fn = functools.partial(create_selective_checkpoint_contexts, save_mm)
    torch.manual_seed(0)
    base = nn.Sequential(Block(), Block())
    x0 = torch.randn(3, 16, dtype=torch.float64)

    def grads(model):
        x = x0.clone().requires_grad_()
        return torch.autograd.grad(model(x).square().sum(), (x, *model.parameters()))

    with OpCounter() as torch_ops:
        want = grads(
            nn.Sequential(*[checkpoint_wrapper(copy.deepcopy(b), context_fn=context_fn) for b in base])
        )
    variants = [
        nn.Sequential(
            *[
                checkpoint_wrapper(copy.deepcopy(b), checkpoint_fn=checkpoint_call, context_fn=context_fn)
                for b in base
            ]
        ),
        nn.Sequential(
            *[
                checkpoint_wrapper(
                    copy.deepcopy(b),
                    checkpoint_fn=functools.partial(
                        checkpoint_call, use_reentrant=False, context_fn=context_fn
                    ),
                )
                for b in base
            ]
        ),
    ]
    for model in variants:
        with OpCounter() as ops:
            got = grads(model)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        # per block: down's forward mm, then backward's four (no mm replayed)
        assert ops.counts[aten.mm] == torch_ops.counts[aten.mm] == 2 * (1 + 4)


def test_a_context_fn_works_inside_torch_compile():
    """torch marks create_selective_checkpoint_contexts as not to be traced: the conversion
    runs at trace time, as a constant, and the compiled region gets the converted policy."""
    w = torch.randn(16, 16, dtype=torch.float64, requires_grad=True)
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    for context_fn in CONTEXT_FNS.values():

        def f(x, run):
            return run(lambda y: (y @ w).tanh() @ w, x, use_reentrant=False, context_fn=context_fn)

        want = torch.autograd.grad(f(x, torch_checkpoint).sum(), (x, w))
        torch._dynamo.reset()
        compiled = torch.compile(
            functools.partial(f, run=checkpoint_call), backend="aot_eager", fullgraph=True
        )
        got = torch.autograd.grad(compiled(x).sum(), (x, w))
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)

    def g(x):
        return checkpoint_call(lambda y: (y @ w).tanh() @ w, x, context_fn=CONTEXT_FNS["partial(policy_fn)"])

    torch._dynamo.reset()
    report = tracedac.saved_report(torch.compile(g, backend="aot_eager_decomp_partition", fullgraph=True), x)
    kept = [r.why for r in report.rows if r.op == "aten.mm.default"]
    assert kept == ["torch_selective(save_mm) -> MUST_SAVE"]

    def foreign(x):
        return checkpoint_call(lambda y: y.sin(), x, context_fn=NULL_PAIR)

    torch._dynamo.reset()
    with pytest.raises(CheckpointError, match="only run while the region is traced"):
        torch.compile(foreign, backend="aot_eager", fullgraph=True)(x)


# --- Hugging Face: gradient_checkpointing_kwargs={"context_fn": ...} ---------------------


@pytest.fixture
def llama():
    """The tiny Llama's builder, batch and loss, where tracedac.integrations.hf can run."""
    pytest.importorskip("transformers")
    from .support.hf_models import NO_SWITCH, batch, build, loss

    if NO_SWITCH is not None:
        pytest.skip(NO_SWITCH)
    return build, batch, loss


@pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers' deprecated gradient_checkpointing_enable
def test_hugging_faces_gradient_checkpointing_kwargs_context_fn_runs_under_the_converted_policy(llama):
    """Trainer hands gradient_checkpointing_kwargs to the model's switch: with tracedac enabled
    a selective context_fn there is honoured (not dropped, not refused), with torch's
    gradients and no more matmuls run again than under torch's own selective checkpointing."""
    from tracedac.integrations import hf

    build, batch, loss = llama
    context_fn = functools.partial(create_selective_checkpoint_contexts, save_mm)
    kwargs = {"use_reentrant": False, "context_fn": context_fn}
    inputs = batch()

    def run(model):
        out = loss(model, inputs)
        with OpCounter() as ops, FlopCounterMode(display=False) as flops:
            grads = torch.autograd.grad(out, [p for p in model.parameters() if p.requires_grad])
        return grads, ops.counts[aten.mm], flops.get_total_flops()

    reference = build("llama")
    reference.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)  # torch's checkpoint
    model = build("llama")
    hf.enable(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    layer = model.model.layers[0]
    assert layer._gradient_checkpointing_func.policy == TorchSelective(save_mm)
    want, got = run(reference), run(model)
    assert all(torch.equal(a, b) for a, b in zip(got[0], want[0], strict=True))
    assert got[1] == want[1] and got[2] == want[2]

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert layer._gradient_checkpointing_func.policy == policies.recompute_all()  # enable()'s again

    hf.enable(model, policy=policies.save_matmuls())
    with pytest.raises(CheckpointError, match="each says what to keep"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    with pytest.raises(CheckpointError, match="not a pair"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"context_fn": lambda: None})


@pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers' deprecated gradient_checkpointing_enable
def test_hugging_faces_other_context_fn_is_entered_around_each_layers_forward_and_replay(llama):
    """transformers passes gradient_checkpointing_kwargs to every layer's checkpoint call, so
    torch calls context_fn once per layer call; so does tracedac, entering the forward context
    around the layer's forward and the recompute context around its replay, under enable()'s
    policy, with torch's gradients."""
    from tracedac.integrations import hf

    build, batch, loss = llama
    calls, entered = [], []

    @contextlib.contextmanager
    def recompute():
        entered.append(1)
        yield

    def context_fn():
        calls.append(1)
        return contextlib.nullcontext(), recompute()

    kwargs = {"use_reentrant": False, "context_fn": context_fn}
    inputs = batch()
    reference = build("llama")
    reference.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)  # torch's checkpoint
    out = loss(reference, inputs)
    layers = len(calls)
    assert layers == 2  # the tiny model's layers
    want = torch.autograd.grad(out, [p for p in reference.parameters() if p.requires_grad])

    model = build("llama")
    hf.enable(model, policy=policies.save_matmuls())
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    calls.clear()
    entered.clear()
    out = loss(model, inputs)
    assert len(calls) == layers and entered == []
    got = torch.autograd.grad(out, [p for p in model.parameters() if p.requires_grad])
    assert len(entered) == layers
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert model.model.layers[0]._gradient_checkpointing_func.policy == policies.save_matmuls()
