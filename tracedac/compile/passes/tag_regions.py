"""The joint-graph pass that writes each compiled region's policy or planner as the partitioner's tags.

Requires: a joint graph before partitioning, its region's forward nodes annotated
``meta["custom"]["tracedac_region"] = key`` (``vocab.ANNOTATION``) with ``key`` in
``vocab.SPECS``, each region call entered by a ``tracedac::region(key)`` node
(``vocab.MARK``; ``entry.py`` writes both), and a ``tracedac::label`` node per
``tracedac.name`` call. ZeRO-3's gathers, if any, already carry their cast
(``gather_cast`` runs first: the casts it removes are never tagged, and a region decides on
the gather the graph will run) and are not yet split (``gather_prefetch`` runs after: it
copies the tags written here to both halves of a gather).

Provides: ``tag_regions(gm) -> gm`` adds no node. It removes every ``tracedac::region`` node
(each starts a new region call) and every ``tracedac::label`` node (its label goes to
``meta["tracedac_labels"]`` (``vocab.LABELS``) of the node that produced the named value, and
its users read that value instead). It then writes, on every annotated forward node:

- ``meta["recompute"]`` (and ``meta["tracedac_decision"]``, ``vocab.DECISION``): the
  region's decision. A node whose result the region keeps and backward reads (directly, or
  to replay something else) is ``MUST_SAVE``; a kept result nothing reads is
  ``PREFER_SAVE`` (the partitioner may drop it), but a collective's (``decisions.effect``)
  is ``MUST_SAVE`` whatever reads it: never recomputed; the rest keep the policy's RECOMPUTE
  decision. Views and ``getitem`` are ``PREFER_RECOMPUTE`` (free to rebuild
  from their base), or their base's decision for ``getitem``.
- ``meta["ac_graph_id"]``: one id per region call (a run of consecutive forward nodes
  with one key), increasing in graph order, as torch's own checkpoint numbers them.

A value the region replays that is made from no tensor and draws no random number (``iota``,
``full``) gets no ``ac_graph_id``: the partitioner rebuilds it where it is read (``_free_to_rebuild``).

Torch's min-cut partitioner then saves the MUST_SAVE nodes and what regions read from
outside, and replays the rest in backward (random ops with their generator state: torch
functionalizes recomputed RNG ops). Running it twice gives the same tags.
"""

from __future__ import annotations

import operator
import warnings

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..._compat import mutated_inputs
from ...errors import CheckpointError
from ...policies.min_cut import min_cut_keep
from ...policies.planners import MemoryBudget, closure, problem
from ...policies.spec import spec_of
from ...record.decisions import (
    MUST_RECOMPUTE,
    MUST_SAVE,
    PREFER_RECOMPUTE,
    PREFER_SAVE,
    effect,
    is_offload,
    is_save,
    resolve,
)
from ..fx_graph import build
from ..vocab import DECISION, LABELS, MARK, SPECS, backward_nodes, region_key

__all__ = ["tag_regions"]


def _fold_names(graph: torch.fx.Graph) -> dict:
    """Remove ``tracedac.name`` nodes; their labels onto the producer. fx node -> labels."""
    op = torch.ops.tracedac.label.default
    for n in list(graph.find_nodes(op="call_function", target=op)):
        src, label = n.args
        src.meta[LABELS] = frozenset(src.meta.get(LABELS, frozenset()) | {label})
        n.replace_all_uses_with(src)
        graph.erase_node(n)
    return {n: n.meta[LABELS] for n in graph.nodes if LABELS in n.meta}


def _region_runs(graph: torch.fx.Graph, backward: set) -> list[tuple[str, list]]:
    """(key, forward nodes) per region call: consecutive annotated forward nodes with one key."""
    runs: list[tuple[str, list]] = []
    current = None
    for n in graph.nodes:
        if n.op != "call_function" or n in backward:
            continue
        if n.target is MARK:  # a region's entry: a new call, even of the region just left
            current = None
            continue
        key = region_key(n)
        if key is None:
            if n.meta.get("val") is not None and not isinstance(n.meta.get("val"), (torch.SymInt, int)):
                current = None  # an op outside every region separates two calls of one region
            continue
        if current is None or current[0] != key:
            current = (key, [])
            runs.append(current)
        current[1].append(n)
    return runs


