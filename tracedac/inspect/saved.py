"""What a region keeps for backward, for people: ``saved_report`` and ``print_saved``."""

from __future__ import annotations

import torch
from torch import nn

from ..checkpoint import overriding
from ..errors import CheckpointError
from ..policies import recompute_all
from ..policies.held import describe_policy
from ..policies.planners import planner_of
from ..policies.spec import spec_of
from ..record.decisions import PREFER_CPU_OFFLOAD, PREFER_SAVE, effect
from ..record.graph import RegionGraph
from ..region import Region, reporting, run_region
from ..replay.plan import plan
from .compiled import compiled_target
from .compiled import report as compiled_report
from .report import SavedReport, SavedRow

__all__ = ["SavedReport", "SavedRow", "print_saved", "record", "saved_report"]


def _storage_key(t: torch.Tensor):
    return t.untyped_storage()._cdata


def _why(policy: str, planner, node) -> str:
    what = effect(node.op)
    if what is not None:
        return f"{what}: kept under every policy, never replayed"
    # In a planned region every PREFER_SAVE is the planner's: the others' MUSTs bind it.
    if planner is not None and node.decision is PREFER_SAVE:
        name = repr(planner)
        return f"kept by {name}" + ("" if name == policy else f" in {policy}")
    if node.decision is PREFER_CPU_OFFLOAD and getattr(planner, "offload", False) is not False:
        name = repr(planner)  # a planner that chooses offloads (memory_budget(b, offload=True))
        return f"offloaded by {name}" + ("" if name == policy else f" in {policy}")
    return f"{policy} -> {node.decision.name}"


def _rows(region: Region) -> tuple[list[SavedRow], int, int, int]:
    graph: RegionGraph = region.graph
    policy = describe_policy(graph.policy)
    planner = planner_of(graph.policy)
    rows: list[SavedRow] = []
    seen = set()

    def add(t, kind, node, why):
        key = _storage_key(t)
        if key in seen:
            return
        seen.add(key)
        rows.append(
            SavedRow(
                graph.name,
                kind,
                node.name if node is not None else "input",
                tuple(t.shape),
                t.dtype,
                t.untyped_storage().nbytes(),
                node.source if node is not None else None,
                node.module_path if node is not None else None,
                ", ".join(sorted(node.labels)) if node is not None else "",
                why,
            )
        )

    def offloaded(copy, meta, node, why):
        """A host copy's row; ``node`` None: of an input (``offload_inputs``)."""
        key = ("host", id(copy))
        if key in seen:
            return
        seen.add(key)
        shape, dtype = (tuple(meta.size), meta.dtype) if meta is not None else ((copy.nbytes,), torch.uint8)
        rows.append(
            SavedRow(
                graph.name,
                "offloaded",
                node.name if node is not None else "input",
                shape,
                dtype,
                copy.nbytes,
                node.source if node is not None else None,
                node.module_path if node is not None else None,
                ", ".join(sorted(node.labels)) if node is not None else "",
                f"{why}; in host memory until backward",
            )
        )

    replay = [h for h in region.handles if h.tensor is None and h.host is None]
    for h in region.handles:
        if h.exact and h.host is not None:  # an input offloaded (``offload_inputs``)
            offloaded(h.host, h.meta, None, f"an input autograd saved, offloaded by {policy}")
        elif h.exact:
            add(h.tensor, "input", None, f"{graph.namer(h.tensor)}: autograd saved it")
        elif h.tensor is not None:
            g = graph.groups[h.meta.group]
            node = g.node
            add(h.tensor, "activation", node, _why(policy, planner, node))
        elif h.host is not None:
            node = graph.groups[h.meta.group].node
            offloaded(h.host, h.meta, node, _why(policy, planner, node))
    for g in graph.groups:
        if g.host is not None and g.node is None:  # an input offloaded (``offload_inputs``)
            meta = next((s.meta for s in region.handles if s.host is g.host), None)
            offloaded(g.host, meta, None, f"an input offloaded by {policy}; replay reads it")
        elif g.host is not None:
            node = g.node
            metas = (*node.outputs, *node.tensor_args)
            meta = next((m for m in metas if m is not None and m.group == g.id), None)
            offloaded(g.host, meta, node, f"{_why(policy, planner, node)}; replay reads it")
        if g.held is not None:
            node = g.node
            add(g.held, "activation", node, f"{_why(policy, planner, node)}; replay reads it")
        if g.external is not None:
            add(g.external, "input", None, f"{graph.namer(g.external)}: replay reads it")
        if g.snapshot is not None:
            first = g.mutations[0]
            meta = next(m for m in first.tensor_args if m.group == g.id)
            rows.append(
                SavedRow(
                    graph.name,
                    "snapshot",
                    first.name,
                    tuple(meta.size),
                    meta.dtype,
                    g.snapshot.nbytes(),
                    first.source,
                    first.module_path,
                    "",
                    "copy of an input taken before this op wrote it: replay reads the old value",
                )
            )
    replayed = {}
    for h in replay:
        g = graph.groups[h.meta.group]
        if g.creator is not None or g.mutations:  # not a view of an input: that is no replay
            replayed[g.id] = g.nbytes
    p = plan(graph, [(h.meta.group, h.meta.state) for h in replay]) if replay else None
    flops = sum(graph.nodes[i].flops for i in p.nodes) if p else 0
    return rows, sum(replayed.values()), flops, len(p.nodes) if p else 0


