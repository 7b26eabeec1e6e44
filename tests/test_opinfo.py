"""torch's OpInfo database as an oracle: every differentiable op, float64, CPU.

For each op of ``torch.testing._internal.common_methods_invocations.op_db`` with backward
support, a sample input runs inside a checkpointed region under each policy, as the op and
(where one exists) as its in-place variant applied to an intermediate computed in the region.
Outputs, gradients of every input and the final value of every tensor argument (an op may
write one: ``native_batch_norm``'s running statistics) must equal eager's, bitwise; a
refusal must be a ``CheckpointError`` for an op listed in docs/ops.md with its reason.

Default: the first sample of each op. ``TRACEDAC_OPINFO_SAMPLES=4`` runs the first four,
``TRACEDAC_OPINFO_ALL=1`` every sample (hours: some ops have hundreds).
"""

from __future__ import annotations

import itertools
import os
import re
from pathlib import Path

import pytest
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

import tracedac
from tracedac import policies

common_methods_invocations = pytest.importorskip("torch.testing._internal.common_methods_invocations")

POLICIES = [
    policies.recompute_all(),
    policies.save_all(),
    policies.save_matmuls(),
    policies.memory_budget(0.3),
    policies.min_cut(),
    policies.offload_kept(policies.save_all()),  # what save_all keeps, through host copies
]
ALL_SAMPLES = os.environ.get("TRACEDAC_OPINFO_ALL", "") not in ("", "0")
# how many samples of each op: TRACEDAC_OPINFO_SAMPLES=4 (ALL: every one; some ops have hundreds)
SAMPLES = None if ALL_SAMPLES else int(os.environ.get("TRACEDAC_OPINFO_SAMPLES", "1"))
OPS = [
    op
    for op in common_methods_invocations.op_db
    if op.supports_autograd and torch.float64 in op.supported_dtypes("cpu")
]
DOCS = Path(__file__).resolve().parent.parent / "docs" / "ops.md"


# Ops whose eager result is not bitwise reproducible, compared within float64's tolerance.
NOT_BITWISE_IN_EAGER = {
    # LAPACK's gelsy on an underdetermined system: eager against eager differs in the last
    # bit depending on where its buffers land in memory (the forward outputs differ too)
    "linalg.lstsq",
}


def documented_refusals() -> dict[str, str]:
    """``op name -> reason`` from the refusal table of docs/ops.md (rows "| `name` | reason |")."""
    rows = re.findall(r"^\| `([^`]+)` \| (.+?) \|$", DOCS.read_text(), flags=re.M)
    return dict(rows)


def _samples(op):
    samples = op.sample_inputs("cpu", torch.float64, requires_grad=True)
    return list(samples if SAMPLES is None else itertools.islice(samples, SAMPLES))


class _Case:
    """One sample, ready to run again and again on fresh copies of its tensors."""

    def __init__(self, op, sample, inplace: bool):
        self.op, self.sample, self.inplace = op, sample, inplace
        self.flat, self.spec = tree_flatten((sample.input, sample.args, sample.kwargs))

    def fresh(self):
        """Copies of the sample's tensors (leaves where the sample's require grad)."""
        flat = [
            t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
            for t in self.flat
        ]
        return flat

    def function(self):
        op, sample, spec, inplace = self.op, self.sample, self.spec, self.inplace
        variant = op.get_inplace() if inplace else op.get_op()

        def run(*flat):
            x, args, kwargs = tree_unflatten(list(flat), spec)
            if inplace:
                x = x * 1  # an intermediate of the region: the in-place variant writes it
            out = op.gradcheck_wrapper(variant, x, *args, **kwargs)
            return sample.output_process_fn_grad(out)

        return run


