"""What a region keeps for backward, for people: ``saved_report`` and ``print_saved``."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from torch import nn

from .checkpoint import Region, reporting, run_region
from .compile.report import compiled_target
from .compile.report import report as compiled_report
from .errors import CheckpointError
from .graph import RegionGraph, human_bytes
from .planners import PREFER_SAVE, planner_of
from .policies import check_policy, describe_policy, recompute_all
from .replay import plan

__all__ = ["SavedReport", "SavedRow", "print_saved", "record", "saved_report"]


@dataclass(frozen=True)
class SavedRow:
    """One storage a region holds after its forward."""

    region: str
    kind: str  # "activation", "input" or "snapshot"
    op: str  # the op that produced the value ("input" for one from outside)
    shape: tuple
    dtype: torch.dtype
    bytes: int  # of the whole storage: that is what stays allocated
    source: str | None  # the user's file:line that ran the op
    module: str | None
    label: str
    why: str


@dataclass
class SavedReport:
    """Every tensor kept for backward after one forward, and what replay will cost."""

    rows: list[SavedRow] = field(default_factory=list)
    replayed_bytes: int = 0  # saved by autograd, not kept: rebuilt in backward
    replay_flops: int = 0  # by torch's FLOP formulas (matmuls, attention, convolutions)
    replay_ops: int = 0

    @property
    def kept_bytes(self) -> int:
        """Bytes computed in the region and kept (activations and copies of written inputs)."""
        return sum(r.bytes for r in self.rows if r.kind != "input")

    @property
    def input_bytes(self) -> int:
        """Bytes of inputs (arguments, parameters, buffers) the region keeps a reference to."""
        return sum(r.bytes for r in self.rows if r.kind == "input")

    def __repr__(self) -> str:
        return (f"SavedReport({len(self.rows)} rows, kept {human_bytes(self.kept_bytes)}, "
                f"replayed {human_bytes(self.replayed_bytes)} in {self.replay_ops} ops)")

    def __str__(self) -> str:
        headers = ("kind", "op", "shape", "dtype", "bytes", "source", "module", "label", "why")
        table = [
            (r.kind, r.op, "x".join(map(str, r.shape)) or "scalar", str(r.dtype).removeprefix("torch."),
             human_bytes(r.bytes), _short(r.source), r.module or "", r.label, r.why)
            for r in self.rows
        ]
        widths = [max([len(h)] + [len(row[i]) for row in table]) for i, h in enumerate(headers)]
        line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
        out = [line(headers), line("-" * w for w in widths)]
        out += [line(row) for row in table]
        out.append("")
        out.append(
            f"kept {human_bytes(self.kept_bytes)} | inputs referenced {human_bytes(self.input_bytes)} | "
            f"replayed in backward {human_bytes(self.replayed_bytes)} "
            f"({self.replay_ops} ops, {self.replay_flops / 1e9:.3f} GFLOP)"
        )
        return "\n".join(out)


def _short(source: str | None) -> str:
    if source is None:
        return ""
    path, _, line = source.rpartition(":")
    return f"{os.path.basename(path)}:{line}"


def _storage_key(t: torch.Tensor):
    return t.untyped_storage()._cdata


def _why(policy: str, planner, node) -> str:
    # In a planned region every PREFER_SAVE is the planner's: the others' MUSTs bind it.
    if planner is not None and node.decision is PREFER_SAVE:
        name = repr(planner)
        return f"kept by {name}" + ("" if name == policy else f" in {policy}")
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
        rows.append(SavedRow(
            graph.name, kind, node.name if node is not None else "input", tuple(t.shape), t.dtype,
            t.untyped_storage().nbytes(), node.source if node is not None else None,
            node.module_path if node is not None else None,
            ", ".join(sorted(node.labels)) if node is not None else "", why,
        ))

    replay = [h for h in region.handles if h.tensor is None]
    for h in region.handles:
        if h.exact:
            add(h.tensor, "input", None, f"{graph.namer(h.tensor)}: autograd saved it")
        elif h.tensor is not None:
            g = graph.groups[h.meta.group]
            node = g.node
            add(h.tensor, "activation", node, _why(policy, planner, node))
    for g in graph.groups:
        if g.held is not None:
            node = g.node
            add(g.held, "activation", node, f"{_why(policy, planner, node)}; replay reads it")
        if g.external is not None:
            add(g.external, "input", None, f"{graph.namer(g.external)}: replay reads it")
        if g.snapshot is not None:
            first = g.mutations[0]
            meta = next(m for m in first.tensor_args if m.group == g.id)
            rows.append(SavedRow(
                graph.name, "snapshot", first.name, tuple(meta.size), meta.dtype,
                g.snapshot.nbytes(), first.source, first.module_path, "",
                "copy of an input taken before this op wrote it: replay reads the old value",
            ))
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
    return isinstance(fn, nn.Module) and any(getattr(m, "_tracedac", None) is not None
                                             for m in fn.modules() if m is not fn)


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
    if policy is not None:
        check_policy(policy)
    spec = getattr(fn, "_tracedac", None)
    with reporting() as regions, torch.enable_grad():
        if spec is None and policy is None and _holds_regions(fn):
            out = fn(*args, **kwargs)
        elif spec is not None and hasattr(spec, "fn"):  # a checkpointed function
            out = run_region(spec.fn, args, kwargs, policy or spec.policy, spec.name)
        elif spec is not None:  # a checkpointed module: run its hooks with the policy asked for
            before = spec.policy
            spec.policy = policy or before
            try:
                out = fn(*args, **kwargs)
            finally:
                spec.policy = before
        else:
            module = fn if isinstance(fn, nn.Module) else None
            names = {id(m): n or type(fn).__name__ for n, m in fn.named_modules()} if module is not None else None
            name = type(fn).__name__ if module is not None else getattr(fn, "__qualname__", repr(fn))
            out = run_region(fn, args, kwargs, policy or recompute_all(), name, module=module, module_names=names)
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
