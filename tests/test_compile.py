"""Checkpointed regions under torch.compile: one graph, the regions' policies as the partitioner's tags.

Oracles: the same model compiled without checkpointing (gradients, side effects), torch's
own partitioner output (what the compiled forward saves, read off its backward graph).
Most tests use ``aot_eager_decomp_partition`` (the partition inductor makes, without its
slow C++ compile); one test runs inductor itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

import tracedac
from tracedac import CheckpointError, policies
from tracedac.inspect.compiled import partition

BACKEND = "aot_eager_decomp_partition"


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles its own models: dynamo's per-code recompile limit must not carry over."""
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Block(nn.Module):
    """An MoE-style block: a router that counts tokens into a buffer, a Python counter, dropout."""

    def __init__(self, d=16, h=32, dropout=0.0):
        super().__init__()
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)
        self.router = nn.Linear(d, 4, bias=False)
        self.drop = nn.Dropout(dropout)
        self.register_buffer("tokens", torch.zeros(4))
        self.calls = 0

    def forward(self, x):  # [B, d]
        self.calls += 1
        choice = self.router(x).argmax(-1)  # [B]
        self.tokens.add_(torch.bincount(choice, minlength=4).to(self.tokens.dtype))
        h = tracedac.name(self.drop(torch.relu(self.up(x))), "hidden")  # [B, h]
        return x + self.down(h).sin()


def model(policy=None, n=3, dropout=0.0, seed=0):
    torch.manual_seed(seed)
    m = nn.Sequential(*[Block(dropout=dropout) for _ in range(n)])
    if policy is not None:
        tracedac.wrap(m, Block, policy=policy)
    return m


def step(m, x, seed=0):
    torch.manual_seed(seed)
    m(x).square().sum().backward()
    return [p.grad for p in m.parameters()]


def region_bytes(m, x) -> int:
    """Bytes the compiled forward saves that it computed (graph inputs are alive anyway)."""
    return sum(p.saved_bytes for p in partition(m, x))


X = torch.randn(8, 16)


@pytest.fixture(scope="module")
def reference():
    """Gradients and router counts of the model without checkpointing (eager: the compiled
    model without checkpointing is compared in the torchtitan and inductor tests)."""
    ref = model()
    return step(ref, X), ref[0].tokens.clone()


@pytest.mark.parametrize(
    "policy", [policies.recompute_all(), policies.memory_budget(0.5), policies.min_cut()], ids=repr
)
def test_whole_model_compiles_fullgraph_dynamic_with_side_effects_once_and_equal_gradients(policy, reference):
    m = model(policy)
    hooks = []
    m[0].register_forward_pre_hook(lambda mod, a: hooks.append("pre"))
    m[0].register_forward_hook(lambda mod, a, o: hooks.append("post"))
    c = torch.compile(m, backend=BACKEND, fullgraph=True, dynamic=True)
    ref_grads, ref_tokens = reference
    for a, b in zip(ref_grads, step(c, X), strict=True):
        torch.testing.assert_close(a, b)
    assert [blk.calls for blk in m] == [1, 1, 1]
    assert hooks == ["pre", "post"]
    assert torch.equal(m[0].tokens, ref_tokens) and m[0].tokens.sum() == 8


def test_each_policy_changes_what_the_compiled_forward_saves():
    """recompute_all keeps least; save_matmuls keeps the matmuls; memory_budget(0.5) at most
    half of what the compiled model saves without checkpointing."""
    x = X.clone().requires_grad_()
    full = region_bytes(model(), x)
    kept = {
        repr(p): region_bytes(model(p), x) for p in (policies.recompute_all(), policies.memory_budget(0.5))
    }
    report = tracedac.saved_report(torch.compile(model(policies.save_matmuls()), backend=BACKEND), x)
    # <= full: on torch >= 2.14, once tracedac's joint pass is installed (any earlier compiled
    # region), the partitioner saves less of a model without regions too (docs/design.md,
    # "Supported torch"), here exactly what save_matmuls keeps
    assert kept["recompute_all()"] < report.kept_bytes <= full
    assert kept["memory_budget(0.5)"] <= 0.5 * full
    ops = [r.op for r in report.rows if r.kind == "activation" and "save_matmuls() -> MUST_SAVE" in r.why]
    assert ops == ["aten.addmm.default"] * 6  # up and down of each block (the router's argmax needs no grad)


