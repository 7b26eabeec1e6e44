"""A ``context_fn`` of torch's checkpoint under tracedac: torch's selective activation
checkpointing read as a tracedac policy, any other pair of contexts entered as torch enters it.

``context_fn`` is called once per checkpoint call, as torch calls it. Returning anything but
torch's selective checkpointing, it returns ``(forward_context, recompute_context)``
(``Contexts``): the first is entered around the region's forward, inside the region, so a
dispatch mode among them sees the program's ops once and what it runs is what is recorded;
the second around each replay pass of the region in backward, where it sees the ops replay
runs (only what backward needs; never the Python, so none of the ``detach`` torch's
recomputation makes for each saved tensor). A policy still says what is kept. Eager only:
traced (``torch.compile``), torch would enter them only while tracing, and tracedac refuses.

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
- ``allow_cache_entry_mutation`` has no counterpart and needs none: a kept result the region
  itself changes in place is rebuilt from the recorded write (where torch raises, or with the
  flag replays the write on the already changed tensor); one changed after the forward is
  refused by name, as for any policy.
- Only what backward needs is replayed, never the region's Python: recomputed ops are a
  subset of those torch's recompute runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils import checkpoint as _torch_checkpoint
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

from .._compat import selective_checkpoint_policy
from ..errors import CheckpointError
from ..record.decisions import MUST_SAVE, PREFER_RECOMPUTE
from ..record.graph import Layout, TensorMeta
from ..record.tracer import deciding
from .held import Held, interning

__all__ = [
    "COMPILED_FOREIGN",
    "Contexts",
    "TorchSelective",
    "from_context_fn",
    "is_noop_context_fn",
    "policy_for_context_fn",
    "read_context_fn",
    "torch_selective",
]

# torch 2.13's context carries the op's result; older ones only ``is_recompute``.
try:
    SelectiveCheckpointContext(is_recompute=False, op_output=None)
    _HAS_OUTPUT = True
except TypeError:  # pragma: no cover (an older torch)
    _HAS_OUTPUT = False

COMPILED_FOREIGN = (
    "Under torch.compile (or make_fx, export) a context_fn's contexts would only run while the "
    "region is traced: torch's compiled checkpoint enters them around the trace, on fake tensors, "
    "and never when the compiled code runs or recomputes. tracedac refuses rather than run them "
    "once at compile time. Call the region outside the compiled function (or under "
    "torch.compiler.disable) to have them entered around its forward and replay, or drop "
    "context_fn and say what to keep with policy=tracedac.policies.save_ops(...) (or any "
    "tracedac policy)."
)


def is_noop_context_fn(context_fn) -> bool:
    """``None`` or torch's default ``noop_context_fn``: nothing asked."""
    return (
        context_fn is None
        or context_fn is _torch_checkpoint.noop_context_fn
        or getattr(context_fn, "__name__", "") == "noop_context_fn"
    )


def read_context_fn(context_fn, where: str = "checkpoint_call"):
    """``(policy, contexts)`` for a ``context_fn`` torch's checkpoint would take, calling it once
    as torch does at every checkpoint call: torch's selective checkpointing gives its tracedac
    policy and no contexts; any other pair of context managers gives no policy and its
    ``Contexts``; ``noop_context_fn`` (or None) gives neither. Anything else raises."""
    if is_noop_context_fn(context_fn):
        return None, None
    name = getattr(context_fn, "__qualname__", None) or repr(context_fn)
    if not callable(context_fn):
        raise CheckpointError(
            f"{where} got context_fn={name}, which is not callable. torch's checkpoint takes a function "
            "returning a pair (forward context, recompute context) of context managers."
        )
    contexts = context_fn()
    given = selective_checkpoint_policy(contexts)
    if given is not None:
        return torch_selective(given), None
    if not (
        isinstance(contexts, tuple)
        and len(contexts) == 2
        and all(hasattr(c, "__enter__") and hasattr(c, "__exit__") for c in contexts)
    ):
        raise CheckpointError(
            f"{where} got a context_fn ({name}) that returned {type(contexts).__name__}, not a pair "
            "(forward context, recompute context) of context managers as torch's checkpoint takes. "
            "Return such a pair (contextlib.nullcontext() where nothing is wanted), or torch's "
            "create_selective_checkpoint_contexts(policy_fn_or_list)."
        )
    return None, Contexts(*contexts, where=where)


def from_context_fn(context_fn, where: str = "checkpoint_call"):
    """The tracedac policy of torch's selective checkpointing ``context_fn``, or None for
    ``noop_context_fn``. For callers that only take a policy: any other pair of contexts raises a
    ``CheckpointError`` (``checkpoint_call`` takes them: ``read_context_fn``)."""
    policy, contexts = read_context_fn(context_fn, where)
    if contexts is not None:
        name = getattr(context_fn, "__qualname__", None) or repr(context_fn)
        raise CheckpointError(
            f"{where} got a context_fn ({name}) that is not torch's selective checkpointing, and "
            f"{where} only reads what to keep from a context_fn: it enters no contexts. Say what to "
            "keep as policy=tracedac.policies.save_ops(...) (or any tracedac policy), or pass "
            "the context_fn to tracedac.checkpoint_call, which enters its contexts around the "
            "forward and each replay."
        )
    return policy


