"""Decisions: what a region does with each recorded result, and the ops that force one.

A decision is torch's own ``CheckpointPolicy`` (MUST/PREFER x SAVE/RECOMPUTE/CPU_OFFLOAD), so
a node tagged by tracedac reads the same as one tagged by ``torch.utils.checkpoint``
(``node.meta["recompute"]``). A policy sees a node through a small interface that the eager
recorder's nodes (``record.graph.Node``) and the nodes built from a compiled joint graph
(``compile/fx_graph.py``) both provide:

- ``op``: the aten (or custom) ``OpOverload``; ``name``: ``str(op)``; ``index``: its position
- ``outputs``: one ``TensorMeta`` (``shape``, ``dtype``, ``nbytes``) or None per result
- ``nbytes``: bytes of the results it allocated; ``flops``: by torch's formulas
- ``labels``: the ``tracedac.name`` labels of its result; ``module_path``: where it ran
- ``is_random``: it draws from a generator; ``meta``: ``meta["recompute"]`` is its decision

Some ops force a decision whatever a policy says: ``RECOMPUTE_OPS`` are replayed unless it
must save them (ZeRO-3's all-gather), and ops with an ``effect`` (collectives) are kept.
``resolve(spec, node)`` is the decision a region carries out for ``node``, its policy's
answer (``spec``: the policy's ``policies.spec.PolicySpec``) with those applied.
"""

from __future__ import annotations

import torch
from torch._ops import OpOverload
from torch.utils.checkpoint import CheckpointPolicy

from .._compat import op_effect
from ..errors import CheckpointError

__all__ = [
    "COLLECTIVE_NAMESPACES",
    "EFFECT_REPLAYED",
    "FUNCTIONAL_NAMESPACES",
    "MUST_CPU_OFFLOAD",
    "MUST_RECOMPUTE",
    "MUST_SAVE",
    "PREFER_CPU_OFFLOAD",
    "PREFER_RECOMPUTE",
    "PREFER_SAVE",
    "RECOMPUTE_OPS",
    "decision",
    "effect",
    "is_offload",
    "is_save",
    "needs_wait",
    "recompute_by_default",
    "resolve",
]

MUST_SAVE = CheckpointPolicy.MUST_SAVE
PREFER_SAVE = CheckpointPolicy.PREFER_SAVE
MUST_RECOMPUTE = CheckpointPolicy.MUST_RECOMPUTE
PREFER_RECOMPUTE = CheckpointPolicy.PREFER_RECOMPUTE
# Offload: the result goes to host memory in the forward and comes back in backward (offload.py)
MUST_CPU_OFFLOAD = CheckpointPolicy.MUST_CPU_OFFLOAD
PREFER_CPU_OFFLOAD = CheckpointPolicy.PREFER_CPU_OFFLOAD

aten = torch.ops.aten

# Ops a region replays unless a policy returns MUST_SAVE for them: their node's decision
# becomes MUST_RECOMPUTE whatever a PREFER policy (save_all(), a planner) said. id(op) ->
# (op, why). tracedac.zero registers its all-gather here when imported: keeping a gathered
# parameter would pin the full unit, which is what ZeRO-3 exists to avoid.
RECOMPUTE_OPS: dict[int, tuple] = {}


def recompute_by_default(op: OpOverload, reason: str) -> None:
    """Make ``op``'s nodes MUST_RECOMPUTE unless a policy says MUST_SAVE (see ``RECOMPUTE_OPS``)."""
    if not isinstance(op, OpOverload):
        raise TypeError(f"recompute_by_default() takes an OpOverload (torch.ops.ns.op.default), got {op!r}")
    RECOMPUTE_OPS[id(op)] = (op, reason)


# The save side, one way: ops whose results a region keeps whatever the policy says, because
# running them again would act on the world again. A collective sends its data again, and
# every other rank would have to replay the same one at the same point of its backward; each
# rank plans from its own shapes (uneven all-to-all splits), so their plans need not agree.
# Recognized by the op itself (``effect``), not registered: torch's collectives by namespace
# (functional, their autograd variants, and c10d's in-place ones), any other op by the effect
# it was registered with through ``torch.library``. ``RECOMPUTE_OPS`` wins: an op's owner
# who asked for replay (tracedac.zero's all-gather) gets it.
COLLECTIVE_NAMESPACES = frozenset(
    {"_c10d_functional", "_c10d_functional_autograd", "c10d_functional", "c10d"}
)
# Of those, the ones that return a new tensor waited for with wait_tensor: what
# ``replay_collectives`` lets a policy replay (collectives.py).
FUNCTIONAL_NAMESPACES = COLLECTIVE_NAMESPACES - {"c10d"}
_EFFECTS: dict[int, tuple] = {}  # id(op) -> (op, why or None), found on first sight


