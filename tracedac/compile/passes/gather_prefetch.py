"""The joint-graph pass that issues each unit's all-gather while the unit before it computes.

A compiled graph that runs several units of a ``zero.shard``ed model (the whole model
compiled) gathers each unit with ``tracedac::all_gather``, which starts the collective and
waits for it: the wire idles while a unit computes, the compute while a unit gathers.
FSDP2 prefetches from hooks, and DeepSpeed's DeepCompile by reordering its graph; here the
gather op comes in two (``all_gather_start`` returns the buffer being written,
``all_gather_wait`` waits and returns what ``all_gather`` returned) and the pass moves the
start.

Requires: a joint graph before partitioning, its gathers whole (``tracedac::all_gather``,
their casts already fused by ``gather_cast``) and the regions' tags written (``tag_regions``:
each half of a gather gets the whole one's ``meta``, tags included); ``tag_gathers`` runs
after (it tags the halves). A graph with no gather is returned as it is.

Provides: ``prefetch_gathers(gm) -> gm``, on the forward nodes of a joint graph:

- units are the runs of gathers with no other op between them (a unit gathers all its
  groups back to back); with fewer than two units (a block compiled on its own) the graph
  is left as it is: the runtime prefetch in the ops links one block's graph to the next;
  and so it is in a world of one rank, where a gather is a cast with nothing to overlap;
- each ``all_gather(shard, key, dtype)`` is replaced by ``wait(start(shard, key, dtype), key)``
  (its ``meta``, region tags included, copied to both; its uses read the wait);
- the starts of unit ``k + 1`` move to just after the last wait of unit ``k``: unit ``k + 1``'s
  all-gather is in flight while unit ``k`` computes, and at most two units are gathered at once.

Nothing else is added or removed. Backward is not touched: ``tag_gathers`` marks the start and
wait to be recomputed, the partitioner recomputes each pair where backward needs it, and the
runtime prefetch inside ``all_gather_wait`` (the order of the previous backward) overlaps them.
A start whose wait finds it gone (drained at the end of a pass) is gathered again by the wait,
never read stale.
"""

from __future__ import annotations

import torch

from ..vocab import backward_nodes, zero_op

__all__ = ["prefetch_gathers"]


def _units(graph: torch.fx.Graph, gather, backward: set) -> list[list]:
    """The forward gathers, in runs with no other op between them."""
    units: list[list] = []
    computed = True  # an op other than a gather since the last gather
    for n in graph.nodes:
        if n.op != "call_function" or n in backward:
            continue
        if n.target is gather:
            if computed:
                units.append([])
            units[-1].append(n)
            computed = False
        else:
            computed = True
    return units


def _one_rank(gather) -> bool:
    """Whether ``gather`` gathers from one rank: its output (``world`` shards) is its input's size."""
    out, shard = gather.meta.get("val"), gather.args[0].meta.get("val")
    return out is not None and shard is not None and 0 < shard.numel() == out.numel()


def prefetch_gathers(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    gather = zero_op("all_gather")
    if gather is None or not gm.graph.find_nodes(op="call_function", target=gather):
        return gm
    graph = gm.graph
    units = _units(graph, gather, backward_nodes(graph))
    if len(units) < 2:
        return gm
    if all(_one_rank(g) for unit in units for g in unit):
        # One rank: a gather is a cast on the compute stream; split, it would overlap nothing
        # and cost a copy more (a wait's result may not alias the buffer its start returned).
        return gm
    split = []  # per unit: [(start, wait)]
    for unit in units:
        pairs = []
        for g in unit:
            with graph.inserting_before(g):
                start = graph.call_function(zero_op("all_gather_start"), g.args, dict(g.kwargs))
                wait = graph.call_function(zero_op("all_gather_wait"), (start, g.args[1]))
            # the same value (rank-major and param-major buffers have one shape) and region tags;
            # not the wait's traced arguments (inductor checks them against its schema)
            start.meta = dict(g.meta)
            wait.meta = {k: v for k, v in g.meta.items() if k != "eager_input_vals"}
            g.replace_all_uses_with(wait)
            graph.erase_node(g)
            pairs.append((start, wait))
        split.append(pairs)
    for before, unit in zip(split, split[1:]):
        anchor = before[-1][1]
        for start, _ in unit:
            anchor.append(start)
            anchor = start
    graph.lint()
    gm.recompile()
    return gm
