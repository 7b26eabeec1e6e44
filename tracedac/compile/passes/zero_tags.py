"""The joint-graph pass for ZeRO-3: backward gathers again instead of keeping full parameters.

Requires: a joint graph before partitioning, the last of ``passes.PASSES``: its gathers in
their final form, whole (``tracedac::all_gather``) or split by ``gather_prefetch``
(``all_gather_start`` and ``all_gather_wait``), and the regions' tags written
(``tag_regions``), which it leaves alone. A graph with no gather is returned as it is.

Provides: ``tag_gathers(gm) -> gm`` adds and removes no node. On the forward nodes of a
joint graph it writes ``meta["recompute"] = MUST_RECOMPUTE`` on

- every ``tracedac::all_gather`` (a full unit of parameters; keeping it past the forward
  would pin what ZeRO-3 exists to free), or ``all_gather_start`` where ``gather_prefetch``
  split it (its ``all_gather_wait`` reads the start alone: tagged by the rule below), and
- every node computed from gathered parameters alone (the copy-out's views, transposes,
  an autocast's cast of the weight): saving one of those would pin a full parameter too.

Left alone: nodes a region already tagged (``tag_regions``: inside a region the policy
decides, and the gather is ``RECOMPUTE_OPS``' must-recompute there already), and the
``with_effects`` nodes of ``release`` and ``reduce_grad`` (their token is not a gathered
value). No ``ac_graph_id`` is written: torch's partitioner saves a tagged node whose
user belongs to a later checkpoint graph (``cleanup_recompute_tags``), which would save
a gathered weight read by a region. The partitioner (min cut) then saves the shard
(a graph input) and replays the gather in backward, before the matmuls that read it.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import CheckpointPolicy

from ..vocab import backward_nodes, zero_op

__all__ = ["tag_gathers"]


def tag_gathers(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    graph = gm.graph
    # whole, or split in two by gather_prefetch (the wait reads the start alone: tagged below)
    starts = {op for op in (zero_op("all_gather"), zero_op("all_gather_start")) if op is not None}
    if not any(graph.find_nodes(op="call_function", target=t) for t in starts):
        return gm
    backward = backward_nodes(graph)
    gathered: set = set()
    for n in graph.nodes:
        if n.op != "call_function" or n in backward:
            continue
        if n.target in starts:
            gathered.add(n)
        elif n.all_input_nodes and all(a in gathered for a in n.all_input_nodes):
            gathered.add(n)
        else:
            continue
        if "recompute" not in n.meta:
            n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    return gm
