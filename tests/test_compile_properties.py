"""Random programs compiled with their regions give eager's gradients, buffers and side effects.

The programs and policies are test_properties.py's (buffers written and read in the region,
in-place ops through views, running statistics, a pre-hook that writes a buffer, a Python
counter), less its random ops: a compiled graph draws other numbers than eager. The oracle is
eager without checkpointing, not the program compiled without checkpointing, which fails some
of these programs itself (a buffer read, then written: design.md, "A buffer the region writes
and reads"). ``aot_eager_decomp_partition``: torch's min-cut partition of the tagged graph,
without inductor's compile; the decompositions move the last bits, hence the tolerance.
"""

import torch
import torch._dynamo
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_properties import TABLE, attempt, inputs, random_policy, run
from tracedac import checkpoint

RANDOM = {"dropout", "noise", "rrelu"}
OPS = [i for i, (name, _, _) in enumerate(TABLE) if name not in RANDOM]

programs = st.lists(
    st.tuples(st.sampled_from(OPS), st.integers(0, 50), st.integers(0, 50)), min_size=1, max_size=10
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    program=programs, which=st.integers(0, 8), seed=st.integers(0, 2**16), labels=st.sets(st.integers(0, 9))
)
def test_random_programs_compiled_with_their_regions_give_eagers_gradients_and_buffers(
    program, which, seed, labels
):
    x, w = inputs(seed)
    torch._dynamo.reset()  # each program compiles afresh: no recompile limit carried over
    loss0, grads0, written0, calls0 = attempt(run, program, x, w, seed, labels)
    region = checkpoint(run, policy=random_policy(which, seed))
    compiled = torch.compile(region, backend="aot_eager_decomp_partition", fullgraph=True)
    loss1, grads1, written1, calls1 = attempt(compiled, program, x, w, seed, labels)
    close = dict(rtol=1e-4, atol=1e-5, equal_nan=True)  # decompositions move the last bits
    torch.testing.assert_close(loss1, loss0, **close)
    for a, b in zip(grads1, grads0, strict=True):
        torch.testing.assert_close(a, b, **close)
    assert calls1 == calls0, "Python ran once"
    for a, b in zip(written1, written0, strict=True):
        torch.testing.assert_close(a, b, **close, msg="every buffer ends as in eager")
    torch._dynamo.reset()
