"""What differs between the torch releases tracedac supports (tracedac/_compat.py): each
difference met on torch 2.11 (the suite run there by hand, docs/design.md "Supported torch"),
checked here on the torch CI runs."""

from types import SimpleNamespace

import pytest
import torch
from torch.utils.flop_counter import sdpa_flop_count

from tracedac import _compat
from tracedac.record.graph import op_flops


@pytest.mark.parametrize("heads, kv_heads", [(8, 8), (8, 2), (4, 1)])
def test_cpu_attention_flops_match_torchs_formula_grouped_query_attention_included(heads, kv_heads):
    """torch has no formula for the CPU flash kernel; tracedac counts it as torch's
    ``sdpa_flop_count`` counts the same attention with key/value heads repeated to the query's
    (what grouped-query attention computes; torch 2.11's formula refuses fewer key/value heads)."""
    q, k, v = (2, heads, 16, 32), (2, kv_heads, 24, 32), (2, kv_heads, 24, 32)
    args = tuple(SimpleNamespace(shape=s) for s in (q, k, v))
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    repeated = (2, heads, 24, 32)
    assert op_flops(op, args, {}, ()) == sdpa_flop_count(q, repeated, repeated) > 0


def test_a_symbolic_size_hint_is_read_on_this_torch():
    assert _compat.optimization_hint(7) == 7


def test_is_exporting_is_false_under_torch_compile_and_true_under_export():
    """torch 2.11's dynamo answers ``torch.compiler.is_exporting()`` True under torch.compile."""
    seen = []

    def f(x):
        seen.append(_compat.is_exporting())
        return x + 1

    torch.compile(f, backend="eager", fullgraph=True)(torch.ones(2))

    class M(torch.nn.Module):
        def forward(self, x):
            return f(x)

    torch.export.export(M(), (torch.ones(2),))
    assert seen == [False, True]


@pytest.mark.parametrize(
    "version",
    [
        pytest.param((2, 11), id="torch 2.11's way"),
        pytest.param(
            (2, 13),
            id="torch 2.13's way",
            marks=pytest.mark.skipif(
                _compat._VERSION < (2, 13),
                reason="dynamo before 2.13 cannot trace it: the other way's reason",
            ),
        ),
    ],
)
def test_a_compiled_sharded_step_puts_the_parameters_back_either_way_and_trains_as_eager(
    world1, monkeypatch, version
):
    """``put_back_parameter``, both ways, under this torch's dynamo (2.11's dynamo itself is met
    where the suite runs on 2.11: every compiled ``tracedac.zero`` test): the compiled step's
    loss and gradients are those of the unsharded model compiled the same way, bit for bit, and
    eager's within the decompositions' rounding; afterwards each sharded attribute reads its
    registered parameter again (2.11's way leaves it in the instance ``__dict__``, 2.13's
    removes it)."""
    import torch._dynamo
    import torch.nn.functional as F

    import tracedac.zero as zero

    from .support import zero_model as w

    monkeypatch.setattr(_compat, "_VERSION", version)
    ref = zero.shard(w.model(tie=False))
    m = zero.shard(w.model(tie=False))
    x, y = w.data(0)
    got = _compiled_step(m, x, y)
    want = F.mse_loss(ref(x), y)
    want.backward()
    # The backend decomposes layer_norm and gelu, whose rounding is not ATen's vectorized CPU
    # kernels' (the unsharded model compiled so differs from eager by ~2 ulp too, on 2.11 and
    # 2.13, with AVX2 or AVX512): within rounding of eager, and bit for bit the unsharded
    # model compiled the same way.
    torch.testing.assert_close(got, want)
    plain = w.model(tie=False)
    assert torch.equal(got, _compiled_step(plain, x, y))
    for (name, p), q in zip(m.named_parameters(), plain.parameters(), strict=True):
        assert (p.grad is None) is (q.grad is None), name
        if p.grad is not None:
            assert torch.equal(p.grad.full_tensor(), q.grad), name
    for (name, p), q in zip(m.named_parameters(), ref.parameters(), strict=True):
        if q.grad is None:
            assert p.grad is None and not q.requires_grad, name
            continue
        torch.testing.assert_close(p.grad.full_tensor(), q.grad.full_tensor(), msg=name)  # decomposed
    linear = m.blocks[0].lin1
    assert linear.weight is linear._parameters["weight"]
    assert ("weight" in vars(linear)) is (version < (2, 13))


def test_a_prepended_pre_hook_is_first_in_the_hooks_dict_by_either_order():
    """dynamo 2.11 guards on a hook by its place in the plain dict's order, which
    ``register_forward_pre_hook(prepend=True)`` leaves unchanged (it reorders the OrderedDict
    only): a guard meant for the hook after tracedac's read tracedac's."""
    m = torch.nn.Linear(2, 2)
    first = m.register_forward_pre_hook(lambda mod, args: None)
    ours = _compat.prepend_forward_pre_hook(m, lambda mod, args: None)
    hooks = m._forward_pre_hooks
    assert list(hooks) == list(dict.keys(hooks)) == [ours.id, first.id]
    plain = torch.nn.Linear(2, 2)
    plain.register_forward_pre_hook(lambda mod, args: None)
    plain.register_forward_pre_hook(lambda mod, args: None, prepend=True)
    torchs = plain._forward_pre_hooks
    assert list(torchs) == list(reversed(dict.keys(torchs)))  # what the helper is for


def _compiled_step(model, x, y):
    """The model's MSE loss compiled whole (``aot_eager_decomp_partition``), backward run."""
    import torch._dynamo
    import torch.nn.functional as F

    torch._dynamo.reset()
    try:
        loss = F.mse_loss(torch.compile(model, fullgraph=True, backend="aot_eager_decomp_partition")(x), y)
        loss.backward()
    finally:
        torch._dynamo.reset()
    return loss


def test_a_symbolic_size_reads_its_hint_without_a_deprecation_warning():
    """The planners read a compiled graph's symbolic sizes at their hints. On torch 2.11 the
    name that did so (``hint_int``) warned on every call, once per compile of a region."""
    import warnings

    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    size = env.create_symintnode(env.create_symbol(7, ConstantSource("rows")), hint=7)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _compat.optimization_hint(size, fallback=4096) == 7
        assert _compat.optimization_hint(3, fallback=4096) == 3