def test_regions_with_different_policies_and_budgets_share_one_graph():
    m = model(n=4)
    for blk, p in zip(
        m,
        [
            policies.memory_budget(0.2),
            policies.memory_budget(0.8),
            policies.save_matmuls(),
            policies.recompute_all(),
        ],
    ):
        tracedac.checkpoint(blk, policy=p)
    (part,) = partition(m, X.clone().requires_grad_())
    ids = {}
    for n in part.fw.graph.nodes:
        custom = n.meta.get("custom") or {}
        if "tracedac_region" in custom and "ac_graph_id" in n.meta:
            ids.setdefault(custom["tracedac_region"], set()).add(n.meta["ac_graph_id"])
        elif "tracedac_region" in custom:  # left to the partitioner: a value made from no tensor (zeros)
            assert not any(isinstance(a.meta.get("val"), torch.Tensor) for a in n.all_input_nodes), (
                n.format_node()
            )
    assert len(ids) == 4 and all(len(v) == 1 for v in ids.values())
    assert sorted(min(v) for v in ids.values()) == [1, 2, 3, 4]
    saved = {}
    for n in part.saved:
        key = (n.meta.get("custom") or {}).get("tracedac_region")
        if key is not None and n.op != "placeholder":
            saved[key.split("|")[1]] = saved.get(key.split("|")[1], 0) + n.meta["val"].numel() * 4
    assert saved.get("memory_budget(0.2)", 0) < saved.get("memory_budget(0.8)", 0)


def test_back_to_back_calls_of_one_region_are_two_region_calls():
    """Each region entry marks the graph (``tracedac::region``): two calls of one checkpointed
    function with nothing between them get two ``ac_graph_id``s, and no mark survives the pass."""
    w = torch.randn(16, 16, requires_grad=True)
    f = tracedac.checkpoint(lambda x: (x @ w).sin(), policy=policies.save_matmuls())
    (part,) = partition(lambda x: f(f(x)).sum(), X.clone().requires_grad_())
    ids = [n.meta.get("ac_graph_id") for n in part.fw.graph.nodes if n.target is torch.ops.aten.mm.default]
    assert ids == [1, 2]
    assert not any("tracedac.region" in str(n.target) for g in (part.fw, part.bw) for n in g.graph.nodes)


def test_a_higher_order_op_in_a_region_gives_exact_gradients_and_a_warning():
    """``nested_compile_region`` inside a region traces to ``invoke_subgraph``: one node whose
    inside no policy sees. Exact gradients, and a warning that says so (once per region and op)."""

    @torch.compiler.nested_compile_region
    def inner(x, w):
        return (x @ w).relu()

    w = torch.randn(16, 16, requires_grad=True)
    f = tracedac.checkpoint(lambda x: inner(inner(x, w).sin(), w).cos().sum(), policy=policies.save_matmuls())
    x = X.clone().requires_grad_()
    with pytest.warns(UserWarning, match="contains invoke_subgraph, a higher-order op: its policy"):
        got = torch.autograd.grad(torch.compile(f, backend=BACKEND, fullgraph=True)(x), (x, w))
    want = torch.autograd.grad(inner(inner(x, w).sin(), w).cos().sum(), (x, w))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


def test_an_effectful_op_in_a_region_runs_once_and_draws_no_higher_order_warning(capfd):
    """An op registered with an effect (``aten._print``; zero's ``release`` at a unit's end)
    traces to ``with_effects``, a higher-order op that only threads a token: the partitioner
    keeps it in the forward, so nothing is replayed whole and no warning says so."""
    import warnings

    w = torch.randn(16, 16, requires_grad=True)

    def body(x):
        torch.ops.aten._print("tracedac-effect")
        return (x @ w).relu().sum()

    x = X.clone().requires_grad_()
    f = torch.compile(
        tracedac.checkpoint(body, policy=policies.save_matmuls()), backend=BACKEND, fullgraph=True
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="tracedac")
        got = torch.autograd.grad(f(x), (x, w))
    assert capfd.readouterr().out.count("tracedac-effect") == 1
    want = torch.autograd.grad((x @ w).relu().sum(), (x, w))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


