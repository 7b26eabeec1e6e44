"""A collective an op issued in a region, finished before an error leaves the region.

The recorder runs an op first and decides it after (a policy reads the op's outputs). When the
decision raises (a policy that must replay a collective is refused, ``record/decisions.resolve``; a
policy's own error), the op has already issued its collective, and the waits that would follow
it (``_c10d_functional._wrap_tensor_autograd``, c10d's Python wrapper calling ``wait()``) never
run. Left so, the collective stays in flight after the program has caught the error: torch
warns at exit that "there are still 1 unwaited collective calls", and 2-rank gloo jobs that
caught the refusal and ended aborted in about half of the runs.

Why an abort: gloo runs a collective on a worker thread, in a work that holds Python objects
(the issuing thread's state, which in a region holds the region's saved-tensor hooks; tensors
that Python sees). The worker takes the GIL to copy that state when it starts the work and to
let go of the work's tensors and state when it is done. A thread that asks for the GIL while the
interpreter finalizes is ended by CPython (``pthread_exit``), and the unwinding meets C++ that
cannot let it through: "FATAL: exception not rethrown" or "terminate called without an active
exception", SIGABRT. That last step follows even a waited collective, so a program that ends
within a moment of one can abort too (torch alone, ``destroy_process_group`` avoids it); a
refused collective, which the program ends right after catching, is finished here as far as
that step: waited for, then kept until the worker has let go of it.
"""

from __future__ import annotations

import time

import torch
from torch.utils._pytree import tree_leaves

from .._compat import owners
from .decisions import COLLECTIVE_NAMESPACES, FUNCTIONAL_NAMESPACES

__all__ = ["wait_issued"]

# How long a refusal waits for gloo's worker to let go of the refused collective's result: it
# does so microseconds after the wait returns, unless its thread is not running (a loaded
# machine); past this, the error is raised anyway.
LET_GO_S = 1.0
_NAP_S = 0.001  # the GIL is released while napping: the worker may need it to let go


def wait_issued(op, out, error: BaseException) -> None:
    """Finish the collective ``op`` issued (``out``: what it returned) before ``error``, raised
    while the region decided ``op``, leaves the region. A functional collective's result tensors
    are waited for with ``wait_tensor`` (a no-op on a tensor with no work registered), then kept
    until nothing but their Python objects holds them (the work has let go); an in-place c10d
    collective's ``Work`` is waited for with ``wait()``. A wait that fails is added to ``error``
    as a note rather than hiding it."""
    namespace = getattr(op, "namespace", None)
    if namespace not in COLLECTIVE_NAMESPACES:
        return
    results = []
    try:
        for leaf in tree_leaves(out):
            if namespace in FUNCTIONAL_NAMESPACES:
                if isinstance(leaf, torch.Tensor):
                    torch.ops._c10d_functional.wait_tensor.default._op(leaf)
                    results.append(leaf)
            elif callable(getattr(leaf, "wait", None)):  # c10d's Work (a torch.ScriptObject)
                leaf.wait()
    except Exception as e:  # noqa: BLE001 (the caller's error is the one to raise)
        error.add_note(f"tracedac: waiting for {op} before raising also failed: {type(e).__name__}: {e}")
        return
    deadline = time.monotonic() + LET_GO_S
    while any(owners(t) > 1 for t in results) and time.monotonic() < deadline:
        time.sleep(_NAP_S)
    if results:
        time.sleep(_NAP_S)  # the worker drops the count, then takes the GIL for the Python object
