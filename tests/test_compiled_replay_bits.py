"""Replay gives the forward's bits by default, compiled replay included (issue 46): gradients
bitwise equal to no checkpointing on the suite's transformer models, fp32 and bf16, under the
defaults and with compiled replay on (``fusion="exact"``, the default); what exact fusion
refuses; and ``fusion="all"``, the opt-in that is within rounding only."""

import copy
import math

import pytest
import torch
import torch.nn as nn

import tracedac
from tracedac import policies
from tracedac.replay import compiled

from .test_compiled_replay import Block

DTYPES = [torch.float32, torch.bfloat16]
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@pytest.fixture
def defaults():
    """Compiled replay as a fresh process has it (on for CUDA, exact fusion), no programs cached."""
    compiled.clear()
    before, fusion = tracedac.compiled_replay("cuda"), compiled.fusion()
    tracedac.compiled_replay(fusion="exact")
    try:
        yield
    finally:
        tracedac.compiled_replay(before, fusion=fusion)
        compiled.clear()


def assert_bitwise(got, want, what=""):
    """The same bits (``torch.equal`` takes -0.0 for 0.0), NaN payloads aside: which elements
    are NaN must agree (eager's kernels and inductor's may return different NaNs)."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan), f"{what}: NaN where the forward had none (or none where it had)"
    a, b = (t.masked_fill(nan, 0).contiguous().view(_INTS[t.element_size()]) for t in (got, want))
    differ = (a != b).sum().item()
    assert differ == 0, f"{what}: {differ} of {a.numel()} elements differ, by {(got - want).abs().max()}"


def _grads(model, loss_fn):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.autograd.grad(loss_fn(model), params)


def _bitwise_as_reference(model, reference, loss_fn, steps=3):
    """``model``'s gradients, ``steps`` times, against ``reference`` bit for bit: first under the
    defaults, then with compiled replay on for every device (exact fusion). Returns the stats."""
    for i, (a, b) in enumerate(zip(_grads(model, loss_fn), reference, strict=True)):
        assert_bitwise(a, b, f"defaults, gradient {i}")
    tracedac.compiled_replay(True)
    for step in range(steps):  # a structure compiles on its second sight: steps 1 on run compiled
        for i, (a, b) in enumerate(zip(_grads(model, loss_fn), reference, strict=True)):
            assert_bitwise(a, b, f"compiled replay, step {step}, gradient {i}")
    s = compiled.stats()
    assert not any(k.startswith("refused:inexact") for k in s), s
    return s


def _block(dtype, device="cpu"):
    torch.manual_seed(0)
    x = torch.randn(4, 16, dtype=dtype, device=device)
    model = nn.Sequential(Block(), Block()).to(device, dtype)
    return model, Block, lambda m: m(x).float().square().sum()


MODELS = {
    "layer norm and GELU blocks": _block
}  # the benchmarks' Llama and MoE: tests/bench/test_replay_bits_models.py


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("model", list(MODELS))
def test_the_benchmarks_models_get_no_checkpointings_gradients_bit_for_bit(defaults, model, dtype):
    """Users debug by comparing with an unchecked run bit for bit, so replay must give the
    forward's values, compiled or not. Compiled replay with full fusion gave these models'
    fp32 gradients within 1e-6 only (inductor's layer norm, GELU and mean are not eager's);
    the MoE's passes hold nonzero and index_add_, which replay op by op."""
    plain, layer, loss_fn = MODELS[model](dtype)
    reference = _grads(plain, loss_fn)
    wrapped = tracedac.wrap(copy.deepcopy(plain), layer, policies.recompute_all())
    s = _bitwise_as_reference(wrapped, reference, loss_fn)
    if model != "MoE GPT":
        assert s.get("runs", 0) >= 2 * 2, s  # both layers, from the second step on, compiled