def test_torchtitan_order_checkpoint_each_block_then_compile_each_block():
    from torch._dynamo.utils import counters

    ref = model()
    ref_blocks = nn.Sequential(*[torch.compile(b, backend=BACKEND, fullgraph=True) for b in ref])
    m = model()
    blocks = nn.Sequential(
        *[
            torch.compile(
                tracedac.checkpoint(b, policy=policies.save_matmuls()), backend=BACKEND, fullgraph=True
            )
            for b in m
        ]
    )
    counters.clear()
    for a, b in zip(step(ref_blocks, X), step(blocks, X), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert sum(counters["graph_break"].values()) == 0
    assert [blk.calls for blk in m] == [1, 1, 1]


def _graphs_per_block(m) -> int:
    """Dynamo graphs made compiling each block of ``m`` on its own (``module.compile``) for a step."""
    from torch._dynamo.utils import counters

    for b in m:
        b.compile(backend=BACKEND, fullgraph=True)
    counters.clear()
    step(m, X.clone().requires_grad_())  # (an input that needs no gradient: a graph of its own)
    return counters["stats"]["unique_graphs"]


class Plain(nn.Module):
    """A block torch's checkpoint compiles (no side effect in it)."""

    def __init__(self, d=16, h=32):
        super().__init__()
        self.up, self.down = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def test_blocks_wrapped_by_name_and_compiled_one_by_one_compile_once_as_torchs_checkpoint_does(reference):
    """``wrap`` names each region by its path ("0", "1", "2"); compiled block by block, the
    blocks still share one graph, as with torch's checkpoint (the name was guarded, and each
    block compiled again: minutes of a first step for a model of many layers)."""
    import torch.utils.checkpoint as torch_checkpoint

    class TorchCheckpointed(nn.Module):
        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, x):
            return torch_checkpoint.checkpoint(self.block, x, use_reentrant=False)

    plain = [Plain() for _ in range(3)]
    assert _graphs_per_block(nn.Sequential(*[TorchCheckpointed(b) for b in plain])) == 1
    ours = tracedac.wrap(nn.Sequential(*[Plain() for _ in range(3)]), Plain, policy=policies.save_matmuls())
    assert _graphs_per_block(ours) == 1
    m = model(policies.save_matmuls())  # side effects in the blocks: once each, eager's gradients
    assert _graphs_per_block(m) == 1
    assert [blk.calls for blk in m] == [1, 1, 1]
    for a, b in zip(reference[0], [p.grad for p in m.parameters()], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_decorator_and_checkpoint_call_compile_fullgraph():
    w = torch.randn(16, 16, requires_grad=True)

    @tracedac.checkpoint(policy=policies.save_matmuls())
    def f(x):
        return (x @ w).relu().sin()

    recompute = policies.recompute_all()

    def g(x):
        return tracedac.checkpoint_call(lambda y: (y @ w).tanh(), x, policy=recompute)

    def plain(x):
        return (x @ w).relu().sin() + (x @ w).tanh()

    x = X.clone().requires_grad_()
    c = torch.compile(lambda x: f(x) + g(x), backend=BACKEND, fullgraph=True)
    got = torch.autograd.grad(c(x).sum(), (x, w))
    want = torch.autograd.grad(plain(x).sum(), (x, w))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


def test_a_deep_copy_of_a_checkpointed_model_compiles_under_its_policy():
    """A region names its policy by id at trace time (``compile/registry.key_for``): a copied
    policy (``copy.deepcopy`` of the model, an EMA copy) is the original's own object (equal
    policies are one, ``policies.held.interned``), so the copy runs the original's graph."""
    import copy

    base = tracedac.checkpoint(
        nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16)), policy=policies.save_matmuls()
    )
    twin = copy.deepcopy(base)
    assert twin._tracedac.policy is base._tracedac.policy
    (part,) = partition(twin, X.clone().requires_grad_())
    first = next(n for n in part.fw.graph.nodes if n.target is torch.ops.aten.addmm.default)
    assert first.meta.get("recompute") is CheckpointPolicy.MUST_SAVE  # save_matmuls(), as the original's


