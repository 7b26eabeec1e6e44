"""Compiled replay (tracedac/replay/compiled.py): a repeated replay runs as one inductor function
and gives op-by-op replay's values, bit for bit under the default exact fusion; what it cannot
guarantee replays op by op. tests/test_compiled_replay_bits.py holds the bits on real models."""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tracedac
from tracedac import policies
from tracedac.replay import compiled as compiled

from .util import OpCounter


@pytest.fixture
def compiling():
    compiled.clear()
    fusion = compiled.fusion()
    before = tracedac.compiled_replay(True, fusion="exact")
    try:
        yield
    finally:
        tracedac.compiled_replay(before, fusion=fusion)
        compiled.clear()


class Block(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))) * 0.5)


def _grads(model, x):
    model.zero_grad()
    model(x).square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_a_repeated_replay_compiles_once_and_matches_op_by_op_replay(compiling):
    torch.manual_seed(0)
    plain = nn.Sequential(Block(), Block())
    model = tracedac.wrap(nn.Sequential(Block(), Block()), Block, policies.recompute_all())
    model.load_state_dict(plain.state_dict())
    x = torch.randn(4, 16)
    expected = _grads(plain, x)
    # step 1: both layers replay the same structure (seen twice: the second layer compiles
    # it); step 2 runs the cached program for both
    for step in range(2):
        got = _grads(model, x)
        for a, b in zip(got, expected, strict=True):
            # exact fusion: gelu and layer norm run ATen's kernels inside the program
            _equal(a, b)
    s = compiled.stats()
    assert s["compiled"] == 1 and s["runs"] == 3 and s["eager"] == 1, s


def test_bf16_replays_compiled_bit_for_bit(compiling):
    torch.manual_seed(0)
    model = tracedac.wrap(nn.Sequential(Block(), Block()).to(torch.bfloat16), Block, policies.recompute_all())
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    tracedac.compiled_replay(False)
    expected = _grads(model, x)  # op-by-op replay
    tracedac.compiled_replay(True)
    for _ in range(2):
        for a, b in zip(_grads(model, x), expected, strict=True):
            _equal(a, b)  # fused ops round to bf16 after each op, as eager's kernels do
    assert compiled.stats()["runs"] == 3


def _equal(a, b):
    assert torch.equal(a, b), (a - b).abs().max()


def _against_uncheckpointed(f, x, params, check, steps=3):
    """``check`` the gradients of ``steps`` checkpointed calls of ``f`` against ``f``'s own
    (computed with compiled replay off: ``f`` may hold a region of its own)."""
    tracedac.compiled_replay(False)
    expected = torch.autograd.grad(f(x), params)
    tracedac.compiled_replay(True)
    for _ in range(steps):
        for a, b in zip(torch.autograd.grad(tracedac.checkpoint(f)(x), params), expected, strict=True):
            check(a, b)


def test_matmuls_and_relu_replay_bitwise(compiling):
    torch.manual_seed(0)
    w1, w2 = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)

    def f(x):
        return (torch.relu(x @ w1) @ w2).relu().sum()

    _against_uncheckpointed(f, x, [w1, w2], _equal)
    assert compiled.stats()["runs"] == 2


def _same_as_plain(f, x, *params, steps=2, seed=0):
    for _ in range(steps):
        torch.manual_seed(seed)
        expected = torch.autograd.grad(f(x), params)
        torch.manual_seed(seed)
        got = torch.autograd.grad(tracedac.checkpoint(f)(x), params)
        for a, b in zip(got, expected, strict=True):
            _equal(a, b)


def test_random_ops_and_writes_replay_op_by_op(compiling):
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)

    def dropout(x):
        h = x @ w
        return (h * torch.bernoulli(h.detach().sigmoid())).exp().sum()

    def written(x):
        h = x @ w
        h.mul_(2.0)  # a write in the replay: versions and borrowed storages stay op by op's
        return h.exp().sum()

    _same_as_plain(dropout, x, w)
    _same_as_plain(written, x, w)
    s = compiled.stats()
    assert s.get("refused:random") == 2 and s.get("refused:writes") == 2, s
    assert "runs" not in s and "compiled" not in s


