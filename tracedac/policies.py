"""Policies: which recorded results a region keeps for backward and which it replays.

A policy is any callable ``policy(node) -> CheckpointPolicy`` (torch's own enum, so a
decision reads the same as in ``torch.utils.checkpoint``). The ones here are frozen,
hashable dataclasses, so they compare by value, print as the call that made them, and can
key a cache. A node is a ``tracedac.graph.Node``: ``op``, ``outputs`` (shape, dtype,
nbytes), ``nbytes``, ``labels``, ``module_path``, ``flops``, ``is_random``.

Decisions are made once per node when the region records it, never per tensor later. Only
nodes that allocate or write a storage are asked: views cost nothing to rebuild. The two
planners, ``memory_budget`` and ``min_cut``, decide for the region's whole graph instead
(``tracedac.planners``); ``either`` combines one of them with per-op policies.

Besides keeping and replaying, a result may be offloaded (``MUST_CPU_OFFLOAD``/``PREFER_CPU_OFFLOAD``):
copied to host memory in the forward, brought back in backward (``tracedac.offload``).
``offload_ops`` and ``offload_names`` mirror ``save_ops`` and ``save_names``;
``offload_kept(policy)`` offloads whatever ``policy`` (a planner too) would keep, and
``offload_inputs(policy)`` also the region's inputs that autograd computed (a layer's input).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch._ops import OpOverload, OpOverloadPacket
from torch.utils.checkpoint import CheckpointPolicy

from .collectives import ReplayCollectives, replay_collectives  # noqa: F401 (re-exported)
from .decisions import (  # noqa: F401 (re-exported: callers found them here first)
    MATMUL_OPS,
    MUST_CPU_OFFLOAD,
    MUST_RECOMPUTE,
    MUST_SAVE,
    PREFER_CPU_OFFLOAD,
    PREFER_RECOMPUTE,
    PREFER_SAVE,
    RECOMPUTE_OPS,
    Held,
    check_policy,
    decision,
    describe_policy,
    is_save,
    recompute_by_default,
)
from .errors import CheckpointError
from .link import Link
from .planners import MemoryBudget, MinCut, Planner
from .wrappers import OffloadInputs, OffloadKept

# decision, is_save, RECOMPUTE_OPS and recompute_by_default live in .decisions (a leaf
# module); they are re-exported here, where callers found them first.
__all__ = [
    "CheckpointPolicy",
    "Link",
    "MATMUL_OPS",
    "RECOMPUTE_OPS",
    "either",
    "memory_budget",
    "min_cut",
    "offload_inputs",
    "offload_kept",
    "offload_names",
    "offload_ops",
    "recompute_by_default",
    "recompute_all",
    "replay_collectives",
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

    constant = PREFER_RECOMPUTE  # the same for every node: a region need not ask

    def __call__(self, node) -> CheckpointPolicy:
        return PREFER_RECOMPUTE

    def __repr__(self) -> str:
        return "recompute_all()"


@dataclass(frozen=True)
class SaveAll(Held):
    """Keep what autograd saves, as without checkpointing (Python still runs once)."""

    constant = PREFER_SAVE

    def __call__(self, node) -> CheckpointPolicy:
        return PREFER_SAVE

    def __repr__(self) -> str:
        return "save_all()"


@dataclass(frozen=True)
class SaveOps(Held):
    """Keep the results of these ops (an overload, or every overload of a packet)."""

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

    names: frozenset

    def __call__(self, node) -> CheckpointPolicy:
        return MUST_SAVE if node.labels & self.names else PREFER_RECOMPUTE

    def __repr__(self) -> str:
        return f"save_names({', '.join(repr(n) for n in sorted(self.names))})"


@dataclass(frozen=True)
class OffloadOps(Held):
    """Offload the results of these ops to host memory (an overload, or every overload of a packet)."""

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

    names: frozenset

    def __call__(self, node) -> CheckpointPolicy:
        return MUST_CPU_OFFLOAD if node.labels & self.names else PREFER_RECOMPUTE

    def __repr__(self) -> str:
        return f"offload_names({', '.join(repr(n) for n in sorted(self.names))})"


_MUSTS = (MUST_SAVE, MUST_RECOMPUTE, MUST_CPU_OFFLOAD)


@dataclass(frozen=True)
class Either(Held):
    """Keep what any of the policies keeps; a MUST from one overrides a PREFER from another.
    Of PREFERs, an offload beats a save (both keep; the offload was asked for by name)."""

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


def recompute_all() -> RecomputeAll:
    """The default: keep nothing computed in the region; replay what backward needs."""
    return RecomputeAll()


def save_all() -> SaveAll:
    """Keep everything autograd saves, as without checkpointing."""
    return SaveAll()


def save_ops(*ops) -> SaveOps:
    """Keep the results of these ops, e.g. ``save_ops(torch.ops.aten.mm, torch.ops.aten.bmm.default)``."""
    return SaveOps(_ops("save_ops", ops))


def save_matmuls() -> SaveOps:
    """Keep matmul and attention results (``MATMUL_OPS``); replay the cheap ops around them."""
    return SaveOps(frozenset(MATMUL_OPS))


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


def offload_ops(*ops) -> OffloadOps:
    """Copy the results of these ops to host memory in the forward and back in backward,
    e.g. ``offload_ops(torch.ops.aten.mm)`` (``MUST_CPU_OFFLOAD``; see ``tracedac.offload``)."""
    return OffloadOps(_ops("offload_ops", ops))


def offload_names(*labels: str) -> OffloadNames:
    """Offload to host memory the results labelled by ``tracedac.name(tensor, label)`` with one
    of these labels (``MUST_CPU_OFFLOAD``)."""
    return OffloadNames(_labels("offload_names", labels))


def offload_kept(policy) -> OffloadKept:
    """Offload to host memory what ``policy`` would keep on the device, e.g.
    ``offload_kept(memory_budget(0.3))`` (what Hugging Face's ``offload=True`` maps to). Inputs
    the region keeps as eager keeps them (arguments, parameters) stay where they are."""
    check_policy(policy)
    if isinstance(policy, OffloadKept):
        return policy
    return OffloadKept(policy)


def offload_inputs(policy=None) -> OffloadInputs:
    """Offload to host memory, at the region's end, the region's inputs autograd computed and
    saved (a decoder layer's input: ``layers x tokens x hidden`` bytes, what dominates memory at
    long sequence lengths under full recompute), as well as whatever ``policy`` offloads
    (default ``recompute_all()``: replay everything else, as Hugging Face's ``offload=True``
    does with torch's checkpoint and ``save_on_cpu``). Leaves stay (parameters, the program's own
    inputs, constants: their owners hold them), and so does an input an enclosing region
    computed (it replays it) or ``tracedac.zero`` gathered (gathered again); a tensor handed to
    several regions is copied by each."""
    if policy is None:
        policy = recompute_all()
    check_policy(policy)
    if isinstance(policy, OffloadInputs):
        return policy
    return OffloadInputs(policy)


def either(*policies) -> Either:
    """Keep what any of ``policies`` keeps, e.g. ``either(save_matmuls(), save_names('x'))``."""
    if not policies:
        raise ValueError("either() needs at least one policy")
    flat = []
    for p in policies:
        check_policy(p)
        if isinstance(p, OffloadInputs):
            raise ValueError(
                f"either() got {p!r}: offload_inputs() moves the region's inputs, not an op's result, "
                "and applies to the region's whole policy. Put either() inside instead: "
                "offload_inputs(either(...))."
            )
        if isinstance(p, OffloadKept) and p.planner is not None:
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


def memory_budget(budget, *, cost="flops", offload=False) -> MemoryBudget:
    """Keep at most ``budget`` and replay as little as possible (an exact 0-1 knapsack).

    ``budget`` is a float fraction in [0, 1] of the bytes the region would keep without
    checkpointing (the tensors it computes that autograd saves; inputs are not counted: they
    are alive anyway), or an int number of bytes. ``cost`` prices replaying a node:
    ``"flops"`` (torch's FLOP formulas; ops without one by the bytes they move), ``"time"``
    (each op's duration, measured while the region records), or a callable ``cost(node)``.

    ``offload=True`` (or ``Link(bandwidth, flop_rate)``; figures left out are measured once per
    device): each tensor is kept, offloaded to host memory or replayed, for the least estimated
    step time within the budget. Replay costs its FLOPs / flop_rate; an offload costs its copy
    out and back (bytes / bandwidth each way), less what the region's forward compute time
    hides (copies overlap compute, each way up to that time); an offloaded tensor holds no
    device bytes. ``Link(bandwidth=0)`` offloads nothing (the plan without offload).
    """
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(
            f"memory_budget() takes a fraction (float in [0, 1]) or a number of bytes (int), got {budget!r}"
        )
    if isinstance(budget, float) and not 0.0 <= budget <= 1.0:
        hint = ""
        if budget > 1:
            n = int(budget)  # bytes are whole: the int the user most likely meant, said once
            hint = f" For {n} bytes, pass an int: memory_budget({n}); for a fraction, a float in [0, 1]."
        raise ValueError(
            f"memory_budget({budget!r}): a float budget is a fraction in [0, 1] of the bytes kept without "
            f"checkpointing.{hint}"
        )
    if isinstance(budget, int) and budget < 0:
        raise ValueError(f"memory_budget({budget}): a number of bytes cannot be negative")
    if isinstance(budget, int) and budget == 1:
        raise ValueError(
            "memory_budget(1) is ambiguous: an int budget is bytes (1 byte), a float a fraction. Pass "
            "1.0 to keep everything, or a number of bytes."
        )
    if not (cost in ("flops", "time") or callable(cost)):
        raise ValueError(
            f"memory_budget(cost={cost!r}): cost is 'flops', 'time' or a callable cost(node) -> number"
        )
    offload = _offload("memory_budget", offload)
    if offload is not False and callable(cost):
        raise ValueError(
            f"memory_budget(cost={cost!r}, offload={offload!r}): a callable cost has no unit of time, and "
            "offload weighs a replay against a copy's time. Use cost='flops' (priced at the device's "
            "FLOP rate) or cost='time' (recorded durations) with offload."
        )
    return MemoryBudget(budget, cost, offload)


def min_cut(*, replay_matmuls: bool = False, offload=False) -> MinCut:
    """Keep the fewest bytes from which everything backward needs can be replayed (a minimum
    cut of the recorded graph, bytes as capacities). Matmuls and attention are not replayed
    unless ``replay_matmuls=True``: then nothing computed need be kept at all.

    ``offload=True`` (or a ``Link``, as for ``memory_budget``): of what the cut keeps, as many
    bytes as the link moves out and back within the region's forward compute time go to host
    memory instead (copies the compute hides: no added estimated step time)."""
    if not isinstance(replay_matmuls, bool):
        raise TypeError(f"min_cut(replay_matmuls=...) takes a bool, got {replay_matmuls!r}")
    return MinCut(replay_matmuls, _offload("min_cut", offload))


def _offload(factory: str, offload):
    """``offload`` checked: False, True (the link measured), or a ``Link``; ``Link()`` is True."""
    if isinstance(offload, Link):
        return True if offload == Link() else offload
    if not isinstance(offload, bool):
        raise TypeError(
            f"{factory}(offload={offload!r}): offload is True (the link and FLOP rate measured on the "
            f"device), False, or tracedac.policies.Link(bandwidth=..., flop_rate=...) with the figures."
        )
    return offload