@pytest.mark.parametrize(
    "make",
    [lambda: policies.memory_budget(0.5), policies.save_matmuls, lambda: policies.min_cut()],
    ids=["memory_budget", "save_matmuls", "min_cut"],
)
def test_blocks_each_given_an_equal_policy_of_their_own_compile_once(make):
    """``checkpoint(block, policy=memory_budget(0.5))`` block by block makes a policy per block.
    Dynamo guards a region's code on its policy's id, and each block compiled the code again:
    the ninth was refused under ``fullgraph=True`` (torch's recompile limit, 8), a model built
    again compiled again. Equal policies are one object: twelve blocks, then a second model,
    one graph."""
    from torch._dynamo.utils import counters

    def blocks():
        m = nn.Sequential(*[Plain() for _ in range(12)])
        for b in m:
            tracedac.checkpoint(b, policy=make())
            b.compile(backend=BACKEND, fullgraph=True)
        return m

    counters.clear()
    for m in (blocks(), blocks()):
        x = X.clone().requires_grad_()
        m(x).square().sum().backward()
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["recompiles"]
    assert make() is make() and policies.peak("1GiB") is not policies.peak("1GiB")  # (peak keeps state)


def test_checkpoint_call_without_a_policy_compiles_inside_the_compiled_code():
    """Its default policy is made once, outside any compiled code (``DEFAULT_POLICY``)."""
    w = torch.randn(16, 16, requires_grad=True)

    def g(x):
        return tracedac.checkpoint_call(lambda y: (y @ w).tanh(), x)

    x = X.clone().requires_grad_()
    got = torch.autograd.grad(torch.compile(g, backend=BACKEND, fullgraph=True)(x).sum(), w)[0]
    torch.testing.assert_close(got, torch.autograd.grad((x @ w).tanh().sum(), w)[0])


@pytest.mark.parametrize("make", [policies.recompute_all, policies.save_matmuls])
def test_a_policy_made_inside_the_compiled_code_is_an_error_that_says_where_to_make_it(make):
    """Dynamo hands the function that makes a region's key no policy object (torch 2.11 none
    at all; 2.13 none made inside the compiled code: ``save_matmuls()`` lost its field there):
    a region names its policy by id, and a policy made inside has none tracedac checked."""
    w = torch.randn(16, 16, requires_grad=True)

    def g(x):
        return tracedac.checkpoint_call(lambda y: (y @ w).tanh(), x, policy=make())

    with pytest.raises(CheckpointError, match="policy made inside the compiled code"):
        torch.compile(g, backend=BACKEND, fullgraph=True)(X.clone().requires_grad_())


