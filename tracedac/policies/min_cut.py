"""The minimum cut: the fewest bytes to keep from which everything backward needs can be
replayed (``min_cut()``'s choice), as a maximum flow over the region's value graph (networkx)."""

from __future__ import annotations

from ..record.decisions import MUST_RECOMPUTE, MUST_SAVE, is_offload
from ..record.graph import RegionGraph
from ..record.op_info import MATMUL_OPS

__all__ = ["min_cut_keep"]


def min_cut_keep(graph: RegionGraph, wanted, *, replay_matmuls=False, decisions=None, keepable=None):
    """The storages to keep (group ids), the cut's value in bytes, and the flow network.

    The network has two vertices per value (storage, state): ``in`` and ``out``. Keeping a
    value is the edge ``in -> out``, of capacity its bytes; only a storage's final state can
    be kept, so earlier states' edges are infinite. A node's inputs feed its outputs' ``in``
    with infinite capacity, so a replayed value (``in`` on the sink side) needs every input
    available (``out`` on the sink side). Outside values are free: source to ``in`` infinite,
    ``in -> out`` zero. What backward needs goes to the sink. A matmul (not replayed unless
    ``replay_matmuls``) is fed from the source with a capacity larger than all bytes
    together, so it is replayed only where nothing else works. ``decisions`` maps node
    indices to MUST decisions to honour; ``keepable`` (group ids), if given, limits what may be
    kept (a result already let go cannot be). An offloaded result (its node's decision in
    ``decisions`` an offload) is free, as an outside value is: it lives on the host and replay
    may start from it; it is never in the cut. Of the minimum cuts, the one closest to the sink
    is taken: the fewest values replayed.
    """
    import networkx as nx

    decisions = decisions or {}
    groups, nodes = graph.groups, graph.nodes
    banned = {} if replay_matmuls else MATMUL_OPS
    big = 1 + sum(g.nbytes for g in groups)
    G = nx.DiGraph()
    src, sink = "source", "sink"
    G.add_nodes_from((src, sink))  # a region with nothing to keep still has both

    def produced(node):
        vals = [(node.outputs[k].group, 0) for k in node.creates]
        for gid in node.writes:
            g = groups[gid]
            vals.append((gid, g.mutations.index(node) + 1))
        return vals

    for g in groups:
        final = len(g.mutations)
        for s in range(final + 1):
            a, b = ("in", g.id, s), ("out", g.id, s)
            if g.creator is None and s in (0, final):
                G.add_edge(src, a)  # infinite: no capacity attribute
                G.add_edge(a, b, capacity=0)
            elif s == final and (keepable is None or g.id in keepable):
                G.add_edge(a, b, capacity=g.nbytes)
            else:
                G.add_edge(a, b)
    for node in nodes:
        d = decisions.get(node.index)
        packet = getattr(node.op, "overloadpacket", None)
        for gid, s in produced(node):
            a = ("in", gid, s)
            for m in node.tensor_args:
                G.add_edge(("out", m.group, m.state), a)
            final = s == len(groups[gid].mutations)
            if is_offload(d) and final:
                G.add_edge(src, a)  # on the host: free, as an outside value
                G[a][("out", gid, s)]["capacity"] = 0
            elif d is MUST_SAVE and final:
                G.add_edge(src, a)
                G.add_edge(("out", gid, s), sink)
            elif d is MUST_RECOMPUTE:
                G[a][("out", gid, s)].pop("capacity", None)  # cannot be kept
            elif packet in banned:
                G.add_edge(src, a, capacity=big)
    for gid, s in wanted:
        G.add_edge(("out", gid, s), sink)
    R = nx.algorithms.flow.preflow_push(G, src, sink)
    value = R.graph["flow_value"]
    # The sink side: what can still reach the sink in the residual network.
    sink_side = {sink}
    stack = [sink]
    while stack:
        v = stack.pop()
        for u in R.predecessors(v):
            if u not in sink_side and R[u][v]["capacity"] - R[u][v]["flow"] > 0:
                sink_side.add(u)
                stack.append(u)
    keep = []
    for g in groups:
        s = len(g.mutations)
        if g.creator is not None and ("in", g.id, s) not in sink_side and ("out", g.id, s) in sink_side:
            if not is_offload(decisions.get(g.node.index)):
                keep.append(g.id)
    return keep, value, G
