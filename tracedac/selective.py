"""torch's selective activation checkpointing, read as a tracedac policy.

torch's selective checkpointing (SAC) is a ``context_fn`` made by
``functools.partial(create_selective_checkpoint_contexts, policy_fn_or_list)`` (or a lambda
calling it): ``checkpoint_call(fn, *args, use_reentrant=False, context_fn=...)`` and the
``context_fn`` of Hugging Face's ``gradient_checkpointing_kwargs`` are taken as they are and
become the tracedac policy that makes the same decision for the same op:

- a list of ops: ``save_ops(*ops)``, which is torch's rule for a list (an op in the list
  MUST_SAVE, any other PREFER_RECOMPUTE); an empty list is ``recompute_all()``;
- a policy function: ``torch_selective(policy_fn)``, which calls it once per recorded node
  as torch's caching mode does, ``policy_fn(SelectiveCheckpointContext(is_recompute=False,
  op_output=out), op, *args, **kwargs)``, with the op overload and the op's own arguments,
  tensors included, and its result as ``op_output`` (a bool answer is read as torch reads
  it: True MUST_SAVE, False PREFER_RECOMPUTE).

What is the same and what is not:

- tracedac asks about the ops that allocate or write a storage (views cost nothing to
  rebuild, and hold their base's storage); torch asks about every op but ``detach`` and a
  few metadata ops. For those ops the function is asked once each, in the forward's order,
  so a function that counts calls (torchtitan's "save every other mm") decides as in torch.
- The function is asked while the region records, and gets the real tensors the op ran
  on. Where there is no running op (a region traced by ``torch.compile``, ``trade_off``
  and ``tracedac.name`` deciding again), it gets tensors on the ``meta`` device of the
  same shape, dtype and strides: only their metadata can be read.
- ``MUST_CPU_OFFLOAD``/``PREFER_CPU_OFFLOAD`` offload the op's result to host memory, as
  for any tracedac policy (``tracedac.offload``; eager only: refused under ``torch.compile``,
  whose partitioner does not act on those tags).
- ``allow_cache_entry_mutation`` has no counterpart: a kept tensor changed in place after
  the forward is refused by name, as for any policy.
- Only what backward needs is replayed, never the region's Python: recomputed ops are a
  subset of those torch's recompute runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils import checkpoint as _torch_checkpoint
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

from ._compat import selective_checkpoint_policy
from .decisions import MUST_SAVE, PREFER_RECOMPUTE, Held
from .errors import CheckpointError
from .graph import Layout, TensorMeta
from .trace import deciding

__all__ = [
    "TorchSelective",
    "from_context_fn",
    "is_noop_context_fn",
    "policy_for_context_fn",
    "torch_selective",
]

# torch 2.13's context carries the op's result; older ones only ``is_recompute``.
try:
    SelectiveCheckpointContext(is_recompute=False, op_output=None)
    _HAS_OUTPUT = True
except TypeError:  # pragma: no cover (an older torch)
    _HAS_OUTPUT = False

_FOREIGN = (
    "tracedac does not run a context_fn around the forward and its recomputation: what is "
    "kept is a policy's choice. A context_fn made by torch's create_selective_checkpoint_"
    "contexts(policy_fn_or_list) is read as the same policy; for any other, express the choice "
    "as policy=tracedac.policies.save_ops(...) (or any tracedac policy) and drop context_fn."
)


def is_noop_context_fn(context_fn) -> bool:
    """``None`` or torch's default ``noop_context_fn``: nothing asked."""
    return (
        context_fn is None
        or context_fn is _torch_checkpoint.noop_context_fn
        or getattr(context_fn, "__name__", "") == "noop_context_fn"
    )


def from_context_fn(context_fn, where: str = "checkpoint_call"):
    """The tracedac policy for a ``context_fn`` torch's checkpoint would take, or None for
    none (``noop_context_fn``). A context_fn not made by ``create_selective_checkpoint_contexts``
    raises a ``CheckpointError``: tracedac cannot honour arbitrary context managers."""
    if is_noop_context_fn(context_fn):
        return None
    if not callable(context_fn):
        raise CheckpointError(f"{where} got context_fn={context_fn!r}, which is not callable. {_FOREIGN}")
    contexts = context_fn()  # torch calls it at every checkpoint call too: it only makes two modes
    given = selective_checkpoint_policy(contexts)
    if given is None:
        name = getattr(context_fn, "__qualname__", None) or repr(context_fn)
        raise CheckpointError(
            f"{where} got a context_fn ({name}) that is not torch's selective checkpointing (it "
            f"returned {type(contexts).__name__}, not create_selective_checkpoint_contexts' pair of "
            f"modes). {_FOREIGN}"
        )
    return torch_selective(given)