def test_dropout_replays_the_same_numbers_compiled():
    ref = torch.compile(model(dropout=0.5), backend=BACKEND, fullgraph=True)
    c = torch.compile(model(policies.recompute_all(), dropout=0.5), backend=BACKEND, fullgraph=True)
    for a, b in zip(step(ref, X, seed=3), step(c, X, seed=3), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_a_buffer_backward_needs_changed_after_the_forward_is_an_error():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("scale", torch.full((16,), 2.0))

        def forward(self, x):
            return (x * self.scale).sin()

    m = tracedac.checkpoint(Scaled())
    c = torch.compile(m, backend=BACKEND, fullgraph=True)
    x = X.clone().requires_grad_()
    out = c(x)
    m.scale.add_(1.0)
    with pytest.raises(
        (RuntimeError, CheckpointError), match="modified by an inplace operation|modified in place"
    ):
        out.sum().backward()


ORDERS = ("written then read", "read then written", "sorted then written")


class Balanced(nn.Module):
    """Writes a buffer in the forward and reads it there: an expert bias updated from the tokens
    it routes, then added to the scores, or read before it is updated (by an op with one result,
    or by ``sort``, which has two)."""

    def __init__(self, order: str):
        super().__init__()
        self.up = nn.Linear(16, 16)
        self.register_buffer("bias", torch.zeros(16))
        self.order = order

    def forward(self, x):
        h = self.up(x)
        if self.order == "written then read":
            self.bias.add_(h.detach().mean(0))
        if self.order == "sorted then written":
            ranked, perm = self.bias.sort()
            out = (h + ranked).tanh() * h.index_select(1, perm).sigmoid()
        else:
            out = (h + self.bias).tanh() * h.sigmoid()
        if self.order != "written then read":
            self.bias.add_(h.detach().mean(0))
        return out


def balanced(order: str, policy, blocks: int = 2):
    torch.manual_seed(0)
    m = nn.Sequential(*[Balanced(order) for _ in range(blocks)])
    if policy is not None:
        tracedac.wrap(m, Balanced, policy=policy)
    return m


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize(
    "policy, backend",
    [
        (policies.recompute_all(), BACKEND),
        (policies.save_matmuls(), BACKEND),
        (policies.memory_budget(0.5), BACKEND),
        (policies.recompute_all(), "inductor"),
    ],
    ids=["recompute_all", "save_matmuls", "memory_budget(0.5)", "recompute_all-inductor"],
)
def test_a_buffer_the_region_writes_and_reads_compiles_with_eagers_gradients_and_one_write(
    policy, backend, order
):
    """Compiled, the buffer is written during the forward, and a replay reading it reads the
    written value: under inductor (the write a ``copy_`` in the graph) a silently wrong
    gradient, the update applied twice ("written then read") or the derivative taken at the
    written bias ("read then written"), which torch's compiled checkpoint returns (and
    torch.compile without checkpointing too, for the second); under ``aot_eager`` (the write
    copied in after the forward) autograd's refusal of the saved buffer. The region's first op
    on the buffer is saved instead (``sort``'s two results through their getitems: saving the
    op alone left the partitioner no partition), and gradients and buffers are eager's over
    two steps."""
    blocks = 1 if backend == "inductor" else 2  # (inductor's C++ compile is the slow part)
    eager, ckpt = balanced(order, None, blocks), balanced(order, policy, blocks)
    compiled = torch.compile(ckpt, backend=backend, fullgraph=True)
    for s in range(2):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(s))
        for a, b in zip(step(eager, x), step(compiled, x), strict=True):
            torch.testing.assert_close(b, a)
    for (name, a), (_, b) in zip(eager.named_buffers(), ckpt.named_buffers(), strict=True):
        torch.testing.assert_close(b, a, msg=f"buffer {name}")


def test_must_recompute_on_what_reads_a_buffer_the_region_writes_is_refused_compiled():
    """Such an op cannot be replayed right compiled (above): the policy's MUST is refused at
    compile time, naming the op and what to return instead; eagerly the same region runs. A
    buffer written and not read again in the region (the router's token counter) is no reason."""

    def must_recompute(node):
        return CheckpointPolicy.MUST_RECOMPUTE

    x = torch.randn(8, 16)
    eager = balanced(ORDERS[0], must_recompute)
    step(eager, x)
    with pytest.raises(Exception) as err:
        step(torch.compile(balanced(ORDERS[0], must_recompute), backend=BACKEND, fullgraph=True), x)
    cause = getattr(err.value, "inner_exception", err.value)  # dynamo wraps a backend's error
    assert isinstance(cause, CheckpointError), repr(err.value)
    assert "says MUST_RECOMPUTE for aten.add.Tensor" in str(cause)
    assert "Return PREFER_RECOMPUTE or MUST_SAVE for it" in str(cause)
    torch._dynamo.reset()
    m = model(must_recompute)
    step(torch.compile(m, backend=BACKEND, fullgraph=True), X)
    assert m[0].tokens.sum() == 8


def test_compiled_function_inside_an_eager_region_gives_eager_gradients_and_writes():
    """A function compiled by inductor, called inside an eager region, that writes a tensor the
    region made: its fused kernel writes without an op the recorder sees, so it must run eagerly
    there (every op recorded), or replay rebuilds the value from before the write."""

    @torch.compile(backend="inductor")
    def bump(m):
        m.add_(1)

    w = torch.randn(5, requires_grad=True)

    def f(x):
        m = torch.zeros(5)
        bump(m)
        return ((x * m) @ w.diag()).sin().sum()

    x = torch.randn(5, requires_grad=True)
    got = torch.autograd.grad(tracedac.checkpoint(f)(x), (x, w))
    want = torch.autograd.grad(f(x), (x, w))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _counting_backend(runs):
    """A backend that runs dynamo's graph as is and counts the calls of compiled code."""

    def backend(gm, example_inputs):
        def run(*args):
            runs.append(1)
            return gm(*args)

        return run

    return backend