def _without_dropout(model):
    """Dropout off (p = 0), so that the layers' replays hold no random op and compile; the
    models train with it on by default, which compiled replay leaves to op-by-op replay."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        for name in ("dropout", "attention_dropout"):  # T5's, Llama's probability floats
            if isinstance(getattr(m, name, None), float):
                setattr(m, name, 0.0)
    return model


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["llama", "gpt2", "bert", "t5", "mixtral", "qwen2_moe"])
def test_hugging_face_models_get_the_gradients_of_their_own_checkpointing_bit_for_bit(defaults, kind, dtype):
    """The tiny models of tests/support/hf_models.py through tracedac.integrations.hf. The
    reference is no checkpointing, except for T5, whose gradients under transformers'
    checkpointing (torch's, as transformers runs it) differ from its unchecked ones by
    rounding already: there the reference is torch's checkpoint. Mixtral's and Qwen2-MoE's
    passes write (index_add_) or make empty tensors, and replay op by op."""
    pytest.importorskip("transformers")
    from tracedac.integrations import hf

    from .support.hf_models import NO_SWITCH, batch, build, loss

    if NO_SWITCH:
        pytest.skip(NO_SWITCH)
    model, inputs = _without_dropout(build(kind).to(dtype)), batch(2, 16)

    def loss_fn(m):
        return loss(m, inputs)

    if kind == "t5":
        model.activation_checkpointing_enable()
    reference = _grads(model, loss_fn)
    if kind == "t5":
        model.activation_checkpointing_disable()
    hf.enable(model)
    s = _bitwise_as_reference(model, reference, loss_fn)
    if kind not in ("mixtral", "qwen2_moe"):
        assert s.get("runs", 0) >= 2, s


def _exact_ops(a, b):  # [n] each
    """Every kind of op exact fusion generates code for, once each, on ``a`` and ``b``."""
    other = torch.float16 if a.dtype != torch.float16 else torch.bfloat16
    m, k = 16, a.numel() // 16
    a2, b2 = a[: m * k].view(k, m), b[: m * k].view(m, k)  # [k, m], [m, k]
    return [
        a + b,
        a - b,
        a * b,
        a * 0.1,  # a number: eager multiplies by it in float, as inductor does
        a + 1e-5,
        a / b,
        -a,
        a.pow(2),
        torch.where(a > b, a, b),  # (the comparison runs eager's kernel)
        a.float(),
        a.to(other),
        torch.cat([a, b]),
        a * b + b,  # no FMA contraction
        (a * 0.3 + b * 0.7) * a,
        a2.t() * b2,  # a transposed view read by a fused kernel: [m, k]
        a2.unsqueeze(0).expand(2, k, m) * 2,
        a[1::2] - b[:-1:2],
        a.clone() * a.view(-1, 1)[:, 0],
    ]


def _special(n, dtype, device, seed):
    """Normal values with zeros of both signs, infinities, NaN, subnormals and near-overflow."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 3
    tiny = torch.finfo(dtype).smallest_normal
    x[:10] = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, tiny / 4, -tiny / 8, 1e-3, -1e4, 6e4])
    return x.to(dtype).to(device)


def _each_exact_op_replays_the_forwards_bits(device, dtype):
    a, b = _special(1031, dtype, device, 0), _special(1031, dtype, device, 1).flip(0)
    ws = [torch.ones(o.shape, dtype=o.dtype, device=device, requires_grad=True) for o in _exact_ops(a, b)]

    def f(a, b):
        # the gradient of each w is the op's value: backward reads it from replay
        return sum((o * w).float().sum() for o, w in zip(_exact_ops(a, b), ws))

    reference = torch.autograd.grad(f(a, b), ws)
    region = tracedac.checkpoint(f, policy=policies.recompute_all())
    tracedac.compiled_replay(True)
    for step in range(3):
        for i, (g, r) in enumerate(zip(torch.autograd.grad(region(a, b), ws), reference, strict=True)):
            assert_bitwise(g, r, f"step {step}, op {i}")
    s = compiled.stats()
    assert s.get("runs", 0) == 2 and not any(k.startswith("refused") for k in s), s


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_each_op_exact_fusion_compiles_gives_eagers_bits_on_special_values(defaults, dtype):
    """The ops exact fusion lets inductor generate code for are exact by an argument about
    kernels (one correctly rounded operation, rounded as eager rounds); this is its check on
    the values where kernels part ways: signed zeros, infinities, NaN, subnormals, a length
    whose tail misses the vector width, strided reads."""
    _each_exact_op_replays_the_forwards_bits(torch.device("cpu"), dtype)