def test_under_a_dispatch_mode_replay_runs_op_by_op(compiling):
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)

    def f(x):
        return (x @ w).tanh().sum()

    for _ in range(2):
        torch.autograd.grad(tracedac.checkpoint(f)(x), [w])  # the structure repeats
    with OpCounter() as ops:
        torch.autograd.grad(tracedac.checkpoint(f)(x), [w])
    assert ops.counts[torch.ops.aten.tanh] == 2  # the forward's, and op-by-op replay's
    assert compiled.stats()["runs"] == 1


def test_the_switch_is_on_for_cuda_by_default_and_takes_true_false_or_cuda():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    before = tracedac.compiled_replay("cuda")
    try:
        assert compiled.is_enabled(cuda) and not compiled.is_enabled(cpu) and not compiled.is_enabled()
        assert tracedac.compiled_replay(True) == "cuda"
        assert compiled.is_enabled(cpu) and compiled.is_enabled(cuda) and compiled.is_enabled()
        assert tracedac.compiled_replay(False) is True
        assert not compiled.is_enabled(cuda) and tracedac.compiled_replay() is False
        with pytest.raises(ValueError, match=r"True, False or 'cuda'.*got 'on'"):
            tracedac.compiled_replay("on")
        assert tracedac.compiled_replay() is False  # a refused value changes nothing
    finally:
        tracedac.compiled_replay(before)


@pytest.mark.parametrize(
    ("value", "setting"), [("", "cuda"), ("cuda", "cuda"), ("1", True), ("on", True), ("0", False)]
)
def test_the_environment_sets_the_default(monkeypatch, value, setting):
    monkeypatch.setenv("TRACEDAC_COMPILED_REPLAY", value)
    assert compiled._from_environment() == setting


def test_an_unknown_environment_setting_is_refused_saying_what_it_takes(monkeypatch):
    monkeypatch.setenv("TRACEDAC_COMPILED_REPLAY", "sometimes")
    with pytest.raises(ValueError, match=r"TRACEDAC_COMPILED_REPLAY='sometimes'.*use 1.*0.*cuda"):
        compiled._from_environment()


def test_nested_regions_read_the_enclosing_regions_handles(compiling):
    torch.manual_seed(0)
    w1, w2 = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)
    inner = tracedac.checkpoint(lambda h: (h @ w2).tanh())

    def f(x):
        h = (x @ w1).sigmoid()  # the inner region reads it: replayed by the outer region's pass
        return inner(h).sum()

    _against_uncheckpointed(f, x, [w1, w2], _equal)
    # both regions' passes compile on their second backward; the inner one's input is the
    # outer region's handle on h
    assert compiled.stats() == {"eager": 2, "compiled": 2, "runs": 4}


def test_numbers_that_compare_equal_get_their_own_program(compiling):
    # 0.0 == -0.0 (and True == 1): a structure key holding the bare number let the program
    # compiled for 0.0 replay a region called with -0.0, +inf gradients where eager gives -inf
    @tracedac.checkpoint(policy=policies.recompute_all())
    def f(w, x, c):
        return w / (x.mul(c) + x.mul(c))

    x = torch.ones(4)
    for c in [0.0, 0.0, 0.0, -0.0, -0.0, -0.0]:
        w = torch.ones(4, requires_grad=True)
        f(w, x, c).sum().backward()
        assert torch.equal(w.grad, torch.full((4,), math.copysign(math.inf, c)))
    assert compiled.stats()["compiled"] == 2  # one program per sign, each seen twice first


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_by_default_a_repeated_replay_runs_compiled_bit_for_bit():
    compiled.clear()
    fusion = compiled.fusion()
    before = tracedac.compiled_replay("cuda", fusion="exact")  # the defaults
    try:
        torch.manual_seed(0)
        model = nn.Sequential(Block(64), Block(64)).to("cuda", torch.bfloat16)
        tracedac.wrap(model, Block, policies.recompute_all())
        x = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)
        tracedac.compiled_replay(False)
        expected = _grads(model, x)
        tracedac.compiled_replay("cuda")
        for _ in range(2):
            for a, b in zip(_grads(model, x), expected, strict=True):
                _equal(a, b)
        assert compiled.stats()["runs"] == 3
    finally:
        tracedac.compiled_replay(before, fusion=fusion)
        compiled.clear()