# Policies made from a context_fn met inside compiled code, by id: dynamo cannot trace the
# conversion (torch marks create_selective_checkpoint_contexts as not to be traced), and a
# region names its policy by id (compile/registry.py), so the conversion runs at trace time as
# a constant (``_converted``) and the policy lives here, held, for the process: one per
# distinct policy (equal ones share an entry).
_COMPILED: dict[int, object] = {}


def policy_for_context_fn(context_fn, where: str = "checkpoint_call"):
    """``from_context_fn(context_fn)``, also inside code ``torch.compile`` traces."""
    if torch.compiler.is_dynamo_compiling():
        return _COMPILED[_converted(context_fn, where)]
    return from_context_fn(context_fn, where)


def _converted(context_fn, where: str) -> int:
    """The id of the policy for ``context_fn``, kept in ``_COMPILED`` and findable by id
    (``decisions.HELD``). Dynamo calls it at trace time and takes the result as a constant."""
    from ._compat import trace_time_error
    from .decisions import HELD

    try:
        policy = from_context_fn(context_fn, where)
    except CheckpointError as e:  # (dynamo passes this one on as it is, not as its own bug)
        raise trace_time_error(str(e)) from None
    policy = next((p for p in _COMPILED.values() if p == policy), policy)
    _COMPILED[id(policy)] = policy
    HELD[id(policy)] = policy  # (made while dynamo traces: Held could not register it itself)
    return id(policy)


_converted._dynamo_marked_constant = True  # torch._dynamo.assume_constant_result, without importing dynamo


def torch_selective(policy_fn_or_list):
    """The tracedac policy for what torch's ``create_selective_checkpoint_contexts`` takes: a
    list of ops (-> ``save_ops(*ops)``, or ``recompute_all()`` if empty) or a policy function
    ``policy_fn(ctx, op, *args, **kwargs) -> CheckpointPolicy | bool`` (-> ``TorchSelective``)."""
    from .policies import recompute_all, save_ops  # (policies imports planners: kept lazy)

    if isinstance(policy_fn_or_list, (list, tuple)):
        ops = [op for op in policy_fn_or_list if isinstance(op, torch._ops.OpOverload)]
        # (a HigherOrderOperator in torch's list never reaches a dispatch mode in eager: no node)
        return save_ops(*ops) if ops else recompute_all()
    if not callable(policy_fn_or_list):
        raise TypeError(
            "torch_selective() takes what create_selective_checkpoint_contexts takes: a list of ops "
            f"or a policy function policy_fn(ctx, op, *args, **kwargs), got {policy_fn_or_list!r}"
        )
    return TorchSelective(policy_fn_or_list)


@dataclass(frozen=True)
class TorchSelective(Held):
    """A policy function of torch's selective checkpointing, asked per recorded node."""

    policy_fn: object
    reads_values = True  # asked with the op's real tensors while it records (``trace.deciding``)

    def __call__(self, node) -> CheckpointPolicy:
        call = deciding(node)
        args, kwargs, out = call if call is not None else _stand_ins(node)
        ctx = (
            SelectiveCheckpointContext(is_recompute=False, op_output=out)
            if _HAS_OUTPUT
            else SelectiveCheckpointContext(is_recompute=False)
        )
        d = self.policy_fn(ctx, node.op, *args, **kwargs)
        if isinstance(d, bool):  # torch's older convention: True to save
            return MUST_SAVE if d else PREFER_RECOMPUTE
        return d

    def __repr__(self) -> str:
        fn = self.policy_fn
        name = getattr(fn, "__qualname__", None) or getattr(getattr(fn, "func", None), "__qualname__", None)
        return f"torch_selective({name or repr(fn)})"


def _stand_ins(node):
    """The node's arguments and result as ``meta`` tensors (shape, dtype, strides only)."""

    def meta(x):
        if isinstance(x, TensorMeta):
            return torch.empty_strided(x.size, x.stride, dtype=x.dtype, device="meta")
        if isinstance(x, Layout):
            return torch.empty_strided(x.size, x.stride, dtype=x.dtype, device="meta")
        if isinstance(x, (list, tuple)):
            return type(x)(meta(y) for y in x)
        return x

    args = node.args if node.args is not None else ()
    kwargs = node.kwargs if node.kwargs is not None else {}
    outs = tuple(meta(o) for o in node.outputs)
    return meta(tuple(args)), {k: meta(v) for k, v in kwargs.items()}, outs[0] if len(outs) == 1 else outs