def _holds_regions(fn) -> bool:
    """Whether ``fn`` is a module with tracedac-checkpointed modules inside."""
    return isinstance(fn, nn.Module) and any(
        getattr(m, "_tracedac", None) is not None for m in fn.modules() if m is not fn
    )


def record(fn, args, kwargs, policy) -> tuple[list[Region], object]:
    """Run ``fn``'s forward once in report mode; the regions it made (whole graphs kept) and
    its output.

    ``fn`` may be a plain function or module (run in one region under ``policy``, default
    ``recompute_all()``), or something already checkpointed by tracedac (run under its own
    policy, or ``policy`` if given). Regions nested inside are recorded too. A module that is
    not checkpointed but holds checkpointed modules (``tracedac.wrap(model, Block)``) runs as
    it is when no ``policy`` is given: its own regions are what it keeps, not one region
    around it that would recompute everything between them too.
    """
    asked = None if policy is None else spec_of(policy)
    made = getattr(fn, "_tracedac", None)  # what checkpoint() or wrap() set up
    with reporting() as regions, torch.enable_grad():
        if made is None and policy is None and _holds_regions(fn):
            out = fn(*args, **kwargs)
        elif made is not None and hasattr(made, "fn"):  # a checkpointed function
            out = run_region(made.fn, args, kwargs, asked or made.spec, made.name)
        elif made is not None and asked is not None:  # a checkpointed module, under the policy asked for
            with overriding(made, asked):
                out = fn(*args, **kwargs)
        elif made is not None:  # a checkpointed module (or an integration's state), as it is
            out = fn(*args, **kwargs)
        else:
            module = fn if isinstance(fn, nn.Module) else None
            names = (
                {id(m): n or type(fn).__name__ for n, m in fn.named_modules()} if module is not None else None
            )
            name = type(fn).__name__ if module is not None else getattr(fn, "__qualname__", repr(fn))
            spec = asked or spec_of(recompute_all())
            out = run_region(fn, args, kwargs, spec, name, module=module, module_names=names)
    return regions, out


def saved_report(fn, *args, policy=None, **kwargs) -> SavedReport:
    """Run ``fn(*args, **kwargs)`` forward once and report every tensor kept for backward.

    ``fn`` may be a plain function or module (run in one region under ``policy``, default
    ``recompute_all()``), or something already checkpointed by tracedac (run under its own
    policy, or ``policy`` if given). Regions nested inside are reported too; a module holding
    checkpointed modules (``tracedac.wrap``) runs as it is when no ``policy`` is given. For a
    ``torch.compile`` result, the rows are what the compiled graph saves for backward
    (``tracedac.compile.report``: torch's min-cut partition, as ``aot_eager_decomp_partition``
    makes it).
    """
    target = compiled_target(fn)
    if target is not None:  # a torch.compile result: what its compiled graph saves
        if policy is not None:
            raise CheckpointError(
                "saved_report(policy=...) does not apply to a torch.compile'd callable: its regions' "
                "own policies decide what the compiled graph saves. Drop policy=, or pass the "
                "uncompiled callable to see the eager recording under that policy."
            )
        return compiled_report(target, *args, **kwargs)
    regions, out = record(fn, args, kwargs, policy)
    report = SavedReport()
    for region in regions:
        rows, replayed, flops, ops = _rows(region)
        report.rows.extend(rows)
        report.replayed_bytes += replayed
        report.replay_flops += flops
        report.replay_ops += ops
    del out
    return report


def print_saved(fn, *args, policy=None, **kwargs) -> SavedReport:
    """Print ``saved_report(fn, *args, policy=policy, **kwargs)`` as a table; return it."""
    report = saved_report(fn, *args, policy=policy, **kwargs)
    print(report)
    return report
