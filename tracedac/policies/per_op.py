"""Per-op policies: for each recorded result, keep it, offload it to host memory, or replay it.

A policy is any callable ``policy(node) -> CheckpointPolicy`` (torch's own enum, so a
decision reads the same as in ``torch.utils.checkpoint``). The ones here are frozen,
hashable dataclasses, so they compare by value, print as the call that made them, and can
key a cache. A node is a ``record.graph.Node``: ``op``, ``outputs`` (shape, dtype,
nbytes), ``nbytes``, ``labels``, ``module_path``, ``flops``, ``is_random``.

Decisions are made once per node when the region records it, never per tensor later. Only
nodes that allocate or write a storage are asked: views cost nothing to rebuild. The
whole-graph planners (``planners.py``: ``memory_budget``, ``min_cut``) decide for the region's
whole graph instead; ``either`` combines one of them with per-op policies.

Besides keeping and replaying, a result may be offloaded (``MUST_CPU_OFFLOAD``/``PREFER_CPU_OFFLOAD``):
copied to host memory in the forward, brought back in backward (``tracedac/offload/``).
``offload_ops`` and ``offload_names`` mirror ``save_ops`` and ``save_names``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch._ops import OpOverload, OpOverloadPacket
from torch.utils.checkpoint import CheckpointPolicy

from ..errors import CheckpointError
from ..record.decisions import (
    MUST_CPU_OFFLOAD,
    MUST_RECOMPUTE,
    MUST_SAVE,
    PREFER_CPU_OFFLOAD,
    PREFER_RECOMPUTE,
    PREFER_SAVE,
    decision,
)
from ..record.op_info import MATMUL_OPS
from .held import Held, check_policy, interning
from .planners import Planner

__all__ = [
    "Either",
    "OffloadNames",
    "OffloadOps",
    "RecomputeAll",
    "SaveAll",
    "SaveNames",
    "SaveOps",
    "either",
    "offload_names",
    "offload_ops",
    "recompute_all",
    "save_all",
    "save_matmuls",
    "save_names",
    "save_ops",
]


def _packet(op):
    return getattr(op, "overloadpacket", op)


@dataclass(frozen=True)
class RecomputeAll(Held):
    """Keep nothing the region computed; replay every tensor backward needs."""

    structural = True  # decides from the op alone (``spec.PolicySpec``)

    constant = PREFER_RECOMPUTE  # the same for every node: a region need not ask

    def __call__(self, node) -> CheckpointPolicy:
        return PREFER_RECOMPUTE

    def __repr__(self) -> str:
        return "recompute_all()"


@dataclass(frozen=True)
class SaveAll(Held):
    """Keep what autograd saves, as without checkpointing (Python still runs once)."""

    structural = True  # decides from the op alone (``spec.PolicySpec``)

    constant = PREFER_SAVE

    def __call__(self, node) -> CheckpointPolicy:
        return PREFER_SAVE

    def __repr__(self) -> str:
        return "save_all()"


@dataclass(frozen=True)
class SaveOps(Held):
    """Keep the results of these ops (an overload, or every overload of a packet)."""

    structural = True  # decides from the op alone (``spec.PolicySpec``)

    ops: frozenset

    def __call__(self, node) -> CheckpointPolicy:
        op = node.op
        if op in self.ops or _packet(op) in self.ops:
            return MUST_SAVE
        return PREFER_RECOMPUTE

    def __repr__(self) -> str:
        if self.ops == frozenset(MATMUL_OPS):
            return "save_matmuls()"
        return f"save_ops({', '.join(sorted(str(o) for o in self.ops))})"


@dataclass(frozen=True)
class SaveNames(Held):
    """Keep the results labelled with ``tracedac.name(tensor, label)`` for one of these labels."""

    structural = True  # decides from the op and the labels alone (``spec.PolicySpec``)

    names: frozenset

    @property
    def labels(self) -> frozenset:  # the labels it asks for (``spec.PolicySpec.labels``)
        return self.names

    def __call__(self, node) -> CheckpointPolicy:
        return MUST_SAVE if node.labels & self.names else PREFER_RECOMPUTE

    def __repr__(self) -> str:
        return f"save_names({', '.join(repr(n) for n in sorted(self.names))})"


@dataclass(frozen=True)
class OffloadOps(Held):
    """Offload the results of these ops to host memory (an overload, or every overload of a packet)."""

    # (decides from the op alone, but a region that offloads records every call: the warm path
    # does not move host copies, ``spec.PolicySpec``)
    structural = False

    ops: frozenset

    def __call__(self, node) -> CheckpointPolicy:
        op = node.op
        if op in self.ops or _packet(op) in self.ops:
            return MUST_CPU_OFFLOAD
        return PREFER_RECOMPUTE

    def __repr__(self) -> str:
        return f"offload_ops({', '.join(sorted(str(o) for o in self.ops))})"


@dataclass(frozen=True)
class OffloadNames(Held):
    """Offload the results labelled with ``tracedac.name(tensor, label)`` for one of these labels."""

    structural = False  # (as OffloadOps: a region that offloads records every call)

    names: frozenset

    @property
    def labels(self) -> frozenset:  # the labels it asks for (``spec.PolicySpec.labels``)
        return self.names

    def __call__(self, node) -> CheckpointPolicy:
        return MUST_CPU_OFFLOAD if node.labels & self.names else PREFER_RECOMPUTE

    def __repr__(self) -> str:
        return f"offload_names({', '.join(repr(n) for n in sorted(self.names))})"


_MUSTS = (MUST_SAVE, MUST_RECOMPUTE, MUST_CPU_OFFLOAD)


@dataclass(frozen=True)
class Either(Held):
    """Keep what any of the policies keeps; a MUST from one overrides a PREFER from another.
    Of PREFERs, an offload beats a save (both keep; the offload was asked for by name)."""

    structural = True  # as structural as its policies, all of them (``spec.PolicySpec``)

    policies: tuple

    @property
    def planner(self):
        """The whole-graph planner among the policies (bound by the others' MUSTs), or None."""
        return next((p for p in self.policies if isinstance(p, Planner)), None)

    def __call__(self, node) -> CheckpointPolicy:
        decisions = [decision(p, node) for p in self.policies]
        musts = {d for d in decisions if d in _MUSTS}
        if len(musts) > 1:
            said = ", ".join(f"{p!r} -> {d.name}" for p, d in zip(self.policies, decisions))
            what = {MUST_SAVE: "keep it", MUST_RECOMPUTE: "replay it", MUST_CPU_OFFLOAD: "offload it"}
            asked = " and another must ".join(what[d] for d in _MUSTS if d in musts)
            raise CheckpointError(
                f"policies disagree on {node.name} (node {node.index}): {said}. One must {asked}, "
                "and there is no way to do both; drop one of the MUST decisions or make it a PREFER."
            )
        if musts:
            return musts.pop()
        for d in (PREFER_CPU_OFFLOAD, PREFER_SAVE):
            if d in decisions:
                return d
        return PREFER_RECOMPUTE

    def __repr__(self) -> str:
        return f"either({', '.join(repr(p) for p in self.policies)})"


@interning
def recompute_all() -> RecomputeAll:
    """The default: keep nothing computed in the region; replay what backward needs."""
    return RecomputeAll()


@interning
def save_all() -> SaveAll:
    """Keep everything autograd saves, as without checkpointing."""
    return SaveAll()


@interning
def save_ops(*ops) -> SaveOps:
    """Keep the results of these ops, e.g. ``save_ops(torch.ops.aten.mm, torch.ops.aten.bmm.default)``."""
    return SaveOps(_ops("save_ops", ops))


@interning
def save_matmuls() -> SaveOps:
    """Keep matmul and attention results (``MATMUL_OPS``); replay the cheap ops around them."""
    return SaveOps(frozenset(MATMUL_OPS))


@interning
def save_names(*labels: str) -> SaveNames:
    """Keep the results labelled by ``tracedac.name(tensor, label)`` with one of these labels."""
    return SaveNames(_labels("save_names", labels))


def _ops(factory: str, ops) -> frozenset:
    if not ops:
        raise ValueError(f"{factory}() needs at least one op, e.g. {factory}(torch.ops.aten.mm)")
    for op in ops:
        if not isinstance(op, (OpOverload, OpOverloadPacket)):
            hint = ""
            if isinstance(op, str):
                hint = (
                    f" For {op!r}, pass torch.ops.aten.{op} (every overload) or torch.ops.aten.{op}.default."
                )
            elif callable(op):
                name = getattr(op, "__name__", repr(op))
                hint = f" {name} is a Python function; pass the aten op it runs, e.g. torch.ops.aten.{name}."
            raise TypeError(
                f"{factory}() takes aten ops (torch.ops.aten.mm or torch.ops.aten.mm.default), "
                f"got {op!r} of type {type(op).__name__}.{hint}"
            )
    return frozenset(ops)


def _labels(factory: str, labels) -> frozenset:
    if not labels:
        raise ValueError(f"{factory}() needs at least one label, e.g. {factory}('attn_out')")
    for label in labels:
        if not isinstance(label, str) or not label:
            raise TypeError(f"{factory}() takes non-empty strings, got {label!r}")
    return frozenset(labels)


@interning
def offload_ops(*ops) -> OffloadOps:
    """Copy the results of these ops to host memory in the forward and back in backward,
    e.g. ``offload_ops(torch.ops.aten.mm)`` (``MUST_CPU_OFFLOAD``; see ``tracedac.offload``)."""
    return OffloadOps(_ops("offload_ops", ops))


@interning
def offload_names(*labels: str) -> OffloadNames:
    """Offload to host memory the results labelled by ``tracedac.name(tensor, label)`` with one
    of these labels (``MUST_CPU_OFFLOAD``)."""
    return OffloadNames(_labels("offload_names", labels))


@interning
def either(*policies) -> Either:
    """Keep what any of ``policies`` keeps, e.g. ``either(save_matmuls(), save_names('x'))``."""
    if not policies:
        raise ValueError("either() needs at least one policy")
    flat = []
    for p in policies:
        check_policy(p)
        if getattr(p, "offloads_inputs", False) is True:  # offload_inputs(...)
            raise ValueError(
                f"either() got {p!r}: offload_inputs() moves the region's inputs, not an op's result, "
                "and applies to the region's whole policy. Put either() inside instead: "
                "offload_inputs(either(...))."
            )
        if getattr(p, "offloads_kept", False) is True and p.planner is not None:  # offload_kept(planner)
            raise ValueError(
                f"either() got {p!r}: what a planner inside offload_kept() keeps is offloaded, and "
                "either() would lose that. Put either() inside instead: offload_kept(either(...))."
            )
        flat.extend(p.policies if isinstance(p, Either) else (p,))
    planners = [p for p in flat if isinstance(p, Planner)]
    if len(planners) > 1:
        raise ValueError(
            f"either() got {len(planners)} whole-graph planners ({', '.join(map(repr, planners))}); a "
            "region is planned by one. Keep one planner and combine it with per-op policies."
        )
    return Either(tuple(flat))
