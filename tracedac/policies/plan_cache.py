"""The plan cache: a planner's plan, made once for a region's structure and reused.

A plan is made when a region's graph is first recorded and cached by the graph's structure
(each node's op, output shapes and dtypes, and which values it read): on later calls the
region decides each node as it records it (``Planning``), so it never holds more than the
plan keeps. A structure that differs from the cached one (a new shape) is planned again.
The cache is bounded (least recently used out) and its keys hold no tensor of a call.
"""

from __future__ import annotations

import functools
import types
from collections import OrderedDict

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

from ..record.decisions import (
    MUST_RECOMPUTE,
    MUST_SAVE,
    PREFER_CPU_OFFLOAD,
    PREFER_RECOMPUTE,
    PREFER_SAVE,
    is_offload,
)
from ..record.graph import Node
from .planners import Planner, must_decisions, problem, region_values

__all__ = ["PlanCache", "Planning", "computation", "input_signature", "plan_key", "plans", "signature"]


def signature(node: Node) -> tuple:
    """What a cached plan must agree on for this node: op, outputs and the values it read."""
    return (
        node.op,
        tuple(None if o is None else (o.size, o.dtype) for o in node.outputs),
        tuple((m.group, m.state) for m in node.tensor_args),
        node.writes,
    )


class PlanCache:
    """Plans by (policy, code, inputs), each checked node by node against the structure
    recorded; least recently used first out."""

    def __init__(self, size: int = 256):
        self.size = size
        self.entries: OrderedDict = OrderedDict()
        self.made = 0  # plans computed (not found), for tests and reports

    def get(self, key):
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
        return entry

    def put(self, key, signatures: tuple, keep: frozenset, context: tuple, offload=frozenset()) -> None:
        self.entries[key] = (signatures, keep, context, offload)
        self.entries.move_to_end(key)
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)


plans = PlanCache()


def input_signature(args, kwargs) -> tuple:
    return (
        tuple(_signature(a) for a in args),
        tuple((k, _signature(v)) for k, v in sorted((kwargs or {}).items())),
        torch.is_autocast_enabled(),
    )


def _signature(a):
    # (a module function: a closure calling itself is a reference cycle, garbage at every call)
    if isinstance(a, torch.Tensor):
        return (a.shape, a.dtype, a.device, a.requires_grad)
    if isinstance(a, (list, tuple)):
        return tuple(_signature(x) for x in a)
    return type(a)