def test_a_program_whose_first_run_differs_from_eagers_is_refused_and_replays_op_by_op(defaults, monkeypatch):
    """The marks are an argument, the first run is its check: a program that differs by one
    ulp anywhere (here: made to) is never used, and the pass, and later ones, replay op by op."""
    real = compiled._compile

    def off_by_one_ulp(gm, inputs, exact, marked):
        fn = real(gm, inputs, exact, marked)

        def run(*args):
            outs = list(fn(*args))
            outs[0] = torch.nextafter(outs[0], torch.full_like(outs[0], math.inf))
            return outs

        return run

    monkeypatch.setattr(compiled, "_compile", off_by_one_ulp)
    plain, layer, loss_fn = _block(torch.float32)
    reference = _grads(plain, loss_fn)
    tracedac.compiled_replay(True)
    wrapped = tracedac.wrap(copy.deepcopy(plain), layer, policies.recompute_all())
    for _ in range(3):
        for a, b in zip(_grads(wrapped, loss_fn), reference, strict=True):
            assert_bitwise(a, b)
    s = compiled.stats()
    # 3 steps of 2 layers: compiled once, on the structure's second sight, refused there
    # (that pass replays op by op too), op by op ever after
    assert s == {"eager": 5, "compiled": 1, "refused:inexact": 1}, s


def test_marking_layer_norm_and_gelu_would_be_inexact_and_is_caught(defaults, monkeypatch):
    """Why the table leaves norms and activations to eager's kernels: inductor's generated
    layer norm (its mean and variance in another order) and GELU (another erf) differ from
    eager's in fp32 on the CPU. Marked anyway, the first-run check refuses the program and
    the gradients stay bitwise."""
    aten = torch.ops.aten
    always = compiled._EXACT[aten.neg.default]
    table = {**compiled._EXACT, aten.native_layer_norm.default: always, aten.gelu.default: always}
    monkeypatch.setattr(compiled, "_EXACT", table)
    plain, layer, loss_fn = _block(torch.float32)
    reference = _grads(plain, loss_fn)
    tracedac.compiled_replay(True)
    wrapped = tracedac.wrap(copy.deepcopy(plain), layer, policies.recompute_all())
    for _ in range(2):
        for a, b in zip(_grads(wrapped, loss_fn), reference, strict=True):
            assert_bitwise(a, b)
    s = compiled.stats()
    assert s.get("refused:inexact") == 1 and "runs" not in s, s


def test_a_torch_without_inductors_lite_mode_replays_op_by_op(defaults, monkeypatch):
    """Exact fusion needs lite mode (torch 2.10 on) to keep eager's kernels; without it no
    program is compiled, and replay stays exact."""
    monkeypatch.setattr(compiled._compat, "inductor_exact_options", lambda: None)
    plain, layer, loss_fn = _block(torch.float32)
    reference = _grads(plain, loss_fn)
    tracedac.compiled_replay(True)
    wrapped = tracedac.wrap(copy.deepcopy(plain), layer, policies.recompute_all())
    for _ in range(2):
        for a, b in zip(_grads(wrapped, loss_fn), reference, strict=True):
            assert_bitwise(a, b)
    # 2 steps of 2 layers: refused on the structure's second sight, op by op everywhere
    assert compiled.stats() == {"eager": 3, "refused:no inductor lite mode in this torch": 1}