def _loss(out):
    """A weighted sum of every floating output (weights fixed: a wrong element shows)."""
    total = None
    for i, o in enumerate(tree_flatten(out)[0]):
        if not isinstance(o, torch.Tensor) or not o.requires_grad:
            continue
        o = torch.view_as_real(o) if o.is_complex() else o
        weight = torch.linspace(-1, 2, o.numel(), dtype=o.dtype).view_as(o) + i
        term = (o * weight).sum()
        total = term if total is None else total + term
    return total


def _execute(case: _Case, policy, fn=None, wrap=lambda f: f):
    """(outputs, gradients, final tensor arguments) of one run, eager when ``policy`` is None.
    ``fn``: the function to run (default the case's); ``wrap``: applied last (a compiler)."""
    flat = case.fresh()
    fn = case.function() if fn is None else fn
    if policy is not None:
        fn = tracedac.checkpoint(fn, policy=policy)
    fn = wrap(fn)
    leaves = [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]
    # The CPU generator only: torch.manual_seed also seeds every lazily initialized device
    # backend, recording three stack traces each time (a third of this file's time).
    torch.default_generator.manual_seed(0)
    out = fn(*flat)
    loss = _loss(out)
    grads = ()
    if loss is not None and leaves:
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    outs = [o.detach() if isinstance(o, torch.Tensor) else o for o in tree_flatten(out)[0]]
    state = [t.detach() for t in flat if isinstance(t, torch.Tensor)]
    return outs, grads, state


def _same(a, b, bitwise=True) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype is torch.complex32 and b.dtype is torch.complex32:  # no kernels to compare with
            a, b = a.to(torch.complex64), b.to(torch.complex64)
        if not bitwise and a.is_floating_point() and a.shape == b.shape and a.dtype == b.dtype:
            return bool(torch.allclose(a, b, rtol=1e-7, atol=1e-12, equal_nan=True))
        return (
            a.shape == b.shape
            and a.dtype == b.dtype
            and bool(
                torch.equal(a, b)
                or (a.is_floating_point() or a.is_complex())
                and torch.equal(a.isnan(), b.isnan())
                and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))
            )
        )
    return a == b or (a is None and b is None)


def check_op(op, refusals: dict) -> tuple[int, list[str]]:
    """Runs ``op``'s samples; (cases checked, problems). A refusal is recorded in ``refusals``."""
    checked, problems = 0, []
    for sample in _samples(op):
        for inplace in (False, True) if op.get_inplace() is not None else (False,):
            case = _Case(op, sample, inplace)
            variant = f"{op.name}{'_ (in place)' if inplace else ''}"
            try:
                expected = _execute(case, None)
            except Exception:
                continue  # eager refuses the sample (an in-place variant that would broadcast)
            for policy in POLICIES:
                # twice: the first call records, the second repeats its template (the warm
                # path, docs/design.md) on fresh arguments of the same shapes
                for call in ("", ", repeated"):
                    checked += 1
                    try:
                        got = _execute(case, policy)
                    except tracedac.CheckpointError as e:
                        refusals.setdefault(op.name, str(e))
                        break
                    except Exception as e:  # a crash that is not a refusal
                        problems.append(f"{variant} under {policy}{call}: {type(e).__name__}: {e}")
                        break
                    bitwise = op.name not in NOT_BITWISE_IN_EAGER
                    for what, a, b in zip(("outputs", "gradients", "final arguments"), expected, got):
                        if len(a) != len(b) or not all(_same(x, y, bitwise) for x, y in zip(a, b)):
                            problems.append(f"{variant} under {policy}{call}: wrong {what}")
    return checked, problems


@pytest.mark.parametrize(
    "op", OPS, ids=[f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name for op in OPS]
)
def test_opinfo_op_matches_eager_under_every_policy(op):
    refusals: dict = {}
    checked, problems = check_op(op, refusals)
    assert not problems, "\n".join(problems)
    documented = documented_refusals()
    for name, message in refusals.items():
        assert name in documented, f"{name} is refused but not listed in docs/ops.md: {message}"
