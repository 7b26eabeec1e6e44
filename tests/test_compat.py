"""What differs between the torch releases tracedac supports (tracedac/_compat.py): each
difference met on torch 2.11 (the suite run there by hand, docs/design.md "Supported torch"),
checked here on the torch CI runs (tracedac.zero's own, ``compiles_zero``: tests/zero/test_shard.py)."""

from types import SimpleNamespace

import pytest
import torch
from torch.utils.flop_counter import sdpa_flop_count

from tracedac import _compat
from tracedac.graph import op_flops


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