@pytest.mark.parametrize("first_call", ["outside", "inside"])
def test_a_compiled_function_called_in_a_region_stays_compiled_for_later_calls(first_call):
    """Inside an eager region a compiled function runs as plain Python (every op recorded);
    dynamo must not mark its code skipped, or it never runs compiled again. Whether it was
    compiled before the region or is first called inside one."""
    runs = []

    @torch.compile(backend=_counting_backend(runs), fullgraph=True)
    def scaled(t):
        return t * 2 + 1

    w = torch.randn(5, requires_grad=True)
    if first_call == "outside":
        scaled(torch.ones(5))
    before = len(runs)
    x = torch.randn(5, requires_grad=True)
    got = torch.autograd.grad(tracedac.checkpoint(lambda x: (scaled(x) * w).sin().sum())(x), (x, w))
    assert len(runs) == before  # plain Python inside the region
    want = torch.autograd.grad(((x * 2 + 1) * w).sin().sum(), (x, w))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for n in range(1, 3):
        torch.testing.assert_close(scaled(torch.ones(5)), torch.full((5,), 3.0))
        assert len(runs) == before + n  # compiled outside, every later call


def test_a_region_entered_from_a_graph_broken_compiled_frame_gives_eager_gradients():
    """A region dynamo cannot trace whole (a graph break inside) runs its recorder under the
    compiled frame's callback; turning dynamo off there must leave gradients exact."""
    w = torch.randn(5, requires_grad=True)

    def f(x):
        y = (x * w).sin()
        torch._dynamo.graph_break()
        return (y * w).cos().sum()

    region = tracedac.checkpoint(f)
    step = torch.compile(lambda x: region(x) * 2, backend="aot_eager")
    x = torch.randn(5, requires_grad=True)
    for _ in range(2):
        got = torch.autograd.grad(step(x), (x, w))
        want = torch.autograd.grad(f(x) * 2, (x, w))
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.slow
def test_inductor_caches_never_serve_one_policy_the_partition_of_another():
    """Compiler caches hash a graph's code, not ``node.meta``: the region's key must be in the
    code (``tracedac::region``), or a model compiled again after the same code was compiled
    with another policy gets that policy's partition. In a child with fresh caches."""
    code = textwrap.dedent("""
        import torch, torch._dynamo
        from torch._dynamo.utils import counters
        import tracedac
        from tracedac import policies

        class B(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.l = torch.nn.Linear(8, 8)
            def forward(self, x):
                return self.l(x).sin().cos().tanh()

        def saved(policy):
            torch.manual_seed(0)
            c = torch.compile(tracedac.checkpoint(B(), policy=policy), fullgraph=True)
            x, n = torch.randn(4, 8, requires_grad=True), []
            with torch.autograd.graph.saved_tensors_hooks(lambda t: n.append(t.numel()) or t, lambda t: t):
                y = c(x)
            y.sum().backward()
            torch._dynamo.reset()
            return sum(n)

        first = saved(policies.save_all())
        other = saved(policies.recompute_all())
        again = saved(policies.save_all())
        assert counters["aot_autograd"]["autograd_cache_saved"] >= 1  # the cache is in play
        print(first, other, again)
    """)
    with tempfile.TemporaryDirectory() as cache:
        env = {
            **os.environ,
            "PYTHONPATH": os.path.dirname(os.path.dirname(tracedac.__file__)),
            "TORCHINDUCTOR_CACHE_DIR": cache,
        }
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
        )
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, other, again = map(int, proc.stdout.split())
    assert other < first and again == first


