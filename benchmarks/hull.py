"""The floor under a ``memory_budget`` plan: the least replay any choice of kept values can cost
within the same bytes, as a lower bound, from parametric minimum cuts.

``memory_budget`` chooses with a knapsack (``planners.knapsack``) whose prices are each value's
replay with every other value kept. Whether a better choice exists is answered here, outside
the planner. For a weight ``lam`` (bytes per FLOP), the minimum cut of ``value_network``
minimizes ``bytes kept + lam * FLOPs replayed`` over *every* choice of kept storages in the
region (any value, not only the knapsack's items; chains and shared replays priced exactly:
each op's replay is paid once, a random op replayed brings its generator predecessor).
Every such cut is a vertex of the lower convex hull of the (bytes, FLOPs) trade-off, so the
hull at the plan's byte limit, linear between its two neighbouring vertices, is a lower
bound on what any plan within that limit replays (``floor``). A plan near it leaves nothing
to a better search; the rest of any gap to another partitioner is outside the region's
choice (what the partitioner keeps at region boundaries and outside regions).

``capture()`` records each problem a ``memory_budget`` plans (compiled or eager) with its
limit and its plan; ``--compile`` reads its per-block plans against their floor with it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from tracedac.policies.planners import MemoryBudget, Problem, closure, must_decisions, node_cost
from tracedac.record.decisions import MUST_RECOMPUTE, MUST_SAVE
from tracedac.record.graph import RegionGraph

__all__ = ["Planned", "capture", "floor", "price", "value_network"]


def price(graph: RegionGraph, wanted, keep) -> tuple[int, set]:
    """(FLOPs replayed, kept groups read) of the plan ``keep`` (group ids): what replay runs to
    rebuild ``wanted`` (``planners.closure``), and the kept storages backward reads, directly
    or to replay (a kept storage nothing reads is not held)."""
    run = closure(graph, wanted, keep)
    read = {g for g, _ in wanted}
    for i in run:
        read.update(m.group for m in graph.nodes[i].tensor_args)
    return sum(node_cost(graph.nodes[i])[0] for i in run), {g for g in keep if g in read}


def value_network(
    graph: RegionGraph, wanted, per_byte: int, per_flop: int, *, keepable=None, free=(), decisions=None
):
    """The flow network whose minimum cut is the cheapest plan: keeping a group costs its bytes
    times ``per_byte`` (a ``free`` group: nothing), replaying a node its FLOPs times ``per_flop``
    (integers: the cut is exact, ``lam = per_flop / per_byte``).
    Vertices ``("in"|"out", group, state)`` per value as in ``min_cut.min_cut_keep``, and
    ``("run", i)`` per node: a replayed value (``in`` on the sink side) pulls its node's
    ``run`` there, paid once for all the node's results, and ``run`` pulls every input's
    ``out``. MUST decisions bind; ``keepable`` (group ids) limits what may be kept."""
    import networkx as nx

    decisions = decisions or {}
    groups = graph.groups
    G = nx.DiGraph()
    G.add_nodes_from(("source", "sink"))
    for g in groups:
        final = len(g.mutations)
        for s in range(final + 1):
            a, b = ("in", g.id, s), ("out", g.id, s)
            if g.creator is None and s in (0, final):
                G.add_edge("source", a)  # an outside tensor: there, free to read
                G.add_edge(a, b, capacity=0)
            elif s == final and (keepable is None or g.id in keepable):
                G.add_edge(a, b, capacity=0 if g.id in free else g.nbytes * per_byte)
            else:
                G.add_edge(a, b)  # an earlier state, or one that cannot be kept: infinite
    for node in graph.nodes:
        run = ("run", node.index)
        G.add_edge("source", run, capacity=node_cost(node)[0] * per_flop)
        for m in node.tensor_args:
            G.add_edge(("out", m.group, m.state), run)
        if node.rng is not None and node.rng[1] is None:  # replayed only after its predecessor
            G.add_edge(("run", node.rng[2]), run)
        d = decisions.get(node.index)
        produced = [(node.outputs[k].group, 0) for k in node.creates]
        produced += [(gid, groups[gid].mutations.index(node) + 1) for gid in node.writes]
        for gid, s in produced:
            a = ("in", gid, s)
            G.add_edge(run, a)
            if d is MUST_SAVE and s == len(groups[gid].mutations):
                G.add_edge("source", a)
                G.add_edge(("out", gid, s), "sink")
            elif d is MUST_RECOMPUTE:
                G[a][("out", gid, s)].pop("capacity", None)
    for gid, s in wanted:
        G.add_edge(("out", gid, s), "sink")
    return G


def _cut(graph: RegionGraph, G) -> set:
    """The kept groups of a minimum cut of ``G``."""
    import networkx as nx

    _, (source_side, _) = nx.minimum_cut(G, "source", "sink")
    return {
        g.id
        for g in graph.groups
        if g.creator is not None
        and ("in", g.id, len(g.mutations)) in source_side
        and ("out", g.id, len(g.mutations)) not in source_side
    }


def floor(p: Problem, limit: int, steps: int = 64) -> tuple[float, list]:
    """A lower bound on the FLOPs any plan for ``p`` replays within ``limit`` bytes (groups
    kept whatever the plan, ``p.kept_anyway``, not counted): the lower convex hull of every
    plan's (bytes, FLOPs) at ``limit``; and the hull vertices found ((bytes, FLOPs) pairs).
    ``inf`` when no plan fits.

    Newton's method on ``lam`` (Dinkelbach's): between a vertex within the limit and one above
    it, ``lam`` is the slope of the line through both, exact as a ratio of integers; the cut
    there is either on that line (the two are neighbours) or a vertex below it, which
    replaces one of them. The ends: FLOPs priced below any byte (the fewest bytes, then the
    fewest FLOPs) and above all bytes (the fewest FLOPs, then the fewest bytes)."""
    graph, free = p.graph, set(p.kept_anyway)
    decisions = must_decisions(graph)
    seen = []

    def vertex(per_byte: int, per_flop: int) -> tuple[int, int]:
        G = value_network(
            graph, p.wanted, per_byte, per_flop, keepable=p.live, free=free, decisions=decisions
        )
        flops, read = price(graph, p.wanted, _cut(graph, G) | free)
        seen.append((sum(graph.groups[g].nbytes for g in read - free), flops))
        return seen[-1]

    total_flops = sum(node_cost(n)[0] for n in graph.nodes)
    low = vertex(total_flops + 1, 1)
    if low[0] > limit:
        return float("inf"), seen
    high = vertex(1, sum(g.nbytes for g in graph.groups) + 1)
    if high[0] <= limit:
        return float(high[1]), seen
    for _ in range(steps):
        if low[1] <= high[1]:
            break
        per_byte, per_flop = low[1] - high[1], high[0] - low[0]  # lam: the slope from low to high
        mid = vertex(per_byte, per_flop)
        if (
            mid in (low, high)
            or mid[0] * per_byte + mid[1] * per_flop >= low[0] * per_byte + low[1] * per_flop
        ):
            break  # on the line: low and high are neighbours on the hull
        if mid[0] <= limit:
            low = mid
        else:
            high = mid
    # linear between the neighbours: no plan within the limit is below this line
    return low[1] - (low[1] - high[1]) * (limit - low[0]) / (high[0] - low[0]), seen


@dataclass
class Planned:
    """One ``memory_budget`` plan: its problem, byte limit (reserved bytes taken off), the
    kept groups, and what it replays and keeps by ``price``."""

    problem: Problem
    limit: int
    keep: frozenset
    flops: int
    nbytes: int


@contextlib.contextmanager
def capture():
    """Record every ``memory_budget`` plan made inside (a list of ``Planned``)."""
    plans: list[Planned] = []
    choose = MemoryBudget.choose

    def recording(self, p):
        keep = choose(self, p)
        f, read = price(p.graph, p.wanted, set(keep) | set(p.kept_anyway))
        nbytes = sum(p.graph.groups[g].nbytes for g in read - set(p.kept_anyway))
        plans.append(Planned(p, max(0, self.bytes_for(p.full) - p.reserved), frozenset(keep), f, nbytes))
        return keep

    MemoryBudget.choose = recording
    try:
        yield plans
    finally:
        MemoryBudget.choose = choose