class Planning:
    """A region's side of planning: decides nodes from a cached plan while recording, and
    plans at the region's end when there was none (or the structure changed). Plans keep
    storages, not nodes: of an op with several results (``native_layer_norm``'s output,
    mean and rstd) ``min_cut`` may keep some and not others.

    A policy's offload decision (MUST or PREFER) is fixed like a MUST: the planner plans around
    it (on the host: no device bytes, and replay may start from it). A planner made with
    ``offload`` chooses offloads of its own (``Planner.place``): those nodes are decided
    ``PREFER_CPU_OFFLOAD``, copied to the host when autograd saves them (a cached plan) or at
    the region's end (a plan made there), or there if only replay reads them. With
    ``offload`` here (``policies.offload_kept``) what the plan keeps is offloaded instead
    (``PREFER_CPU_OFFLOAD``)."""

    def __init__(self, planner: Planner, key, offload: bool = False):
        self.planner = planner
        self.key = key
        self.kept_decision = PREFER_CPU_OFFLOAD if offload else PREFER_SAVE
        entry = plans.get(key) if key is not None else None
        self.cached = entry  # (signatures, kept group ids) while the recording agrees with it
        self.keep = entry[1] if entry is not None else frozenset()
        self.offload = entry[3] if entry is not None else frozenset()  # what the plan offloads
        self.signatures: dict[int, tuple] = {}
        self.undecided: set[int] = set()  # nodes recorded with no plan: the region's end decides
        self.from_plan: dict = {}  # node index -> what the cached plan decided (keep or offload)
        self.planned_now = False

    def decide(self, node: Node, d: CheckpointPolicy) -> bool:
        """Decide ``node`` (whose policy said ``d``); whether to hold its result now."""
        if self.key is not None:  # only a cacheable plan is checked and stored by structure
            sig = self.signatures[node.index] = signature(node)
        if d is MUST_SAVE or d is MUST_RECOMPUTE or is_offload(d):
            node.decision = d
            return d is not MUST_RECOMPUTE
        cached = self.cached
        if cached is not None:
            sigs = cached[0]
            if node.index < len(sigs) and sigs[node.index] == sig:
                produced = [node.outputs[k].group for k in node.creates] + list(node.writes)
                if any(g in self.keep for g in produced):
                    node.decision = self.from_plan[node.index] = self.kept_decision
                    return self.planner.holds_unsaved
                if any(g in self.offload for g in produced):
                    # held, and copied to the host when saved (or at the end, for replay)
                    node.decision = self.from_plan[node.index] = PREFER_CPU_OFFLOAD
                    return self.planner.holds_unsaved
                node.decision = PREFER_RECOMPUTE
                return False
            self.cached = None  # a different structure: plan again at the end
        node.decision = PREFER_SAVE  # for now: the region's end decides
        self.undecided.add(node.index)
        return self.planner.holds_unsaved

    def keeps(self, g) -> bool:
        """Whether to hold storage ``g`` (its last writer decided SAVE) for now."""
        node = g.node
        if node.decision is MUST_SAVE or node.index in self.undecided:
            return True
        return node.decision is not MUST_RECOMPUTE and g.id in self.keep

    def finish(self, region) -> None:
        """Make the plan if none applied, then release what it does not keep.

        A cached plan applies only if, beyond the ops, autograd saved the same values and the
        policy's MUST decisions are the same: a plan is chosen for what backward needs, and
        two calls with equal ops can differ there (a frozen weight, a labelled tensor)."""
        graph = region.graph
        kept_slots = [s for s in region.kept if not s.exact]
        wanted = region_values(graph, graph.slots()) | region_values(graph, kept_slots)
        kept_slots = [s for s in kept_slots if s.host is None]  # offloaded: not the planner's
        # The policy's own MUST and offload decisions, not the offloads the cached plan made
        # while recording (a label given after the op may still make one a MUST): counted as
        # the policy's, they made every cached plan of a planner that offloads (memory_budget(...,
        # offload=...), offload_kept) look stale, and the plan made again took its own offloads
        # as given, so from the next step on nothing was offloaded and those values were replayed.
        ours = self.from_plan
        fixed = tuple((i, d) for i, d in must_decisions(graph).items() if ours.get(i) is not d)
        context = (frozenset(wanted), fixed)
        cached = self.cached
        if (
            cached is not None
            and not self.undecided
            and len(cached[0]) == len(graph.nodes)
            and cached[2] == context
        ):
            return  # decided while recording
        self.planned_now = True
        plans.made += 1
        groups = graph.groups
        live = {s.meta.group for s in kept_slots} | {g.id for g in groups if g.held is not None}
        held = [g.id for g in groups if g.held is not None and g.node is not None]
        keep, offload = self.planner.place(problem(graph, wanted, live, held))
        keep, offload = {g for g in keep if g in live}, {g for g in offload if g in live}
        # Apply: the chosen storages stay; everything else held for the plan is let go.
        for node in graph.nodes:
            d = node.decision
            if d is not MUST_SAVE and d is not MUST_RECOMPUTE and not is_offload(d):
                node.decision = PREFER_RECOMPUTE
        for g in groups:
            node = g.node
            if node is None or node.decision is MUST_SAVE or is_offload(node.decision):
                continue
            if g.id in keep:
                node.decision = self.kept_decision  # (offloaded by the region's end, if that)
            elif g.id in offload:
                node.decision = PREFER_CPU_OFFLOAD  # held until the region's end moves it to the host
            else:
                g.held = None
        still = []
        for s in region.kept:
            g = groups[s.meta.group]
            if (
                s.exact
                or s.host is not None
                or g.id in keep
                or g.id in offload
                or g.node.decision is MUST_SAVE
            ):
                still.append(s)
            else:
                s.release()  # autograd's handle now rebuilds its value
        region.kept = still
        if self.key is not None:
            sigs = tuple(self.signatures[i] for i in range(len(graph.nodes)))
            plans.put(self.key, sigs, frozenset(keep), context, frozenset(offload))


def plan_key(policy, code, module, args, kwargs):
    """What a cached plan is looked up by (None: not cacheable): the policy, the code run,
    the module it runs on and the call's inputs. The structure recorded is checked against
    the plan node by node, and what autograd saved against what the plan was made for
    (``Planning.finish``), so the key only has to find the right candidate; it names what
    changes the plan without changing the ops (a frozen parameter is saved by nobody) so
    that layers of one class that differ there do not take turns replacing each other's plan.
    It holds no object of the call: a cache entry must not keep a step's tensors alive."""
    if module is not None:
        params = tuple(p.requires_grad for p in module.parameters())
        module = (type(module), module.training, params)
    key = (policy, code, module, input_signature(args, kwargs))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def computation(fn, args, kwargs):
    """``(code, module, args, kwargs)``: what calling ``fn(*args, **kwargs)`` runs.

    Unwraps ``functools.partial`` (its arguments join the call's) and bound methods, so a
    new ``partial(layer.forward_fn, layer, mask=m)`` each step (Hugging Face's layers) is
    still the same computation: ``code`` is the function's code object (or the type of a
    module or callable object), ``module`` the ``nn.Module`` it runs on, if any: ``fn``
    itself, or the first argument a partial or bound method supplies, which is then taken
    out of ``args`` (the caller's own arguments keep their positions, for messages).
    """
    kwargs = dict(kwargs) if kwargs else {}
    args = tuple(args)
    own = len(args)  # the caller's arguments are the last ``own``
    while True:
        if isinstance(fn, functools.partial):
            args = fn.args + args
            kwargs = {**fn.keywords, **kwargs}
            fn = fn.func
        elif isinstance(fn, types.MethodType):
            args = (fn.__self__,) + args
            fn = fn.__func__
        else:
            break
    if isinstance(fn, nn.Module):
        return type(fn), fn, args, kwargs
    code = getattr(fn, "__code__", None)
    if code is None:
        code = type(fn)  # a builtin or callable object: its type, never the object itself
    if len(args) > own and isinstance(args[0], nn.Module):
        return code, args[0], args[1:], kwargs
    return code, None, args, kwargs