def test_fake_tensors_and_make_fx_trace_through_a_region_without_aborting():
    """Run in a child: the failure this guards against aborts the interpreter (SIGABRT)."""
    code = textwrap.dedent("""
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.proxy_tensor import make_fx
        import tracedac

        lin = torch.nn.Linear(4, 4)
        f = tracedac.checkpoint(lambda x: tracedac.name(lin(x).relu(), "h").sum())
        with FakeTensorMode(allow_non_fake_inputs=True):
            y = f(torch.randn(2, 4, requires_grad=True))
            y.backward()
        g = tracedac.checkpoint(lambda x, w: tracedac.name((x @ w).relu(), "h").sum())
        gm = make_fx(g, tracing_mode="fake")(torch.randn(2, 4), torch.randn(4, 4))
        assert any("mm" in str(n.target) for n in gm.graph.nodes)
        m = tracedac.checkpoint(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))
        ep = torch.export.export(m, (torch.randn(2, 4),))
        assert any("linear" in str(n.target) for n in ep.graph.nodes)
        assert not any("tracedac.region" in str(n.target) for n in [*ep.graph.nodes, *gm.graph.nodes])
        print("ok")
    """)
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(tracedac.__file__))}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_save_names_and_print_saved_report_what_the_compiled_graph_saves(capsys):
    x = X.clone().requires_grad_()
    c = torch.compile(model(policies.save_names("hidden")), backend=BACKEND, fullgraph=True)
    report = tracedac.print_saved(c, x)
    labelled = [r for r in report.rows if r.label == "hidden"]
    assert len(labelled) == 3 and all(r.shape == (8, 32) and "MUST_SAVE" in r.why for r in labelled)
    # in block i: torch 2.13 keeps dropout(p=0)'s clone (module "i.drop"), 2.14 on drop it and
    # the label lands on the relu before it (module "i")
    assert [r.module.split(".")[0] for r in labelled] == ["0", "1", "2"]
    assert "hidden" in capsys.readouterr().out
    with pytest.raises(CheckpointError, match="policy=.*compile"):
        tracedac.saved_report(c, x, policy=policies.save_all())


class Named(nn.Module):
    """Labels on a view (``.t()`` of a matmul) and on one result of an op with several
    (``var_mean``): eagerly, ``tracedac.name`` labels the storage's producer; compiled too."""

    def __init__(self, d=16):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d))

    def forward(self, x):  # [B, d]
        h = tracedac.name((x @ self.w).t(), "viewed")  # [d, B]
        var, mean = torch.var_mean(h, dim=0)
        mean = tracedac.name(mean, "mean")  # [B]
        return (h.sin() * var).sum() + mean.exp().sum()


def test_a_label_on_a_view_or_one_of_several_results_is_saved_compiled():
    m = tracedac.checkpoint(Named(), policy=policies.save_names("viewed", "mean"))
    c = torch.compile(m, backend=BACKEND, fullgraph=True)
    rows = tracedac.saved_report(c, X.clone().requires_grad_()).rows
    kept = [(str(r.op), r.label) for r in rows if r.op != "input"]
    # the matmul under the labelled view, and var_mean's labelled result
    assert ("aten.mm.default", "") in kept and ("<built-in function getitem>", "mean") in kept, kept
    assert "MUST_SAVE" in next(r.why for r in rows if str(r.op) == "aten.mm.default")


