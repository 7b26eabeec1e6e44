"""Count the collectives a process issues, at the dispatcher, and the bytes its all-gathers bring in.

All the libraries the ZeRO-3 benchmark compares reach the process group through dispatcher
ops: ``torch.distributed.all_gather_into_tensor`` (FSDP2, DeepSpeed) calls
``c10d::_allgather_base_``, list all-gathers call ``c10d::allgather_``, and functional
collectives are ``_c10d_functional::all_gather_into_tensor``. ``AllGatherCounter`` is a
``TorchDispatchMode`` that sees those ops and adds up the bytes of the gathered (output)
tensors: the full, unsharded tensor, ``world_size`` times what each rank sends. Beside the
bytes, it counts every collective op by name (``ops``): an all-to-all of an expert-parallel
MoE (``_c10d_functional::all_to_all_single``, which ``all_to_all_single_autograd`` lowers to,
and its gradient's), an all-reduce... What it counts is what ran: a checkpoint that replays a
collective in backward is counted twice, one that hands back a saved result is not.

A collective inside a custom op (tracedac's gathers are ``torch.library`` ops) would be
invisible to a dispatch mode: the mode is switched off while an op it intercepted runs.
So the counter runs the kernel of every op outside torch's own namespaces with itself
switched back on, and the collectives in its body are counted like anyone else's; the
custom op itself is never counted, so a library cannot be credited for what its op
claims to move rather than what it moved.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["AllGatherCounter", "COLLECTIVE_NAMESPACES", "CollectiveCounter"]

# Where torch's collectives live: c10d's in-place ops (``dist.all_reduce``), the functional
# ones, their autograd variants and the old functional namespace. Written out here, not read
# from tracedac (``decisions.COLLECTIVE_NAMESPACES`` names the same four; a test checks they
# agree): the benchmarks count from outside the library they measure.
COLLECTIVE_NAMESPACES = frozenset(
    {"c10d", "_c10d_functional", "_c10d_functional_autograd", "c10d_functional"}
)
# Ops of those namespaces that send nothing: waiting for a collective's result, wrapping it
# for autograd.
_NOT_SENT = frozenset({"wait_tensor", "_wrap_tensor_autograd"})
# Namespaces whose ops are never a wrapper around a collective: their kernels are not re-entered.
_TORCH_NAMESPACES = frozenset({"aten", "prim", "prims", "profiler", "debugprims"}) | COLLECTIVE_NAMESPACES


def _is_all_gather(func) -> bool:
    name = func._schema.name.split("::")[-1]
    return func.namespace in COLLECTIVE_NAMESPACES and ("allgather" in name or "all_gather" in name)


def _gathered(func, args, kwargs, out) -> list[torch.Tensor]:
    """The tensors an all-gather op wrote: its first argument (c10d, in place), or ``out=``,
    or what it returned (functional)."""
    if func.namespace == "c10d":
        return [t for t in tree_leaves(args[0]) if isinstance(t, torch.Tensor)]
    if "out" in kwargs:
        return [t for t in tree_leaves(kwargs["out"]) if isinstance(t, torch.Tensor)]
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]


class CollectiveCounter(TorchDispatchMode):
    """The collectives run while the mode is on, and the bytes of their all-gathers by dtype.

    ``ops["_c10d_functional.all_to_all_single"]`` counts calls of each collective op, by
    namespace and name (overloads together); ``bytes[dtype]`` sums the gathered tensors'
    ``numel * element_size``; ``calls`` counts the all-gather ops; ``total()`` is the bytes of
    every dtype.
    """

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # A compiled function runs with the counter on (dynamo would refuse to run compiled
        # code under a mode that is not ignored): what its graph dispatches, tracedac's gather
        # ops and the collectives inside them, is counted; fused kernels move no bytes.
        return True

    # A compiled graph's higher-order ops (``run_and_save_rng_state`` for a replayed dropout)
    # reach the mode at runtime: they move no bytes and run as they are.
    supports_higher_order_operators = True

    def __init__(self):
        super().__init__()
        self.bytes: Counter[str] = Counter()
        self.calls = 0
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(t.__torch_dispatch__ is not torch._C._disabled_torch_dispatch_impl for t in types):
            # A tensor subclass (a DTensor): counted beneath it, where its redistributions
            # call the collectives; a fake tensor's op (DTensor's shape propagation) just runs.
            if any(issubclass(t, FakeTensor) for t in types):
                return func(*args, **kwargs)
            return NotImplemented
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if func.namespace not in _TORCH_NAMESPACES:
            return self._run_body(func, args, kwargs)
        out = func(*args, **kwargs)
        if func.namespace in COLLECTIVE_NAMESPACES:
            name = func._schema.name.split("::")[-1]
            if name not in _NOT_SENT:
                self.ops[f"{func.namespace}.{name}"] += 1
        if _is_all_gather(func):
            self.calls += 1
            for t in _gathered(func, args, kwargs, out):
                self.bytes[str(t.dtype).removeprefix("torch.")] += t.numel() * t.element_size()
        return out

    def _run_body(self, func, args, kwargs):
        """Run a custom op's kernel with this mode on, so collectives inside it are seen."""
        devices = {t.device.type for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        key = "CUDA" if "cuda" in devices else "CPU"
        # The computed table: a custom op registers its kernel as CompositeExplicitAutograd.
        if not torch._C._dispatch_has_computed_kernel_for_dispatch_key(func.name(), key):
            # No device kernel to enter (a meta-only or Python-key-only op): run it as any other.
            return func(*args, **kwargs)
        with self:
            return func.redispatch(
                torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key)), *args, **kwargs
            )

    def total(self) -> int:
        """Bytes gathered, all dtypes together."""
        return sum(self.bytes.values())


# The name the ZeRO benchmark, its notebook and tests count all-gathers under.
AllGatherCounter = CollectiveCounter
