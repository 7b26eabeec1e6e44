"""Decisions and op lists: the leaf every policy, planner and graph pass imports.

A decision is torch's own ``CheckpointPolicy`` (MUST/PREFER x SAVE/RECOMPUTE), so a node
tagged by tracedac reads the same as one tagged by ``torch.utils.checkpoint``
(``node.meta["recompute"]``). A policy sees a node through a small interface that the eager
recorder's nodes (``tracedac.graph.Node``) and the nodes built from a compiled joint graph
(``tracedac.compile.fx_graph``) both provide:

- ``op``: the aten (or custom) ``OpOverload``; ``name``: ``str(op)``; ``index``: its position
- ``outputs``: one ``TensorMeta`` (``shape``, ``dtype``, ``nbytes``) or None per result
- ``nbytes``: bytes of the results it allocated; ``flops``: by torch's formulas
- ``labels``: the ``tracedac.name`` labels of its result; ``module_path``: where it ran
- ``is_random``: it draws from a generator; ``meta``: ``meta["recompute"]`` is its decision

``resolve(policy, node)`` is the decision a region carries out: the policy's answer,
checked, with the ops of ``RECOMPUTE_OPS`` forced to replay unless the policy must save them,
and ops with an effect (``effect``: collectives) forced to be kept whatever it says.
Nothing here imports the rest of tracedac but the leaf ``_compat``.
"""

from __future__ import annotations

import weakref

import torch
from torch._ops import OpOverload, OpOverloadPacket
from torch.utils.checkpoint import CheckpointPolicy

from ._compat import op_effect
from .errors import CheckpointError

__all__ = [
    "COLLECTIVE_NAMESPACES",
    "EFFECT_REPLAYED",
    "FUNCTIONAL_NAMESPACES",
    "LOW_DTYPES",
    "MATMUL_OPS",
    "MUST_CPU_OFFLOAD",
    "MUST_RECOMPUTE",
    "MUST_SAVE",
    "PREFER_CPU_OFFLOAD",
    "PREFER_RECOMPUTE",
    "PREFER_SAVE",
    "RECOMPUTE_OPS",
    "cast_dtype",
    "decision",
    "effect",
    "is_offload",
    "is_save",
    "needs_wait",
    "recompute_by_default",
    "replays_collectives",
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

# The ops `save_matmuls()` keeps and `min_cut()` does not replay, each with why it is worth its bytes.
MATMUL_OPS: dict[OpOverloadPacket, str] = {
    aten.mm: "a matmul replays O(n^3) FLOPs to rebuild O(n^2) bytes",
    aten.addmm: "nn.Linear with a bias lowers to addmm: a matmul",
    aten.bmm: "batched matmul (attention scores, MoE experts): a matmul per batch entry",
    aten.baddbmm: "batched matmul with an added input: as bmm",
    aten._scaled_dot_product_flash_attention: "attention (CUDA flash): quadratic in sequence length",
    aten._scaled_dot_product_efficient_attention: "attention (memory-efficient kernel): as flash",
    aten._scaled_dot_product_cudnn_attention: "attention (cuDNN kernel): as flash",
    aten._scaled_dot_product_flash_attention_for_cpu: "attention (CPU flash kernel): as flash",
}

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


def inner_flag(policy, name: str) -> bool:
    """Whether ``policy``, or one it combines or wraps (``either``, ``offload_kept``, ...), is a
    policy whose class sets the flag ``name`` (``replays_collectives``, ``reads_values``,
    ``offloads_inputs``)."""
    if getattr(policy, name, False) is True:
        return True
    inner = getattr(policy, "policies", None) or (getattr(policy, "policy", None),)
    return any(p is not None and p is not policy and inner_flag(p, name) for p in inner)


def replays_collectives(policy) -> bool:
    """Whether ``policy`` was wrapped in ``replay_collectives`` (collectives.py), alone or
    inside another: then it decides functional collectives itself."""
    return inner_flag(policy, "replays_collectives")


def decision(policy, node) -> CheckpointPolicy:
    """``policy(node)``, checked: a CheckpointPolicy tracedac can carry out."""
    d = policy(node)
    if not isinstance(d, CheckpointPolicy):
        raise CheckpointError(
            f"policy {policy!r} returned {d!r} for {node.name}; a policy must return a "
            "torch.utils.checkpoint.CheckpointPolicy such as CheckpointPolicy.MUST_SAVE."
        )
    return d


def resolve(policy, node, constant=None) -> CheckpointPolicy:
    """The decision a region carries out for ``node``: ``constant`` (a policy that never looks
    at nodes) or the policy's checked answer, then ``RECOMPUTE_OPS`` unless MUST_SAVE, and
    MUST_SAVE for an op with an ``effect``; a policy that must replay one is refused."""
    d = constant or decision(policy, node)
    op = node.op
    if id(op) in RECOMPUTE_OPS:
        return d if d is MUST_SAVE else MUST_RECOMPUTE  # a ZeRO-3 gather: only MUST_SAVE keeps it
    known = _EFFECTS.get(id(op))  # effect(op), inline after the op's first sight: once per op
    why = known[1] if known is not None else effect(op)
    if why is None:
        return d
    if op.namespace in FUNCTIONAL_NAMESPACES and replays_collectives(policy):
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


# The dtypes autocast computes in below fp32: what a ZeRO-3 group may travel in instead.
LOW_DTYPES = (torch.bfloat16, torch.float16)


def cast_dtype(op, args, kwargs) -> torch.dtype | None:
    """The dtype ``op(*args, **kwargs)`` casts its one input to, if it is a plain cast
    (autocast's ``_to_copy(t, dtype=...)``, or ``prims.convert_element_type`` after
    decomposition); else None. Asked of dispatched ops (``zero/auto.py``'s observer) and of FX
    nodes (``compile/passes/gather_cast.py``)."""
    if op is torch.ops.prims.convert_element_type.default:
        return args[1]
    if op is torch.ops.aten._to_copy.default and len(args) == 1 and set(kwargs) <= {"dtype"}:
        return kwargs.get("dtype")
    return None


# --- policies by id ------------------------------------------------------------------------

# Every live policy object made or checked, by id: a compiled region names its policy by id
# (dynamo hands the function that makes a region's key no policy object:
# ``compile/registry.key_for``), and only while tracing a region that holds it. Weak, so a
# policy made each step (``memory_budget(0.3)`` inside the loop) is not kept for the process;
# an id whose policy died may name a new one, which registers itself anew.
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
