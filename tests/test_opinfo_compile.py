"""torch's OpInfo database as an oracle for the compile path: ops whose graphs exercise the
joint-graph pass (views and multi-output ops, in-place writes, masks and padding, indexing
and scatters, reductions, normalizations, matmuls, random ops) inside a region,
compiled fullgraph, against the same function compiled without the region.

Each op's first float64 CPU sample runs as a region under ``recompute_all`` and
``memory_budget(0.3)`` (the planner's path), as the op and as its in-place variant where one
exists; outputs, gradients and final argument values must equal the uncheckpointed
compiled function's within float64 rounding (the replayed forward is the same decomposed
ops; ``aot_eager_decomp_partition`` runs them eagerly). A sample the uncheckpointed
function cannot compile fullgraph is not a case; the test fails if an op has none. What
this checks is values and that every tag the pass writes is one the partitioner can carry
out (never an error, never a wrong value); what each policy saves is tests/test_compile.py's.
"""

from __future__ import annotations

import pytest
import torch

from tracedac import policies

from .test_opinfo import _Case, _same, _samples
from .test_opinfo import _execute as _run

pytestmark = pytest.mark.slow  # the quick loop (pytest -m "not slow") leaves this file out

common_methods_invocations = pytest.importorskip("torch.testing._internal.common_methods_invocations")

BACKEND = "aot_eager_decomp_partition"
POLICIES = [policies.recompute_all(), policies.memory_budget(0.3)]
NAMES = (
    # views and multi-output ops
    "split",
    "unbind",
    "chunk",
    "narrow",
    "diagonal",
    "transpose",
    "expand",
    "as_strided",
    "topk",
    "sort",
    "max.reduction_with_dim",
    "var_mean",
    "nn.functional.layer_norm",
    "nn.functional.group_norm",
    # in-place writes, indexing, scatters
    "index_add",
    "index_put",
    "scatter",
    "scatter_add",
    "index_select",
    "gather",
    "masked_fill",
    "put",
    "cumsum",
    "nn.functional.embedding",
    # a tensor's shape only, masks
    "tril",
    "triu",
    "where",
    "nn.functional.pad.constant",
    # matmuls and friends
    "mm",
    "bmm",
    "addmm",
    "baddbmm",
    "matmul",
    "einsum",
    "nn.functional.linear",
    "nn.functional.conv2d",
    "nn.functional.scaled_dot_product_attention",
    # pointwise and reductions the partitioner replays or saves
    "sigmoid",
    "nn.functional.gelu",
    "softmax",
    "log_softmax",
    "logsumexp",
    "norm",
    "amax",
    "prod",
    "nn.functional.batch_norm",
    "nn.functional.cross_entropy",
    # random
    "nn.functional.dropout",
    "bernoulli",
)


def _op(name):
    for op in common_methods_invocations.op_db:
        if (f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name) == name:
            return op
    raise LookupError(f"no OpInfo named {name!r}")


# OpInfo runs these through ``wrapper_set_seed``, which seeds inside the function (a graph
# break); the ops themselves, seeded outside the compiled function (``_execute``).
UNWRAPPED = {
    "nn.functional.dropout": torch.nn.functional.dropout,
    "bernoulli": torch.bernoulli,
    "nn.functional.scaled_dot_product_attention": torch.nn.functional.scaled_dot_product_attention,
}


def _function(case: _Case):
    raw = UNWRAPPED.get(case.op.name)
    if raw is None or case.inplace:
        return case.function()
    sample, spec = case.sample, case.spec

    def run(*flat):
        x, args, kwargs = torch.utils._pytree.tree_unflatten(list(flat), spec)
        return sample.output_process_fn_grad(raw(x, *args, **kwargs))

    return run


def _execute(case: _Case, policy):
    """test_opinfo's run of ``case``, compiled fullgraph; ``policy`` None: no region."""
    return _run(
        case,
        policy,
        _function(case),
        lambda f: torch.compile(f, backend=BACKEND, fullgraph=True, dynamic=False),
    )


@pytest.mark.parametrize("name", NAMES)
def test_opinfo_op_compiled_in_a_region_matches_the_op_compiled_without_one(name):
    op = _op(name)
    checked, problems = 0, []
    for sample in _samples(op):
        for inplace in (False, True) if op.get_inplace() is not None else (False,):
            case = _Case(op, sample, inplace)
            torch._dynamo.reset()
            try:
                expected = _execute(case, None)
            except Exception:
                continue  # not fullgraph without a region either (or eager refuses the in-place form)
            for policy in POLICIES:
                torch._dynamo.reset()
                checked += 1
                variant = f"{name}{'_ (in place)' if inplace else ''} under {policy}"
                try:
                    got = _execute(case, policy)
                except Exception as e:
                    problems.append(
                        f"{variant}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                    )
                    continue
                for what, a, b in zip(("outputs", "gradients", "final arguments"), expected, got):
                    if len(a) != len(b) or not all(_same(x, y, bitwise=False) for x, y in zip(a, b)):
                        problems.append(f"{variant}: wrong {what}")
    torch._dynamo.reset()
    assert checked, f"{name}: no sample compiles fullgraph without a region"
    assert not problems, "\n".join(problems)