def untagged_saved(gm: torch.fx.GraphModule) -> set | None:
    """Names of the forward nodes torch's partitioner saves from ``gm`` without any region's
    tags (what the graph keeps compiled without checkpointing), or None if it cannot tell."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    primals = [n for n in graph.nodes if n.op == "placeholder" and n.name.startswith("primals")]
    outputs = graph.output_node().args[0]
    if not primals or len(outputs) <= len(primals):
        return None
    for n in graph.nodes:
        n.meta.pop("recompute", None)
        n.meta.pop("ac_graph_id", None)
    try:
        # the joint graph's outputs: the forward's, then one gradient per primal input
        _, bw = min_cut_rematerialization_partition(
            torch.fx.GraphModule(gm, graph),
            None,
            compiler="inductor",
            num_fwd_outputs=len(outputs) - len(primals),
        )
    except Exception:  # noqa: BLE001 (an estimate: the caller falls back to the min cut)
        return None
    return {n.name for n in bw.graph.find_nodes(op="placeholder") if not n.name.startswith("tangents")}


_WARNED: set = set()
_WITH_EFFECTS = torch.ops.higher_order.with_effects


def _warn_opaque(key: str, nodes: list) -> None:
    """A higher-order op in a region (``invoke_subgraph`` from ``nested_compile_region``, a
    ``flex_attention``...) is one node whose inside no policy sees: say so, once per region
    and op. Gradients stay exact; what it saves is the partitioner's default (a
    PREFER_RECOMPUTE tag: usually replayed whole in backward). ``with_effects`` is no such
    op: it threads an effect token through one op (a ``print``, zero's ``release``), which the
    partitioner keeps in the forward, and holds nothing a policy would decide on."""
    for n in nodes:
        if isinstance(n.target, torch._ops.HigherOrderOperator) and n.target is not _WITH_EFFECTS:
            name = getattr(n.target, "_name", None) or str(n.target)
            if (key, name) not in _WARNED:
                _WARNED.add((key, name))
                warnings.warn(
                    f"tracedac: region {key.split('|')[0]!r} contains {name}, a higher-order op: its policy "
                    f"({key.split('|', 1)[-1]}) decides nothing inside it, and the compiled backward replays "
                    "it whole. Gradients are exact. To apply the policy inside, call the function without "
                    "nested_compile_region (or checkpoint inside it).",
                    stacklevel=2,
                )


def _decide(view, policy, wanted: set, baseline: set | None = None, later=lambda n: False) -> None:
    """``node.decision`` for every node of the region's graph, as an eager region decides.
    ``later(n)``: whether fx node ``n`` belongs to a region after this one."""
    graph = view.graph
    spec = spec_of(policy)
    planner = spec.planner
    if spec.replays_collectives:
        raise CheckpointError(
            f"region {graph.name!r} runs under torch.compile with {policy!r}: replaying collectives is "
            "eager only (a compiled region keeps every collective: torch's partitioner would recompute "
            "one with no check that every rank does the same). Compile it with the policy inside "
            "replay_collectives(...), or run the region eagerly."
        )
    if spec.offloads_inputs:
        _refuse_offload(graph.name, policy, None, "its inputs (offload_inputs)")
    for node in graph.nodes:
        node.decision = resolve(spec, node)
        if is_offload(node.decision):
            _refuse_offload(graph.name, policy, node)
    if planner is None:
        return
    compiled = getattr(planner, "compiled_budget", None)  # policies.peak: the eager plan's bytes
    if compiled is not None:
        planner = MemoryBudget(compiled(graph.name))
    if getattr(planner, "offload", False) is not False:  # it would choose offloads: refused as they are
        _refuse_offload(graph.name, policy, None)
    for node in graph.nodes:
        if node.decision is not MUST_SAVE and node.decision is not MUST_RECOMPUTE:
            node.decision = None  # the planner's to decide
    if isinstance(planner, MemoryBudget) and baseline is not None:
        # A fraction is of what the region keeps compiled without checkpointing, and the
        # choice is among those values too: torch's partitioner saves the inputs of cheap
        # chains and replays the chains, so what it saves suffices for backward at a replay
        # of cheap ops only. Choosing among every value backward reads instead (eager's
        # measure) let the knapsack spend the bytes on cheap values and replay matmuls:
        # measured on the bench's --quick MoE at memory_budget(1.0), 0.39x the bytes of no
        # checkpoint and 0.65 MFLOP of matmuls replayed, where torch replayed none.
        base = set()
        for n, m in view.values.items():  # a saved view or getitem stands for its base's storage
            if n.name in baseline:
                base.update(
                    (x.group, 0)
                    for x in (m if isinstance(m, tuple) else (m,))
                    if x is not None and graph.groups[x.group].creator is not None
                )
        # Priced on what backward really reads (``wanted``, which the tags make the
        # partitioner rebuild from what is kept: a residual sum its layer norm's backward
        # reads is rebuilt through the projection before it), chosen among both.
        p = problem(graph, base | wanted)
        p.wanted = set(wanted)  # the items are both; what replay must rebuild is what backward reads
        p.full = sum(graph.groups[g].nbytes for g in {g for g, _ in base})
    else:
        p = problem(graph, wanted)
    if isinstance(planner, MemoryBudget):
        # Without the untagged partition (it failed), the least that can be kept without
        # replaying a matmul (a min cut) stands in for what the region keeps compiled.
        if baseline is None:
            keep, _, _ = min_cut_keep(graph, wanted)
            p.full = min(p.full, sum(graph.groups[g].nbytes for g in keep))
        # What a later region reads of this one the partitioner saves at the boundary: out
        # of the budget too.
        boundary = {
            g.id
            for g in graph.groups
            if g.creator is not None
            and g.id in view.group_fx
            and any(later(u) for u in view.group_fx[g.id].users)
        }
        p.items = [g for g in p.items if g not in boundary]  # kept whatever the plan: not a choice
        p.reserved += sum(graph.groups[g].nbytes for g in boundary - p.kept_anyway)
        p.kept_anyway |= boundary
    keep = planner.choose(p)
    if keep and spec.offloads_kept:  # offload_kept(planner): what it keeps leaves the device
        _refuse_offload(graph.name, policy, graph.groups[min(keep)].node)
    for g in graph.groups:
        node = g.creator
        if node is not None and node.decision is None:
            node.decision = PREFER_SAVE if g.id in keep else PREFER_RECOMPUTE
    for node in graph.nodes:
        if node.decision is None:  # produced nothing a plan chooses among
            node.decision = PREFER_RECOMPUTE


def _refuse_offload(name: str, policy, node, what: str | None = None) -> None:
    """torch's partitioner reads MUST_SAVE and the RECOMPUTE tags only: a CPU_OFFLOAD tag would
    be saved on the device as if kept (torch 2.13 offloads only behind a testing flag,
    ``torch._functorch.config.enable_activation_offloading``, and never by tag). Refused, so
    that no plan silently keeps on the device what was to leave it. ``node`` None: a planner
    made with ``offload=``, refused whatever its plan would be (or ``what`` it offloads)."""
    if what is None:
        what = node.name if node is not None else "what its plan chooses to (a planner made with offload=)"
    raise CheckpointError(
        f"offload under torch.compile is not supported by torch {torch.__version__}'s partitioner; use "
        f"eager or a keep/replay policy (region {name!r}, policy {policy!r} asks to offload "
        f"{what}). torch's partitioner does not act on CPU_OFFLOAD tags: they would be kept on "
        "the device. Run this region eagerly (outside torch.compile) to offload, or compile it with "
        "a policy that keeps or replays (save_ops, save_names, memory_budget without offload=)."
    )


def _tag(view, wanted: set, ac_graph_id: int, nodes: list) -> None:
    graph = view.graph
    saved = {g.id for g in graph.groups if g.creator is not None and is_save(g.creator.decision)}
    # What backward reads of the saved values: directly, or to replay what is not saved.
    replayed = closure(graph, wanted, saved)
    read = {gid for gid, _ in wanted} | {m.group for i in replayed for m in graph.nodes[i].tensor_args}
    for node in graph.nodes:
        n = view.fx_of[node.index]
        d = node.decision
        if is_save(d) and effect(node.op) is None:  # a collective stays MUST_SAVE: never recomputed
            d = MUST_SAVE if any(o is not None and o.group in read for o in node.outputs) else PREFER_SAVE
        n.meta["recompute"] = n.meta[DECISION] = d
        n.meta["ac_graph_id"] = ac_graph_id
    for n in nodes:
        if "recompute" not in n.meta or n.meta.get("ac_graph_id") != ac_graph_id:
            base = n.args[0] if n.target is operator.getitem else None
            n.meta["recompute"] = (
                base.meta.get("recompute", PREFER_RECOMPUTE) if base is not None else PREFER_RECOMPUTE
            )
            n.meta["ac_graph_id"] = ac_graph_id
    for n in nodes:
        # A multi-output op's tuple cannot be saved, only its getitems, and inductor's
        # partitioner replays only ops on its allowlist (not topk): an op MUST_SAVE with a
        # getitem to recompute had no partition ("cannot save: non-tensor output", met at the
        # bench's default size under inductor). The getitem may then be saved (PREFER_SAVE).
        if (
            n.target is operator.getitem
            and n.args[0].meta.get("recompute") is MUST_SAVE
            and not is_save(n.meta.get("recompute"))
        ):
            n.meta["recompute"] = n.meta[DECISION] = PREFER_SAVE
        elif _free_to_rebuild(n):
            del n.meta["ac_graph_id"]


def _save_what_reads_a_written_input(graph: torch.fx.Graph, run_of: dict, runs: list, backward: set) -> None:
    """A region's op reading an input the graph writes in place (a buffer: a token counter, an
    expert bias, running statistics, updated in the region and read there) is ``MUST_SAVE``.

    Compiled, the input is written during the forward, and a replay in backward reading it
    reads the new value. Under inductor (the write is a ``copy_`` in the graph) the replay
    silently computes from it: ``bias.add_(m); (x + bias)`` replayed adds ``m`` twice, and
    ``(x * bias.tanh()); bias.add_(m)`` differentiates at the written bias, both wrong
    gradients that torch's compiled checkpoint returns. Under ``aot_eager`` (the write copied
    in after the forward) autograd refuses the saved input as "modified by an inplace
    operation". Saving the region's first op on the input instead leaves replay nothing of
    the input to read: eager tracedac, which replays from a copy taken before the write, keeps
    as much. Only an op whose value backward reads, directly or through what it replays, is
    tagged (the partitioner without min cut saves every ``MUST_SAVE``). An op the policy says
    ``MUST_RECOMPUTE`` there is refused: it cannot be replayed right."""
    written = mutated_inputs(graph)
    read = _read_by_backward(graph, backward) if written else set()
    for p in written:
        for n in _readers(p):
            if n not in run_of or n not in read:
                continue
            if n.meta.get("recompute") is MUST_RECOMPUTE:
                policy, name = SPECS[runs[run_of[n] - 1][0]]
                raise CheckpointError(
                    f"region {name!r}: policy {policy!r} says MUST_RECOMPUTE for {n.target} (node "
                    f"{n.name!r}), which reads an input the compiled graph writes in place later "
                    f"({p.name!r}, a buffer the region updates). Replayed in backward it would read the "
                    "written value: a wrong gradient under inductor. Return PREFER_RECOMPUTE or "
                    "MUST_SAVE for it (tracedac then saves it), or run the region eagerly, where "
                    "replay reads a copy taken before the write."
                )
            # (a multi-output op is saved through its getitems, as ``_tag`` saves one)
            parts = [u for u in n.users if u.target is operator.getitem and u in read]
            for m in (n, *parts):
                m.meta["recompute"] = m.meta[DECISION] = MUST_SAVE


def _readers(p: torch.fx.Node) -> list:
    """The ops that read placeholder ``p``, directly or through views (not the ``copy_`` that
    writes it)."""
    readers, seen, todo = [], set(), list(p.users)
    while todo:
        n = todo.pop()
        if n in seen or n.op != "call_function" or n.target is torch.ops.aten.copy_.default:
            continue
        seen.add(n)
        if getattr(n.target, "is_view", False):
            todo.extend(n.users)
        else:
            readers.append(n)
    return readers


def _read_by_backward(graph: torch.fx.Graph, backward: set) -> set:
    """The forward nodes whose value backward reads, directly or through a value computed from it."""
    read: set = set()
    for n in reversed(graph.nodes):
        if n not in backward and any(u in backward or u in read for u in n.users):
            read.add(n)
    return read


def _free_to_rebuild(n: torch.fx.Node) -> bool:
    """A value made from no tensor (``iota``, ``full``, ``arange``), not random, that the region
    replays: it keeps its RECOMPUTE tag but gets no ``ac_graph_id``, so the partitioner
    rebuilds it wherever it is read. With an id, the partitioner's common-subexpression pass
    (which runs before it reads the tags) merges identical ones of two regions into the first
    region's node, and ``cleanup_recompute_tags`` then saves it at the boundary as a value a
    later region reads: transformers' Mixtral saved an ``iota`` that torch's own checkpoint
    does not, the bench's MoE two ``full`` buffers. (Untagged altogether, the partitioner's
    min cut saves a ``full`` that a scatter writes into: "materialized in backward".)"""
    op = n.target
    return (
        isinstance(op, torch._ops.OpOverload)
        and not is_save(n.meta.get("recompute"))
        and torch.Tag.nondeterministic_seeded not in op.tags
        and not any(isinstance(a.meta.get("val"), torch.Tensor) for a in n.all_input_nodes)
    )


def tag_regions(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Write each region's decisions as ``meta["recompute"]``/``meta["ac_graph_id"]``."""
    with _disable_current_modes():  # the compiler's fake mode: planners compute with real tensors
        return _tag_regions(gm)


