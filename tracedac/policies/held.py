"""What every policy is: checked, described, and findable by id while it lives.

A policy is a callable ``policy(node) -> CheckpointPolicy`` (``check_policy``). A compiled
region names its policy by id (dynamo hands the function that makes a region's key no policy
object: ``compile/registry.key_for``), so every live policy made or checked is registered by
id in ``HELD``: tracedac's own policy classes from birth (``Held``: made, copied by
``copy.deepcopy`` of a checkpointed model, or unpickled), any other policy where it is
checked (``policies.spec.spec_of``).
"""

from __future__ import annotations

import types
import weakref

import torch

__all__ = ["HELD", "Held", "check_policy", "describe_policy", "held", "hold"]

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
