"""What every policy is: checked, described, and findable by id while it lives.

A policy is a callable ``policy(node) -> CheckpointPolicy`` (``check_policy``). A compiled
region names its policy by id (dynamo hands the function that makes a region's key no policy
object: ``compile/registry.key_for``), so every live policy made or checked is registered by
id in ``HELD``: tracedac's own policy classes from birth (``Held``: made, copied by
``copy.deepcopy`` of a checkpointed model, or unpickled), any other policy where it is
checked (``policies.spec.spec_of``).

Equal policies are one object (``interned``): a compiled region's code is guarded on its
policy's id, so ``memory_budget(0.5)`` made once per block would compile the block's code once
per block (the ninth refused under ``fullgraph=True``, torch's recompile limit) and a model
built again would compile again, its graphs keeping the old model's constants alive.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import weakref

import torch

__all__ = [
    "HELD",
    "Held",
    "check_policy",
    "describe_policy",
    "fields_of",
    "held",
    "hold",
    "interned",
    "interning",
]

# Weak, so a policy made each step (``memory_budget(0.3)`` inside the loop) is not kept for
# the process; an id whose policy died may name a new one, which registers itself anew.
HELD: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_HELD_STRONG: dict[int, object] = {}  # the rare policy that takes no weak reference (__slots__)


def hold(policy) -> None:
    """Make ``policy`` findable by ``id`` while it lives (``HELD``). Not while dynamo traces
    (it cannot trace a weak reference's creation): a policy passed into compiled code was
    registered when it was made or first checked outside it."""
    if torch.compiler.is_compiling():
        return
    try:
        HELD[id(policy)] = policy
    except TypeError:
        _HELD_STRONG[id(policy)] = policy


# The live policy of each value: (class, fields) -> the first policy made with them. Weak, as HELD.
_EQUAL: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _by_value(cls) -> bool:
    params = getattr(cls, "__dataclass_params__", None)
    return params is not None and params.frozen and params.eq


def fields_of(x) -> tuple:
    """A dataclass instance's field values, in order (what its ``__eq__`` compares)."""
    return tuple(getattr(x, f.name) for f in dataclasses.fields(x))


def interned(policy):
    """The live policy equal to ``policy`` (``policy`` itself if it is the first). Only a
    frozen dataclass compared by value is shared (``peak()`` keeps state: every call is its
    own), and not while dynamo traces (a policy made there is refused: ``registry.key_for``)."""
    if not _by_value(type(policy)) or torch.compiler.is_compiling():
        return policy
    key = (type(policy), fields_of(policy))
    try:
        return _EQUAL.setdefault(key, policy)
    except TypeError:  # a field that does not hash (a user's list): compared by identity, as before
        return policy


def interning(factory):
    """A policy factory whose equal results are one object (``interned``)."""

    @functools.wraps(factory)
    def make(*args, **kwargs):
        return interned(factory(*args, **kwargs))

    return make


def held(key: int):
    """The live policy whose id is ``key``, or None."""
    policy = HELD.get(key)
    return _HELD_STRONG.get(key) if policy is None else policy


class Held:
    """A policy class whose instances are held by id from birth (``HELD``): made, copied
    (``copy.deepcopy`` of a checkpointed model) or unpickled."""

    def __post_init__(self) -> None:
        hold(self)

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)  # (a frozen dataclass's fields: no __setattr__)
        hold(self)

    def __reduce_ex__(self, protocol):
        """A policy compared by value is copied or unpickled as the live one equal to it
        (``interned``): a deep copy of a checkpointed model compiles with its original's code.
        Its ops travel by name (an aten op does not pickle: ``torch.save(model)`` of a model
        checkpointed with ``save_matmuls()`` failed inside pybind11)."""
        if not _by_value(type(self)):
            return super().__reduce_ex__(protocol)
        return _remade, (type(self), _mapped(fields_of(self), _op_name))


class _OpName(str):
    """An op in a pickled policy: its qualified name (``aten.mm.default``, ``aten.mm``)."""


def _mapped(value, leaf):
    """``value`` with ``leaf`` applied inside its tuples and frozensets (exactly those: a named
    tuple is built otherwise)."""
    if type(value) in (frozenset, tuple):
        return type(value)(_mapped(v, leaf) for v in value)
    return leaf(value)


def _op_name(value):
    if isinstance(value, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return _OpName(str(value))
    return value


def _op(value):
    if not isinstance(value, _OpName):
        return value
    namespace, name, *overload = value.split(".")
    try:
        op = getattr(getattr(torch.ops, namespace), name)
        return getattr(op, overload[0]) if overload else op
    except (AttributeError, RuntimeError):
        raise RuntimeError(
            f"a tracedac policy being loaded names the op {value}, which this process has not "
            f"registered: import the module that defines {namespace}::{name} before loading."
        ) from None


def _remade(cls, fields: tuple):
    return interned(cls(*_mapped(fields, _op)))


def check_policy(policy) -> None:
    """Raise if ``policy`` cannot be a policy; nothing else (``hold`` registers one)."""
    if isinstance(policy, types.FunctionType) and policy.__module__.startswith("tracedac.policies"):
        raise TypeError(
            f"policy={policy.__name__} is the factory, not a policy: call it, "
            f"policy={policy.__name__}(...) (e.g. tracedac.policies.save_matmuls())."
        )
    if not callable(policy):
        raise TypeError(
            f"a policy is a callable taking a recorded node and returning a "
            f"torch.utils.checkpoint.CheckpointPolicy (e.g. tracedac.policies.save_matmuls()), "
            f"got {policy!r} of type {type(policy).__name__}"
        )


def describe_policy(policy) -> str:
    """How a person wrote the policy: ``save_matmuls()`` (tracedac's policies print as the call
    that made them), or a function's name."""
    if isinstance(policy, Held):
        return repr(policy)
    return getattr(policy, "__qualname__", None) or repr(policy)