class Contexts:
    """One call's pair from a ``context_fn`` that is not torch's selective checkpointing, used
    as torch uses it: ``forward`` is entered around the region's forward (inside the region, so a
    dispatch mode sees the program's ops once, and what it runs is what is recorded), and
    ``recompute`` around each replay pass of the region in backward, as torch enters it around
    each recomputation. A replay runs only the ops backward needs, never the region's Python.

    A ``contextlib.contextmanager`` context can be entered once; torch enters the same object
    again at a second recomputation (``retain_graph=True``) and fails there. Here each pass
    enters a fresh one made from the same generator function and arguments, the way contextlib
    re-creates one that decorates a function (its ``_recreate_cm``); any other context is
    entered as it is, once per pass."""

    __slots__ = ("forward", "recompute", "where")

    def __init__(self, forward, recompute, where: str = "checkpoint_call"):
        self.forward = forward
        recreate = getattr(recompute, "_recreate_cm", None)
        if recreate is None:
            self.recompute = lambda: recompute  # what replay enters: the context itself
        else:  # a copy never entered, made before the forward (which may enter ``recompute``)
            self.recompute = recreate()._recreate_cm
        self.where = where

    def run(self, graph, fn, args, kwargs):
        """Call ``fn`` in ``forward``, inside the region recording ``graph``; each replay of
        ``graph`` (``replay.run_pass``) enters ``recompute``."""
        graph.recompute_context = self.recompute
        with self.forward:
            _refuse_torch_selective_inside(self.where)
            return fn(*args, **kwargs)
        raise CheckpointError(  # (reached only when the forward context swallowed an exception)
            f"{self.where}: the forward context of context_fn suppressed an exception raised in the "
            "checkpointed forward; there is no result to return and nothing to replay. Let the "
            "exception through (return False or None from __exit__), as torch's checkpoint requires."
        )


def _refuse_torch_selective_inside(where: str) -> None:
    caching = getattr(_torch_checkpoint, "_CachingTorchDispatchMode", None)
    if caching is None:  # pragma: no cover (an older torch)
        return
    if any(isinstance(m, caching) for m in _get_current_dispatch_mode_stack()):
        raise CheckpointError(
            f"{where} got a context_fn whose forward context runs torch's selective checkpointing "
            "mode among other contexts. tracedac reads torch's selective checkpointing as a policy "
            "only when context_fn returns create_selective_checkpoint_contexts' pair as it is; "
            "entered around tracedac's replay, its modes would hand back cached results for ops "
            "replay does not run in torch's order. Pass the choice as policy=tracedac.selective."
            "torch_selective(policy_fn_or_list) and return only your own contexts from context_fn."
        )


# Policies made from a context_fn met inside compiled code, by id: dynamo cannot trace the
# conversion (torch marks create_selective_checkpoint_contexts as not to be traced), and a
# region names its policy by id (compile/registry.py), so the conversion runs at trace time as
# a constant (``_converted``) and the policy lives here, held, for the process: one per
# distinct policy (equal ones share an entry).
_COMPILED: dict[int, object] = {}


def policy_for_context_fn(context_fn, where: str = "checkpoint_call"):
    """``read_context_fn(context_fn)``, also inside code ``torch.compile`` traces (where a
    context_fn other than torch's selective checkpointing raises: ``COMPILED_FOREIGN``)."""
    if torch.compiler.is_dynamo_compiling():
        return _COMPILED[_converted(context_fn, where)], None
    return read_context_fn(context_fn, where)


def _converted(context_fn, where: str) -> int:
    """The id of the policy for ``context_fn``, kept in ``_COMPILED`` and findable by id
    (``decisions.HELD``). Dynamo calls it at trace time and takes the result as a constant."""
    from .._compat import trace_time_error
    from .held import HELD

    try:
        policy, contexts = read_context_fn(context_fn, where)
        if contexts is not None:
            name = getattr(context_fn, "__qualname__", None) or repr(context_fn)
            raise CheckpointError(
                f"{where} got a context_fn ({name}) that is not torch's selective checkpointing. "
                + COMPILED_FOREIGN
            )
    except CheckpointError as e:  # (dynamo passes this one on as it is, not as its own bug)
        raise trace_time_error(str(e)) from None
    policy = next((p for p in _COMPILED.values() if p == policy), policy)
    _COMPILED[id(policy)] = policy
    HELD[id(policy)] = policy  # (made while dynamo traces: Held could not register it itself)
    return id(policy)


_converted._dynamo_marked_constant = True  # torch._dynamo.assume_constant_result, without importing dynamo


@interning
def torch_selective(policy_fn_or_list):
    """The tracedac policy for what torch's ``create_selective_checkpoint_contexts`` takes: a
    list of ops (-> ``save_ops(*ops)``, or ``recompute_all()`` if empty) or a policy function
    ``policy_fn(ctx, op, *args, **kwargs) -> CheckpointPolicy | bool`` (-> ``TorchSelective``)."""
    from . import recompute_all, save_ops  # (policies imports planners: kept lazy)

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