def test_full_fusion_is_the_opt_in_within_rounding_with_programs_of_its_own(defaults):
    """fusion="all" lets inductor fuse layer norm and GELU: faster where they dominate, and
    within rounding of eager only. A program compiled under one fusion never serves the other."""
    plain, layer, loss_fn = _block(torch.float32)
    reference = _grads(plain, loss_fn)
    wrapped = tracedac.wrap(copy.deepcopy(plain), layer, policies.recompute_all())
    tracedac.compiled_replay(True, fusion="all")
    for _ in range(2):
        for a, b in zip(_grads(wrapped, loss_fn), reference, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert compiled.stats()["compiled"] == 1
    tracedac.compiled_replay(fusion="exact")
    for _ in range(2):
        for a, b in zip(_grads(wrapped, loss_fn), reference, strict=True):
            assert_bitwise(a, b)
    assert compiled.stats()["compiled"] == 2


def test_the_fusion_setting_takes_exact_or_all_and_says_so(monkeypatch):
    before = compiled.fusion()
    try:
        assert before == "exact"  # the default
        assert tracedac.compiled_replay(fusion="all") == tracedac.compiled_replay()  # returns `enabled`
        assert compiled.fusion() == "all"
        with pytest.raises(ValueError, match=r"fusion takes 'exact'.*or 'all'.*got 'fast'"):
            tracedac.compiled_replay(True, fusion="fast")
        assert compiled.fusion() == "all" and tracedac.compiled_replay() == "cuda"  # nothing changed
    finally:
        tracedac.compiled_replay(fusion=before)
    for value, fusion in (("", "exact"), ("exact", "exact"), ("ALL", "all")):
        monkeypatch.setenv("TRACEDAC_COMPILED_REPLAY_FUSION", value)
        assert compiled._fusion_from_environment() == fusion
    monkeypatch.setenv("TRACEDAC_COMPILED_REPLAY_FUSION", "fast")
    with pytest.raises(ValueError, match=r"TRACEDAC_COMPILED_REPLAY_FUSION='fast'.*use exact.*or all"):
        compiled._fusion_from_environment()


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def deterministic():
    """cuDNN/efficient attention pick non-deterministic backward kernels by default: without
    this, two unchecked runs differ and no comparison with them means anything."""
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("model", ["layer norm and GELU blocks", "Llama"])
def test_on_cuda_by_default_replay_runs_compiled_and_gives_no_checkpointings_bits(
    defaults, deterministic, model, dtype
):
    """On CUDA compiled replay is on by default: there too it must give the forward's bits
    (Triton's code under exact fusion: no FMA contraction, division rounded as eager's,
    subnormals kept). A failure here means exact fusion is not exact on this device: the
    default must then replay op by op on it (docs/design.md, "Compiled replay: bits")."""
    plain, layer, loss_fn = MODELS[model](dtype, "cuda")
    reference = _grads(plain, loss_fn)
    again = _grads(plain, loss_fn)
    for a, b in zip(again, reference, strict=True):
        assert torch.equal(a, b), "two unchecked runs differ: this device's kernels are not reproducible"
    wrapped = tracedac.wrap(copy.deepcopy(plain), layer, policies.recompute_all())
    for _ in range(3):  # the defaults: compiled from the second sight of a structure
        for i, (a, b) in enumerate(zip(_grads(wrapped, loss_fn), reference, strict=True)):
            assert_bitwise(a, b, f"gradient {i}")
    s = compiled.stats()
    assert s.get("runs", 0) >= 4 and not any(k.startswith("refused") for k in s), s


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_on_cuda_each_op_exact_fusion_compiles_gives_eagers_bits_on_special_values(defaults, dtype):
    """The check of the exact table on Triton's code (see the CPU test of the same name)."""
    _each_exact_op_replays_the_forwards_bits(torch.device("cuda"), dtype)