def _effect_of(op) -> str | None:
    if not isinstance(op, OpOverload):
        return None
    if op.namespace in COLLECTIVE_NAMESPACES:
        return "a collective"
    if op_effect(op) is not None:
        return "an op registered with an effect (torch.library)"
    return None


# What replaying one would do, for messages.
EFFECT_REPLAYED = (
    "replaying it would run it again: a collective sends its data again, and every rank would "
    "have to replay the same one at the same point of its backward"
)


def effect(op) -> str | None:
    """What ``op`` is if its results are kept, never replayed ("a collective"), or None.
    Asked for every recorded node: one dictionary lookup after an op's first sight."""
    if id(op) in RECOMPUTE_OPS:
        return None
    known = _EFFECTS.get(id(op))
    if known is None:
        known = _EFFECTS[id(op)] = (op, _effect_of(op))  # the op pins its id
    return known[1]


_WAITS: dict[int, tuple] = {}  # id(op) -> (op, whether a replayed result must be waited for)


def needs_wait(op) -> bool:
    """Whether replaying ``op`` issued a functional collective, whose results must be waited for
    before they are read (``replay_collectives``). One lookup per replayed node after the op's
    first sight."""
    known = _WAITS.get(id(op))
    if known is None:
        known = _WAITS[id(op)] = (op, getattr(op, "namespace", None) in FUNCTIONAL_NAMESPACES)
    return known[1]


def decision(policy, node) -> CheckpointPolicy:
    """``policy(node)``, checked: a CheckpointPolicy tracedac can carry out."""
    d = policy(node)
    if not isinstance(d, CheckpointPolicy):
        raise CheckpointError(
            f"policy {policy!r} returned {d!r} for {node.name}; a policy must return a "
            "torch.utils.checkpoint.CheckpointPolicy such as CheckpointPolicy.MUST_SAVE."
        )
    return d


def resolve(spec, node) -> CheckpointPolicy:
    """The decision a region carries out for ``node`` under ``spec`` (a ``PolicySpec``): its
    constant decision, or its policy's checked answer, then ``RECOMPUTE_OPS`` unless MUST_SAVE,
    and MUST_SAVE for an op with an ``effect``; a policy that must replay one is refused."""
    policy = spec.policy
    d = spec.constant or decision(policy, node)
    op = node.op
    if id(op) in RECOMPUTE_OPS:
        return d if d is MUST_SAVE else MUST_RECOMPUTE  # a ZeRO-3 gather: only MUST_SAVE keeps it
    known = _EFFECTS.get(id(op))  # effect(op), inline after the op's first sight: once per op
    why = known[1] if known is not None else effect(op)
    if why is None:
        return d
    if op.namespace in FUNCTIONAL_NAMESPACES and spec.replays_collectives:
        return d  # replay_collectives(policy): asked for, and checked across ranks (collectives.py)
    if d is MUST_RECOMPUTE:
        raise CheckpointError(
            f"policy {policy!r} returned MUST_RECOMPUTE for {node.name} (node {node.index}), {why}; "
            f"{EFFECT_REPLAYED}, and each rank plans its replay from its own shapes, so tracedac keeps "
            "the results of collectives and other effectful ops under every policy. Return "
            "PREFER_RECOMPUTE (the result is kept), wrap the policy in replay_collectives(...) to replay "
            "functional collectives on every rank alike (checked), or call the op outside the region; "
            "parameters that should be gathered again in backward are what tracedac.zero shards."
        )
    return MUST_SAVE


def is_save(d: CheckpointPolicy) -> bool:
    return d is MUST_SAVE or d is PREFER_SAVE


def is_offload(d: CheckpointPolicy) -> bool:
    return d is MUST_CPU_OFFLOAD or d is PREFER_CPU_OFFLOAD
