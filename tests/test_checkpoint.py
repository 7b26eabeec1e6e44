"""The public ways to checkpoint, and the semantics a user relies on."""

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import tracedac
from tracedac import CheckpointError, checkpoint, checkpoint_call, policies, wrap

from .util import OpCounter, assert_same_grads, grads


class Block(nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x):  # [B, T, D]
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=-1)
        q, k, v = (t.view(B, T, self.heads, D // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, D/H]
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Router(nn.Module):
    """Counts tokens per expert in forward: the side effect re-running Python would double."""

    def __init__(self, dim=32, experts=4, top_k=2):
        super().__init__()
        self.gate = nn.Linear(dim, experts, bias=False)
        self.top_k = top_k
        self.register_buffer("tokens_per_expert", torch.zeros(experts, dtype=torch.long))

    def forward(self, x):  # [N, D]
        weights, experts = self.gate(x).softmax(-1).topk(self.top_k, dim=-1)  # [N, k]
        self.tokens_per_expert.add_(
            torch.bincount(experts.flatten(), minlength=self.tokens_per_expert.numel())
        )
        return (x.unsqueeze(1) * weights.unsqueeze(-1)).sum(1)


def block_loss(block, x):
    return block(x).square().mean()


def test_every_decorator_form_checkpoints_and_matches_eager():
    """@checkpoint, @checkpoint(policy=...) and checkpoint(fn, policy=...) are one feature."""

    def f(x, w):
        return F.gelu(x @ w).sin().sum()

    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(16, 16, requires_grad=True)
    forms = [
        checkpoint(f),
        checkpoint(policy=policies.save_matmuls())(f),
        checkpoint(f, policy=policies.recompute_all()),
    ]

    @checkpoint
    def g(x, w):
        return F.gelu(x @ w).sin().sum()

    forms.append(g)
    _, expected = grads(f, (x, w))
    for form in forms:
        out = form(x, w)
        with OpCounter() as ops:
            got = torch.autograd.grad(out, (x, w))
        assert ops.counts[torch.ops.aten.gelu] == 1, "backward replayed the recorded gelu"
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert g.__name__ == "g"


def test_checkpointed_module_is_the_same_module_with_the_same_state_dict():
    """Wrapping must not rename parameters: checkpoints and optimizers keep working."""
    blocks = nn.ModuleList(Block() for _ in range(2))
    keys = list(blocks.state_dict())
    params = [id(p) for p in blocks.parameters()]
    blocks[0] = checkpoint(blocks[0], policy=policies.save_matmuls())
    assert list(blocks.state_dict()) == keys
    assert [id(p) for p in blocks.parameters()] == params
    assert isinstance(blocks[0], Block)
    twin = copy.deepcopy(blocks)
    x = torch.randn(2, 8, 32)
    a, b = blocks[1](blocks[0](x)), twin[1](twin[0](x))
    assert torch.equal(a, b)


def test_checkpointed_module_gives_eager_gradients_bitwise():
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(2, 8, 32, requires_grad=True)
    params = [x, *block.parameters()]
    _, expected = grads(functools.partial(block_loss, block), (x,), wrt=params)
    checkpoint(block)
    out = block_loss(block, x)
    with OpCounter() as ops:
        got = torch.autograd.grad(out, params)
    assert ops.counts[torch.ops.aten.native_layer_norm] == 2, "backward replayed both layer norms"
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


def test_checkpointing_a_module_twice_is_refused():
    block = checkpoint(Block())
    with pytest.raises(CheckpointError, match="already checkpointed"):
        checkpoint(block)


def test_checkpoint_rejects_what_it_cannot_wrap():
    with pytest.raises(TypeError, match="function or an nn.Module"):
        checkpoint(3)
    with pytest.raises(TypeError, match="policy is a callable"):
        checkpoint(lambda x: x, policy="save_matmuls")


def test_checkpoint_call_has_torchs_calling_convention():
    """Libraries pass their checkpoint function torch's arguments; they must just work."""

    def layer(x, scale, *, bias=None):
        return (x * scale + bias).tanh().sum()

    x = torch.randn(4, 4, requires_grad=True)
    bias = torch.randn(4, requires_grad=True)
    expected = torch.autograd.grad(layer(x, 2.0, bias=bias), (x, bias))
    hf_style = functools.partial(checkpoint_call, use_reentrant=False)  # gradient_checkpointing_func
    out = hf_style(layer, x, 2.0, bias=bias, preserve_rng_state=True, determinism_check="default")
    got = torch.autograd.grad(out, (x, bias))
    assert all(torch.equal(a, b) for a, b in zip(got, expected))

    # transformers' layers pass their bound __call__: hooks run once, inside the region
    block, calls = Block(), []
    block.register_forward_pre_hook(lambda m, a: calls.append(1))
    h = torch.randn(2, 8, 32, requires_grad=True)
    expected = torch.autograd.grad(block(h).sum(), h)[0]
    got = torch.autograd.grad(checkpoint_call(block.__call__, h, use_reentrant=False).sum(), h)[0]
    assert torch.equal(got, expected) and calls == [1, 1]  # one eager call, one checkpointed


def test_checkpoint_call_refuses_reentrant_checkpointing_saying_what_to_pass():
    """Reentrant checkpointing re-runs the forward in backward; tracedac records it instead.
    (A ``context_fn`` is taken: test_selective.py, test_context_fn.py.)"""
    x = torch.randn(2, requires_grad=True)
    with pytest.raises(CheckpointError, match="Pass use_reentrant=False"):
        checkpoint_call(torch.sin, x, use_reentrant=True)


def test_wrap_checkpoints_matching_modules_and_not_their_children():
    model = nn.Sequential(Block(), nn.Sequential(Block(), nn.Linear(32, 32)))
    wrap(model, Block)
    assert [n for n, m in model.named_modules() if hasattr(m, "_tracedac")] == ["0", "1.0"]
    model = nn.Sequential(Block(), nn.Linear(32, 32))
    wrap(model, (nn.Linear,))
    assert [n for n, m in model.named_modules() if hasattr(m, "_tracedac")] == [
        "0.qkv",
        "0.proj",
        "0.fc",
        "0.out",
        "1",
    ]
    model = nn.Sequential(Block(), Block())
    wrap(model, lambda name, m: name == "1")
    assert [n for n, m in model.named_modules() if hasattr(m, "_tracedac")] == ["1"]


def test_wrap_says_when_nothing_matched_and_rejects_bad_matchers():
    with pytest.raises(ValueError, match="matched no module.*Block"):
        wrap(nn.Sequential(Block()), nn.Conv2d)
    with pytest.raises(TypeError, match="nn.Module class"):
        wrap(nn.Sequential(Block()), "Block")
    with pytest.raises(TypeError, match="nn.Module classes"):
        wrap(nn.Sequential(Block()), (Block, int))


def test_python_in_a_region_runs_once_while_torch_checkpoint_runs_it_twice():
    """The reason tracedac exists: hooks, counters and buffer updates happen once."""
    torch.manual_seed(0)
    x = torch.randn(16, 32, requires_grad=True)
    router = Router()
    calls = []
    router.register_forward_pre_hook(lambda m, a: calls.append("pre"))
    router.register_forward_hook(lambda m, a, o: calls.append("post"))
    torch_checkpoint(router, x, use_reentrant=False).sum().backward()
    assert router.tokens_per_expert.sum().item() == 2 * 16 * 2 and calls.count("pre") == 2

    router.tokens_per_expert.zero_()
    calls.clear()
    expected = torch.autograd.grad(router(x).sum(), (x, router.gate.weight))
    router.tokens_per_expert.zero_()
    calls.clear()
    checkpoint(router)
    got = torch.autograd.grad(router(x).sum(), (x, router.gate.weight))
    assert router.tokens_per_expert.sum().item() == 16 * 2, "tokens counted once"
    assert calls == ["pre", "post"], "hooks fired once"
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_random_ops_replay_the_same_numbers_and_leave_the_generator_where_eager_does():
    def f(x):
        h = F.dropout(x, 0.5, training=True) + torch.rand_like(x) + torch.randn(x.shape)
        mask = torch.empty_like(x).bernoulli_(0.3)
        return (h * mask * torch.randperm(x.shape[-1]).float()).exp().sum()

    x = torch.randn(8, 16, requires_grad=True)
    out0, g0 = grads(f, (x,), seed=3)
    after_eager = torch.get_rng_state()
    torch.manual_seed(3)
    out1 = checkpoint(f)(x)
    (g1,) = torch.autograd.grad(out1, (x,))
    assert torch.equal(out0, out1) and torch.equal(g0[0], g1)
    assert torch.equal(torch.get_rng_state(), after_eager)


def test_random_ops_with_an_explicit_generator_replay_from_that_generator():
    gen = torch.Generator().manual_seed(5)

    def f(x):
        return (x * torch.rand(x.shape, generator=gen)).exp().sum()

    x = torch.randn(6, requires_grad=True)
    (g0,) = torch.autograd.grad(f(x), (x,))
    state = gen.get_state()
    gen.manual_seed(5)
    (g1,) = torch.autograd.grad(checkpoint(f)(x), (x,))
    assert torch.equal(g0, g1) and torch.equal(gen.get_state(), state)


class EMA(nn.Module):
    def __init__(self, copy_before_use=False):
        super().__init__()
        self.copy_before_use = copy_before_use
        self.register_buffer("avg", torch.ones(8))

    def forward(self, x):
        avg = self.avg.clone() if self.copy_before_use else self.avg
        y = (x * avg).sin()  # autograd saves avg as it is now...
        with torch.no_grad():
            self.avg.mul_(0.5).add_(x.detach().mean(0))  # ...and then it changes
        return (y * self.avg.clone()).sum()


def test_a_buffer_autograd_saved_and_then_updated_in_forward_is_met_from_a_copy():
    """Eager refuses this program; the region keeps the value from before the write."""
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        EMA()(x).backward()
    eager = EMA(copy_before_use=True)  # the same values, written so eager accepts it
    (expected,) = torch.autograd.grad(eager(x), (x,))
    ck = checkpoint(EMA())
    (got,) = torch.autograd.grad(ck(x), (x,))
    assert torch.equal(got, expected) and torch.equal(ck.avg, eager.avg), "updated once"


def test_a_tensor_changed_between_forward_and_backward_is_refused_by_name():
    """torch's checkpoint silently replays with the new value: every gradient is wrong."""

    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("expert_bias", torch.zeros(4))
            self.w = nn.Parameter(torch.randn(8, 4))

        def forward(self, x):
            return ((x @ self.w + self.expert_bias).softmax(-1) ** 2).sum()

    gate = checkpoint(Gate())
    loss = gate(torch.randn(3, 8))
    gate.expert_bias.add_(1.0)  # e.g. aux-loss-free balancing, between forward and backward
    with pytest.raises(CheckpointError, match="buffer 'expert_bias'.*modified in place after the forward"):
        loss.backward()


def test_a_storage_swapped_in_after_forward_is_refused_and_writes_through_data_are_not_seen():
    """``p.data = other`` keeps ``p``'s version counter but gives it another storage: gradients
    were silently computed from the new value (torch's checkpoint too). Refused by name now.
    A write through ``.data`` (or a ``.numpy()`` view) moves no version counter and keeps the
    storage: nothing cheap can see it, and the README says so; this test pins that down."""

    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("expert_bias", torch.zeros(4))

        def forward(self, x):
            return (torch.tanh(x + self.expert_bias) ** 2).sum()

    x = torch.randn(3, 4, requires_grad=True)
    gate = checkpoint(Gate())
    loss = gate(x)
    gate.expert_bias.data = torch.ones(4)
    with pytest.raises(CheckpointError, match="buffer 'expert_bias'.*given another storage.*data assigned"):
        loss.backward()
    gate = checkpoint(Gate())
    loss = gate(x)
    gate.expert_bias.data.add_(1.0)  # not seen: the gradient is from the new value
    (got,) = torch.autograd.grad(loss, x)
    (expected,) = torch.autograd.grad((torch.tanh(x + torch.ones(4)) ** 2).sum(), x)
    assert torch.allclose(got, expected)


@pytest.mark.parametrize("warm", [False, True], ids=["recorded", "warm"])
def test_a_storage_swapped_in_inside_the_region_between_two_reads_is_refused(warm):
    """``w.data = other`` between two reads of ``w`` inside the region (a module hook that
    swaps a parameter's storage, as DeepSpeed's ZeRO-3 gathers do): replay of the first read
    once took the new storage, silently (the address was taken at the region's end); now the
    storage each outside tensor had when the region first read it is what replay checks, on a
    recorded call and on a warm one (the swap is no op: the template cannot see it), and the
    region's end, which plans replay, refuses it."""
    from tracedac.record import warm as warm_path

    def f(x, w, other):
        y = (x @ w).tanh()
        if other is not None:
            w.data = other
        return (y @ w).tanh()

    region = checkpoint(f)
    x = torch.randn(4, 4, requires_grad=True)
    before = warm_path.stats()["warm"]
    previous = warm_path.enable(warm)
    try:
        for _ in range(2):  # the first call records; with the warm path the second runs warm
            w = nn.Parameter(torch.randn(4, 4))
            region(x, w, None).sum().backward()
        w = nn.Parameter(torch.randn(4, 4))
        # refused where the region ends: its replay plan is made there, and needs the first read
        with pytest.raises(
            CheckpointError, match="argument 1 .*given another storage after the forward read it"
        ):
            region(x, w, torch.randn(4, 4))
    finally:
        warm_path.enable(previous)
    assert (warm_path.stats()["warm"] > before) == warm


def test_an_input_autograd_saved_and_changed_after_forward_is_refused():
    x = torch.randn(4, 4)
    w = torch.randn(4, 4, requires_grad=True)
    loss = checkpoint(lambda x, w: (x @ w).sum())(x, w)
    x.mul_(2)
    with pytest.raises(CheckpointError, match="argument 0 of shape \\[4, 4\\].*modified in place"):
        loss.backward()


def test_a_kept_result_changed_later_in_the_region_is_rebuilt_from_the_graph():
    """Eager refuses this (a saved tensor modified in place); replay answers it exactly."""

    def f(x):
        e = x.exp()  # kept by the policy and saved by exp's backward...
        with torch.no_grad():
            e.mul_(3)  # ...then modified, still inside the region
        return (e * x).sum()

    x = torch.randn(4, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        f(x).backward()
    out = checkpoint(f, policy=policies.save_ops(torch.ops.aten.exp))(x)
    (g,) = torch.autograd.grad(out, x)
    # mul's backward reads e after the write (3 e^x); exp's reads its result as saved (e^x)
    e = x.detach().exp()
    torch.testing.assert_close(g, 3 * e + x.detach() * e, rtol=1e-6, atol=1e-6)


def test_a_kept_output_changed_after_forward_that_cannot_be_rebuilt_is_refused():
    x = torch.randn(4, 4, requires_grad=True)
    y = checkpoint(lambda x: x.exp(), policy=policies.save_all())(x)
    with torch.no_grad():
        y.mul_(3)
    with pytest.raises(
        CheckpointError, match="aten.exp.default .*kept for backward, was modified in place after the forward"
    ):
        y.backward(torch.ones_like(y))


def test_nested_checkpoints_match_eager_and_run_python_once():
    calls = []

    def inner(h):
        calls.append("inner")
        return F.gelu(h).sin()

    def outer(x, w):
        calls.append("outer")
        h = x @ w
        return (checkpoint(inner)(h) * h).sum()

    x = torch.randn(8, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    _, expected = grads(outer, (x, w))
    calls.clear()
    for policy in (policies.recompute_all(), policies.save_matmuls()):
        out = checkpoint(outer, policy=policy)(x, w)
        got = torch.autograd.grad(out, (x, w))
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert calls == ["outer", "inner"] * 2


def test_retain_graph_allows_a_second_backward_and_without_it_raises_like_eager():
    block = checkpoint(Block())
    x = torch.randn(2, 8, 32, requires_grad=True)
    loss = block_loss(block, x)
    (g1,) = torch.autograd.grad(loss, (x,), retain_graph=True)
    (g2,) = torch.autograd.grad(loss, (x,))
    assert torch.equal(g1, g2)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        torch.autograd.grad(loss, (x,))


def test_autograd_grad_with_inputs_and_inputs_of_which_only_some_require_grad():
    def f(x, y, z):
        return (x @ y).relu().mul(z).sum()

    x = torch.randn(4, 4, requires_grad=True)
    y = torch.randn(4, 4)  # no grad
    z = torch.randn(4, requires_grad=True)
    out0 = f(x, y, z)
    out0.backward(inputs=[z])
    expected = z.grad.clone()
    z.grad = None
    checkpoint(f)(x, y, z).backward(inputs=[z])
    assert torch.equal(z.grad, expected) and x.grad is None


def test_under_no_grad_a_region_just_runs():
    calls = []

    @checkpoint
    def f(x):
        calls.append(1)
        return x.sin()

    x = torch.randn(3, requires_grad=True)
    with torch.no_grad():
        y = f(x)
    assert torch.equal(y, x.sin()) and calls == [1] and y.grad_fn is None
    assert torch._C._len_torch_dispatch_stack() == 0


def test_non_tensor_none_keyword_and_nested_container_arguments_and_outputs():
    def f(x, scale, maybe=None, *, mode="sum", extra=None):
        h = (x * scale).sin()
        return {
            "loss": h.sum() if mode == "sum" else h.mean(),
            "parts": [h, None, (x.cos(), 3)],
            "tag": mode,
            "extra": extra,
        }

    x = torch.randn(5, requires_grad=True)
    ref = f(x, 2.0, None, mode="mean")
    out = checkpoint(f)(x, 2.0, None, mode="mean")
    assert (
        out["tag"] == "mean" and out["extra"] is None and out["parts"][1] is None and out["parts"][2][1] == 3
    )

    def total(o):
        return o["loss"] + o["parts"][0].sum() + o["parts"][2][0].sum()

    assert torch.equal(torch.autograd.grad(total(ref), x)[0], torch.autograd.grad(total(out), x)[0])


def test_autocast_inside_a_region_matches_eager_autocast():
    block = Block()
    x = torch.randn(2, 8, 32, requires_grad=True)

    def f(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return block(x).float().square().mean()

    assert_same_grads(f, (x,), wrt=[x, *block.parameters()])


def test_custom_autograd_functions_and_library_ops_replay():
    class Cube(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x**3

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 3 * x**2 * g

    @torch.library.custom_op("tracedac_test::scaled_sin", mutates_args=())
    def scaled_sin(x: torch.Tensor, s: float) -> torch.Tensor:
        return torch.sin(x) * s

    @scaled_sin.register_fake
    def _(x, s):
        return torch.empty_like(x)

    def setup(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.s = inputs[1]

    scaled_sin.register_autograd(
        lambda ctx, g: (g * torch.cos(ctx.saved_tensors[0]) * ctx.s, None), setup_context=setup
    )

    def f(x):
        h = Cube.apply(x.exp())
        return scaled_sin(h.tanh(), 2.0).sum()

    x = torch.randn(6, requires_grad=True)
    out = checkpoint(f)(x)
    with OpCounter() as ops:
        (g,) = torch.autograd.grad(out, (x,))
    assert ops.counts[torch.ops.tracedac_test.scaled_sin] == 0, "its output is not needed by backward"
    assert ops.counts[torch.ops.aten.tanh] == 1
    assert torch.equal(g, torch.autograd.grad(f(x), (x,))[0])


def test_a_second_order_gradient_through_a_region_keeps_eagers_history():
    """A rebuilt tensor gets the history autograd noted when it was saved (as torch's own
    checkpoint's recomputed tensors do): a gradient of a gradient reaches the forward graph."""
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    for f in (lambda x: x.exp().sum(), lambda x: x.sin().sum()):  # saves its result / its input
        (g,) = torch.autograd.grad(checkpoint(f)(x), x, create_graph=True)
        (expected,) = torch.autograd.grad(f(x), x, create_graph=True)
        assert torch.equal(torch.autograd.grad(g.sum(), x)[0], torch.autograd.grad(expected.sum(), x)[0])


def test_name_returns_its_tensor_and_checks_its_arguments():
    x = torch.randn(3)
    assert tracedac.name(x, "anything") is x  # outside a region: nothing to label
    with pytest.raises(TypeError, match="non-empty string"):
        tracedac.name(x, "")
    with pytest.raises(TypeError, match="labels a tensor"):
        tracedac.name(3, "x")


def test_an_exception_in_a_region_leaves_no_mode_or_hooks_behind():
    @checkpoint
    def f(x):
        x.sin()
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        f(torch.randn(2, requires_grad=True))
    module = checkpoint(nn.Linear(2, 2))
    module.register_forward_pre_hook(lambda m, a: (_ for _ in ()).throw(KeyError("pre")))
    with pytest.raises(KeyError):
        module(torch.randn(2))
    assert torch._C._len_torch_dispatch_stack() == 0
    assert not torch.nn.modules.module._global_forward_pre_hooks
    y = torch.randn(2, requires_grad=True).exp()
    assert y.grad_fn._saved_result is not None  # autograd saves plainly again: no hooks left


def test_a_new_partial_of_the_same_layer_each_call_finds_the_plan_made_for_its_class():
    """Hugging Face's layers call the checkpoint function with a new
    ``partial(forward, layer, **kwargs)`` each step: the plan is looked up through it (the
    function's code, the module's class, the inputs), not by the partial object, so two
    layers of one class plan once and the cache does not grow (it held every partial, and
    every tensor in it, before)."""
    from tracedac.policies.plan_cache import plans

    torch.manual_seed(0)
    layers = [Block(), Block()]
    policy = policies.memory_budget(0.5)
    made, entries = plans.made, len(plans.entries)
    for _ in range(3):
        for layer in layers:
            x = torch.randn(2, 8, 32, requires_grad=True)
            mask = torch.rand(32)
            out = checkpoint_call(
                functools.partial(lambda self, h, mask: Block.forward(self, h) * mask, layer, mask=mask),
                x,
                policy=policy,
            )
            expected = torch.autograd.grad((layer(x) * mask).sum(), (x, *layer.parameters()))
            got = torch.autograd.grad(out.sum(), (x, *layer.parameters()))
            assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert plans.made == made + 1
    assert len(plans.entries) <= entries + 1


def test_layers_of_one_class_differing_in_frozen_weights_keep_a_plan_each():
    """What a plan keeps depends on what autograd saves, and a frozen weight changes that
    without changing the ops: the key tells the two layers apart, so neither replaces the
    other's plan on every call."""
    from tracedac.policies.plan_cache import plans

    torch.manual_seed(0)
    frozen, trained = Block(), Block()
    frozen.requires_grad_(False)
    model = nn.Sequential(frozen, trained)
    wrap(model, Block, policy=policies.memory_budget(0.4))
    made = plans.made
    for _ in range(3):
        x = torch.randn(2, 8, 32, requires_grad=True)
        model(x).sum().backward()
    assert plans.made == made + 2


def test_a_cached_plan_is_not_applied_where_autograd_saved_something_else():
    """Equal ops, equal inputs, one key, but a frozen weight the region closes over: ``h @ w``
    saves ``h`` only if ``w`` requires grad. The plan made for a trainable ``w`` keeps
    ``exp``'s result (within 0.6 of ``h`` and it), which is over 0.6 of what the frozen call
    saves: the region checks what autograd saved against what the plan was made for, and
    plans again (measured at the allocator)."""
    from tracedac.policies.plan_cache import plans
    from tracedac.region import current_region

    from .support.probe import allocated_bytes

    regions = []
    w = torch.randn(256, 256) / 16

    def f(x):
        regions.append(current_region())
        return (x.sin() @ w).exp().sum()

    g = checkpoint(f, policy=policies.memory_budget(0.6))
    x = torch.randn(256, 256, requires_grad=True)
    w.requires_grad_(True)
    g(x).backward()
    made = plans.made
    w.requires_grad_(False)
    before = allocated_bytes()
    out = g(x)
    held = allocated_bytes() - before
    assert plans.made == made + 1 and regions[-1].planning.planned_now
    assert held < 0.6 * 256 * 1024, f"{held} bytes held: the trainable call's plan was applied"
    x.grad = None
    out.backward()
    assert torch.equal(x.grad, torch.autograd.grad(f(x), x)[0])


def test_checkpoint_call_names_the_region_for_the_module_it_runs():
    from tracedac.record.naming import register_name, unregister_name
    from tracedac.region import reporting

    layer, x = Block(), torch.randn(2, 8, 32, requires_grad=True)
    with reporting() as regions:
        checkpoint_call(functools.partial(Block.forward, layer), x)
        checkpoint_call(layer.__call__, x)
        register_name(layer, "model.layers.3")
        checkpoint_call(functools.partial(Block.forward, layer), x)
    unregister_name(layer)
    assert [r.graph.name for r in regions] == ["Block", "Block", "model.layers.3"]
    assert any(n.module_path == "model.layers.3.qkv" for n in regions[-1].graph.nodes)


def test_unwrap_removes_every_hook_and_leaves_state_dict_keys_and_a_plain_forward():
    from tracedac.region import reporting

    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    keys = list(model.state_dict())
    x = torch.randn(2, 8, 32)
    expected = model(x)
    wrap(model, Block, policy=policies.save_matmuls())
    checkpoint(model[1].fc)  # inside a wrapped block: unwrap finds it too
    assert tracedac.unwrap(model) is model
    assert not any(
        m._forward_pre_hooks or m._forward_hooks or hasattr(m, "_tracedac") for m in model.modules()
    )
    assert list(model.state_dict()) == keys
    with reporting() as regions:
        assert torch.equal(model(x), expected)
    assert regions == []
    wrap(model, Block)  # and it can be checkpointed again

    def f(x):
        return x.sin()

    assert tracedac.unwrap(checkpoint(f)) is f


def test_checkpointing_a_class_is_a_type_error_that_names_the_instance_and_wrap_ways():
    """``tracedac.checkpoint(Block)`` used to return a checkpointed *constructor* and
    checkpoint nothing that ran: the user saw no error and 'kept 0 B' in every report."""
    with pytest.raises(TypeError, match=r"class Linear.*tracedac.wrap\(model, Linear\)"):
        checkpoint(torch.nn.Linear)
    with pytest.raises(TypeError, match="class Linear"):
        checkpoint(policy=policies.save_all())(torch.nn.Linear)


def test_is_checkpointed_says_whether_a_module_or_function_runs_regions():
    """The public check a user runs after setting tracedac up, and after ``unwrap``."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 2)))
    assert not tracedac.is_checkpointed(model)
    tracedac.wrap(model, lambda name, m: name == "1")
    assert tracedac.is_checkpointed(model) and tracedac.is_checkpointed(model[1])
    assert not tracedac.is_checkpointed(model[0])
    tracedac.unwrap(model)
    assert not tracedac.is_checkpointed(model)

    def f(x):
        return x.sin()

    assert tracedac.is_checkpointed(checkpoint(f)) and not tracedac.is_checkpointed(f)
    assert not tracedac.is_checkpointed(tracedac.unwrap(checkpoint(f)))