def _tag_regions(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    graph = gm.graph
    labels = _fold_names(graph)
    backward = backward_nodes(graph)
    runs = _region_runs(graph, backward)
    marks = list(graph.find_nodes(op="call_function", target=MARK))
    for n in marks:
        graph.erase_node(n)
    if not runs and not labels:
        if marks:
            gm.recompile()
        return gm  # no region in this graph (the pass sees every joint graph once installed)
    planners = [spec_of(SPECS[key][0]).planner for key, _ in runs if key in SPECS]
    budgets = any(isinstance(p, MemoryBudget) or hasattr(p, "compiled_budget") for p in planners)
    baseline = untagged_saved(gm) if budgets else None
    run_of = {n: i for i, (_, run) in enumerate(runs, start=1) for n in run}
    for ac_graph_id, (key, nodes) in enumerate(runs, start=1):

        def later(n, this=ac_graph_id):
            return run_of.get(n, 0) > this

        spec = SPECS.get(key)
        if spec is None:
            raise AssertionError(f"joint graph names region {key!r}, which no traced region registered")
        policy, name = spec
        _warn_opaque(key, nodes)
        view = build(name, policy, nodes, labels)
        wanted = set()
        for n in nodes:
            m = view.values.get(n)
            metas = m if isinstance(m, tuple) else (m,)
            if any(u in backward for u in n.users):
                wanted.update(
                    (x.group, 0)
                    for x in metas
                    if x is not None and view.graph.groups[x.group].creator is not None
                )
        _decide(view, policy, wanted, baseline, later)
        _tag(view, wanted, ac_graph_id, nodes)
    _save_what_reads_a_written_input(graph, run_of, runs, backward)
    graph.lint()
    gm.recompile()
    return gm