@pytest.mark.slow
def test_inductor_compiles_the_regions_fullgraph_dynamic_with_equal_gradients(reference, monkeypatch):
    import torch._inductor.config as inductor_config

    import tracedac.compile.passes.tag_regions as tag_regions

    tagged = []  # AOTAutograd's hook and inductor's both get the joint graph: tagged once
    real = tag_regions.tag_regions
    monkeypatch.setattr(tag_regions, "tag_regions", lambda gm: tagged.append(gm) or real(gm))
    m = model(policies.memory_budget(0.5))
    c = torch.compile(m, fullgraph=True, dynamic=True)
    with torch._functorch.config.patch(enable_autograd_cache=False):  # a cache hit runs neither hook
        got = step(c, X)
    for a, b in zip(reference[0], got, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert [blk.calls for blk in m] == [1, 1, 1]
    assert len(tagged) == 1
    passes = inductor_config.joint_custom_pre_pass
    passes = passes if isinstance(passes, (list, tuple)) else [passes]
    assert any(type(p).__name__ == "TagRegions" and p.uuid() for p in passes)  # in inductor's cache key


def test_a_checkpointed_module_still_pickles_and_deep_copies_with_its_forward():
    """checkpoint(module) sets the instance's forward (the compile path's mark); torch.save of
    the whole module and deepcopy must keep working and stay bound to the copy."""
    import copy
    import io

    m = tracedac.checkpoint(Block())
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    clone = copy.deepcopy(m)
    for other in (loaded, clone):
        assert other.forward.args[0] is other
        torch.testing.assert_close(other(X), m(X))


class NormBlock(nn.Module):
    """BatchNorm in training mode: its running statistics are a write its schema does not declare."""

    def __init__(self, d=16):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.bn = nn.BatchNorm1d(d)

    def forward(self, x):  # [B, d]
        return x + self.bn(self.lin(x)).tanh()


@pytest.mark.parametrize("policy", [policies.recompute_all(), policies.memory_budget(0.5)], ids=str)
def test_batch_norm_running_statistics_update_once_compiled(policy):
    """Replaying batch norm in backward must not update its running statistics a second time
    (the issue's first promise, compiled as in eager): buffers and gradients equal the model
    compiled without checkpointing, over two steps."""

    def build(p):
        torch.manual_seed(0)
        m = nn.Sequential(NormBlock(), NormBlock())
        if p is not None:
            tracedac.wrap(m, NormBlock, policy=p)
        return m

    plain, ckpt = build(None), build(policy)
    cplain = torch.compile(plain, backend=BACKEND, fullgraph=True)
    cckpt = torch.compile(ckpt, backend=BACKEND, fullgraph=True)
    for s in range(2):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(s))
        grads_plain, grads_ckpt = step(cplain, x), step(cckpt, x)
        for a, b in zip(grads_plain, grads_ckpt):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
    for (name, a), (_, b) in zip(plain.named_buffers(), ckpt.named_buffers()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=f"buffer {name}")
    assert int(ckpt[0].bn.num_batches_tracked) == 2
    # and the regions did change what is saved: backward replays the normalisation
    assert region_bytes(ckpt, torch.randn(8, 16)) < region_bytes(plain, torch.randn(8, 16))


def test_a_budget_below_what_must_save_names_the_bytes_it_measures_under_compile():
    """MUST_SAVE bytes above a budget: the error names the MUST results, the budget's bytes and
    what they are a fraction of (what the region keeps compiled without checkpointing)."""

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.l2 = nn.Linear(64, 64), nn.Linear(64, 64)

        def forward(self, x):
            h = tracedac.name(torch.relu(self.l1(x)), "a")
            return self.l2(h).sin().cos()

    m = tracedac.checkpoint(
        Two(), policy=policies.either(policies.save_names("a"), policies.memory_budget(0.01))
    )
    c = torch.compile(m, backend=BACKEND, fullgraph=True)
    with pytest.raises(Exception) as err:
        c(torch.randn(32, 64, requires_grad=True)).sum().backward()
    cause = getattr(err.value, "inner_exception", err.value)  # dynamo wraps a backend's error
    assert isinstance(cause, CheckpointError), repr(err.value)
    assert "must keep 8.00 KiB (MUST_SAVE results of aten.relu.default)" in str(cause)
    assert "allows (163 B: 0.01 of the 16.00 KiB kept without checkpointing)" in str(cause)
    assert "PREFER_SAVE" in str(cause)


def test_a_compiled_report_names_every_input_and_module_as_the_model_does():
    """Compiled rows read as eager ones: inputs by parameter or argument name, modules by
    qualified name (not dynamo's ``blocks.0.forward.args[0].up``), shapes as numbers, and the
    generator states dropout's replay needs as what they are."""
    m = model(policies.save_matmuls(), dropout=0.5)
    report = tracedac.saved_report(
        torch.compile(m, backend=BACKEND, fullgraph=True), X.clone().requires_grad_()
    )
    inputs = [r.why.split(":")[0] for r in report.rows if r.kind == "input"]
    assert "argument 0" in inputs and "0.up.weight" in inputs and "2.down.weight" in inputs, inputs
    assert all(r.module is None or (".forward" not in r.module and "[" not in r.module) for r in report.rows)
    assert any(r.module == "0.up" for r in report.rows if r.kind == "activation")
    rng = [r for r in report.rows if r.kind == "rng state"]
    assert len(rng) >= 1 and all(r.dtype == torch.uint8 and isinstance(r.shape[0], int) for r in rng)
    assert report.kept_bytes >= sum(r.bytes for r in rng)
