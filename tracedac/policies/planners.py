"""Whole-graph planners: what a region keeps, chosen for its recorded graph as a whole.

A per-op policy answers for one node at a time. A planner answers once the region's graph is
complete, for all of it:

- ``memory_budget(budget)`` keeps, within a byte budget, the results whose replay would cost
  the most: an exact 0-1 knapsack (``knapsack``), solved by dynamic programming.
- ``min_cut()`` keeps the fewest bytes from which everything backward needs can be replayed
  without replaying a matmul: a minimum s-t cut of the value graph (``min_cut.py``),
  solved with networkx.

The *items* are the storages the region computed that autograd saved, in the state it saved
them (their final state: a kept storage holds its last value). Keeping one costs its bytes;
``memory_budget`` keeps the results of one op together (``bundles_of``).
Both planners honour the MUST decisions of the policy they are combined with
(``either(save_names("x"), memory_budget(0.3))``), and take a result the policy offloads
(``MUST_CPU_OFFLOAD`` or ``PREFER_CPU_OFFLOAD``) as neither kept on the device nor replayed:
it costs no budget and replay may start from it. With ``offload=True`` (or a ``Link``) they
also choose what to offload themselves, weighing a copy over the link against a replay
(``place``; the cost model is ``offload_plan``'s).

A plan is made once for a region's structure and reused (``plan_cache.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy

from ..errors import CheckpointError
from ..offload.link import Link
from ..record.decisions import MUST_RECOMPUTE, MUST_SAVE, PREFER_RECOMPUTE, effect, is_offload
from ..record.graph import Node, RegionGraph, human_bytes, walk
from .held import Held, interning
from .min_cut import min_cut_keep
from .placement import exchange, hide_bytes, placer

__all__ = [
    "MemoryBudget",
    "MinCut",
    "Planner",
    "Problem",
    "bundles_of",
    "closure",
    "costs",
    "knapsack",
    "node_cost",
    "problem",
]

# The dynamic program's table has at most this many capacity cells; beyond it, bytes are
# counted in coarser units (see ``knapsack``): a few milliseconds, since an MoE block whose
# routing changes its shapes plans again at every step.
MAX_CELLS = 1 << 12


# --- what replay costs --------------------------------------------------------------------


def _bytes_moved(node: Node) -> int:
    return sum(m.nbytes for m in node.tensor_args) + sum(o.nbytes for o in node.outputs if o is not None)


def node_cost(node: Node, cost: str | Callable = "flops", times: dict | None = None) -> tuple:
    """What replaying ``node`` once costs, as a tuple compared in order.

    ``"flops"``: (FLOPs by torch's formulas, bytes the op reads and writes). Matmuls,
    attention and convolutions are priced by their FLOPs; ops without a formula
    (pointwise, reductions, copies: memory-bound) by the bytes they move, which also decide
    between plans of equal FLOPs. ``"time"``: (nanoseconds the op took when it was recorded;
    ``memory_budget(..., cost="time")`` makes the region time every op into ``times``, the
    graph's ``times``). A callable
    ``cost(node) -> number`` is used as it is.
    """
    if cost == "flops":
        return (node.flops, _bytes_moved(node))
    if cost == "time":
        t = (times or {}).get(node.index)
        if t is None:
            raise CheckpointError(
                f"cost='time' needs the recorded duration of {node.name}, and this graph was "
                "recorded without timing; pass the policy memory_budget(..., cost='time') to the "
                "region itself, so it times ops while it records."
            )
        return (t,)
    return (int(cost(node)),)


def closure(graph: RegionGraph, wanted, kept) -> list[int]:
    """Indices of the nodes replay runs to rebuild ``wanted`` ((group, state) pairs) when the
    groups in ``kept`` are held in their final state. Outside storages are free: the final
    state is the tensor itself, an earlier one is rebuilt from the copy taken before the
    region first wrote it. The replay plan's own walk (``graph.walk``), on a hypothetical choice."""

    def start_of(g, lowest: int) -> tuple:
        final = len(g.mutations)
        if lowest == final and (g.id in kept or g.creator is None):
            return ("kept", final)  # held, or an outside tensor as it is
        return ("snapshot", 0) if g.creator is None else ("create", 0)

    return walk(graph, wanted, start_of)[1]


def bundles_of(graph: RegionGraph, items: list[int]) -> list[list[int]]:
    """Items grouped by the node that last wrote them. An op with several results (attention's
    output and log-sum-exp, layer norm's output, mean and rstd) runs whole: keeping some of
    its results saves nothing while another must be replayed, so they are kept together."""
    by_node: dict[int, list[int]] = {}
    for gid in items:
        by_node.setdefault(graph.groups[gid].node.index, []).append(gid)
    return list(by_node.values())


def costs(graph: RegionGraph, bundles: list[list[int]], cost="flops", items=None) -> list[tuple]:
    """The cost of replaying each bundle's storages when every other item (``items``, by
    default those of the bundles; items a plan cannot choose are counted as kept, since
    their own replay is paid whatever the choice) is kept: the
    components of ``node_cost`` summed over the nodes that runs, then the number of ops
    (ties go to fewer replayed ops).

    These costs add up exactly over any choice, except that a node no item keeps and that
    two replayed bundles both read is counted for each (an upper bound), and that a storage
    written in place and needed in two of its states is rebuilt from its start up to the
    later one (which a per-bundle cost cannot see). Without in-place writes the model is an
    upper bound of what replay runs, never below it."""
    memo: dict[int, tuple] = {}
    out = []
    groups = graph.groups
    others = set(items) if items is not None else {gid for bundle in bundles for gid in bundle}
    for bundle in bundles:
        others.difference_update(bundle)
        run = closure(graph, [(gid, len(groups[gid].mutations)) for gid in bundle], others)
        others.update(bundle)
        total = None
        for i in run:
            c = memo.get(i)
            if c is None:
                c = memo[i] = node_cost(graph.nodes[i], cost, graph.times)
            total = c if total is None else tuple(x + y for x, y in zip(total, c))
        if total is None:  # nothing to replay: zero in each component of node_cost
            total = (0, 0) if cost == "flops" else (0,)
        out.append((*total, len(run)))
    return out


# --- the knapsack -------------------------------------------------------------------------


def knapsack(weights: list[int], values: list[tuple], capacity: int) -> tuple[list[int], int]:
    """Indices of a subset whose summed ``values`` are greatest (tuples of ints, compared in
    order) with total weight at most ``capacity``, and among those one of least weight;
    also the unit ``q`` weights were counted in.

    Dynamic programming over capacities counted in units of ``q`` bytes. Each weight is
    rounded *up* to whole units (``ceil(w / q)``) and the capacity *down*
    (``floor(capacity / q)``), so for any subset the DP accepts,
    ``sum(w) <= q * sum(ceil(w / q)) <= q * floor(capacity / q) <= capacity``: the budget holds
    after quantizing, always. ``q`` is the greatest common divisor of the weights (tensor
    sizes share large powers of two), where rounding changes nothing: the solution is then
    exactly optimal. Only when that leaves more than ``MAX_CELLS`` cells is ``q`` made
    coarser; the answer is then optimal among subsets that fit within
    ``capacity - q * (len(weights) + 1)``, and still never above ``capacity``.
    """
    n = len(weights)
    if n == 0 or capacity <= 0:
        return [i for i, w in enumerate(weights) if w <= 0 and capacity >= 0], 1
    if any(w <= 0 for w in weights):  # free items are always worth keeping
        free = [i for i, w in enumerate(weights) if w <= 0]
        rest = [i for i, w in enumerate(weights) if w > 0]
        chosen, q = knapsack([weights[i] for i in rest], [values[i] for i in rest], capacity)
        return sorted(free + [rest[i] for i in chosen]), q
    q = 0
    for w in weights:
        q = math.gcd(q, w)
    if capacity // q > MAX_CELLS:
        q = max(q, -(-capacity // MAX_CELLS))
    cells = capacity // q
    units = [-(-w // q) for w in weights]
    width = len(values[0])
    # best[k][c]: component k of the best value within c units (int64: sums of FLOPs fit)
    best = [torch.zeros(cells + 1, dtype=torch.int64) for _ in range(width)]
    take = torch.zeros((n, cells + 1), dtype=torch.bool)
    for i, (u, v) in enumerate(zip(units, values)):
        if u > cells:
            continue
        old = [b[u:] for b in best]
        new = [b[: cells + 1 - u] + x for b, x in zip(best, v)]  # new tensors: read the old row
        better = torch.zeros(cells + 1 - u, dtype=torch.bool)
        tied = torch.ones(cells + 1 - u, dtype=torch.bool)
        for o, c in zip(old, new):
            better |= tied & (c > o)
            tied &= c == o
        take[i, u:] = better
        for b, o, c in zip(best, old, new):
            b[u:] = torch.where(better, c, o)
    reaching = torch.ones(cells + 1, dtype=torch.bool)
    for b in best:
        reaching &= b == b[cells]
    c = int(torch.nonzero(reaching)[0])  # the least capacity reaching the best value
    chosen = []
    for i in range(n - 1, -1, -1):
        if take[i, c]:
            chosen.append(i)
            c -= units[i]
    return sorted(chosen), q


# --- the problem a region poses --------------------------------------------------------


def region_values(graph: RegionGraph, slots) -> set:
    """The (group, state) pairs of the handles in ``slots`` that the region computed (an
    input, or a view of one, is not the planner's to keep)."""
    groups = graph.groups
    return {
        (s.meta.group, s.meta.state)
        for s in slots
        if not s.exact and groups[s.meta.group].creator is not None
    }


@dataclass
class Problem:
    """What a planner decides on, built once per graph by ``problem`` from either kind of
    graph (a recorded region, or one built from a compiled joint graph).

    ``items`` are the storages the region computed that backward reads, in their final state
    (the state a kept storage holds); ``wanted`` every (group, state) backward needs;
    ``forced_in``/``forced_out`` what MUST decisions (or a result already let go) settle;
    ``full`` the bytes kept without checkpointing; ``live`` the storages that can still be
    kept (None: all); ``reserved`` bytes of the budget that go to values kept whatever the
    plan (a collective's result, ``decisions.effect``; under compile also a region's result
    that the next region reads), ``kept_anyway`` their groups. Under compile ``items`` also
    holds what the untagged partition saves.
    ``offloaded`` are the items the policy offloads: not a choice, no device bytes, but
    available to replay from (priced as kept)."""

    graph: RegionGraph
    wanted: set
    items: list
    full: int
    forced_in: list
    forced_out: set
    live: set | None = None
    reserved: int = 0
    kept_anyway: frozenset = frozenset()
    offloaded: frozenset = frozenset()


def problem(graph: RegionGraph, wanted, live=None, held=()) -> Problem:
    """The planning problem for ``wanted`` ((group, state) pairs backward needs). ``live``
    limits what can still be kept; ``held`` are storages held outside ``wanted`` whose MUST_SAVE
    binds the budget too."""
    groups = graph.groups
    items = {gid for gid, st in wanted if st == len(groups[gid].mutations)}
    full = sum(groups[gid].nbytes for gid in {gid for gid, _ in wanted})
    # Collectives' results are kept by every policy: out of the budget first, priced as kept,
    # never a reason to refuse a budget (the policy did not ask for them).
    effects = {
        g
        for g in (*items, *held)
        if groups[g].node.decision is MUST_SAVE and effect(groups[g].node.op) is not None
    }
    items = sorted(items | effects)
    forced_in = [g for g in items if groups[g].node.decision is MUST_SAVE and g not in effects]
    forced_in += [g for g in held if g not in items and groups[g].node.decision is MUST_SAVE]
    offloaded = frozenset(g for g in items if is_offload(groups[g].node.decision))
    forced_out = {
        g
        for g in items
        if g not in offloaded
        and ((live is not None and g not in live) or groups[g].node.decision is MUST_RECOMPUTE)
    }
    return Problem(
        graph,
        set(wanted),
        items,
        full,
        forced_in,
        forced_out,
        live,
        offloaded=offloaded,
        reserved=sum(groups[g].nbytes for g in effects),
        kept_anyway=frozenset(effects),
    )


def must_decisions(graph: RegionGraph) -> dict:
    """The decisions a planner does not make: MUST ones, and offloads (MUST or PREFER)."""
    return {
        n.index: n.decision
        for n in graph.nodes
        if n.decision in (MUST_SAVE, MUST_RECOMPUTE) or is_offload(n.decision)
    }


# --- planner objects ----------------------------------------------------------------------


class Planner(Held):
    """A policy that decides for the whole recorded graph. As a per-node policy it has no
    opinion (``PREFER_RECOMPUTE``), so ``either`` combines it with per-op policies: their MUST
    decisions bind the planner, their PREFERs it overrides."""

    holds_unsaved = False  # whether it may keep storages autograd did not save
    # its plan is made once for a recorded structure and cached (plan_cache.py): a call that
    # repeats the structure takes that plan's decisions (``spec.PolicySpec``)
    structural = True

    def __call__(self, node) -> CheckpointPolicy:
        return PREFER_RECOMPUTE

    def choose(self, p: Problem) -> set[int]:
        """The group ids to keep on the device (see ``Problem``)."""
        return self.place(p)[0]

    def place(self, p: Problem) -> tuple[set[int], set[int]]:
        """The group ids to keep on the device, and those to offload to host memory."""
        raise NotImplementedError


@dataclass(frozen=True)
class MemoryBudget(Planner):
    """Keep at most ``budget`` (a fraction of the bytes the region would keep without
    checkpointing, or an int of bytes), replaying as little as possible.

    With ``offload`` (True: the link measured; or a ``Link``), each item is kept, offloaded
    or replayed, for the least estimated step time within the budget: replay costs its
    FLOPs / flop_rate, an offload the part of its copy out and back (bytes / bandwidth each
    way) that the region's forward compute time does not hide, keeping only device bytes
    (``offload_plan`` states the model)."""

    budget: float | int
    cost: str | Callable = "flops"
    offload: bool | Link = False

    def bytes_for(self, full: int) -> int:
        if isinstance(self.budget, float):
            return int(self.budget * full)  # rounded down: never above the fraction
        return self.budget

    def place(self, p: Problem) -> tuple[set[int], set[int]]:
        limit = max(0, self.bytes_for(p.full) - p.reserved)
        of = (
            f"{self.budget} of the {human_bytes(p.full)} kept without checkpointing"
            if isinstance(self.budget, float)
            else f"{human_bytes(self.budget)}"
        )
        if p.reserved:
            of += f", less {human_bytes(p.reserved)} reserved for values kept whatever the plan"
        return self.prepare(p)(limit, self, of)

    def prepare(self, p: Problem):
        """The plan for this problem, priced once: a function of the byte limit (and the
        planner, for messages) returning (keep, offload), so a sweep over budgets
        (``trade_off``) prices it once."""
        graph, items, forced_in, forced_out = p.graph, p.items, p.forced_in, p.forced_out
        groups = graph.groups
        forced = set(forced_in)
        forced_bytes = sum(groups[g].nbytes for g in forced)
        fixed = forced_out | p.offloaded | p.kept_anyway  # replayed, on the host, or kept: not the knapsack's
        free = [
            b
            for b in bundles_of(graph, items)
            if not any(g in fixed for g in b) and not all(g in forced for g in b)
        ]
        weights = [sum(groups[g].nbytes for g in b if g not in forced) for b in free]
        costs_ = costs(graph, free, self.cost, items)
        rate = exchange(graph, self.offload, self.cost) if self.offload is not False else math.inf
        placing = None  # no offload, or no link to offload over: the knapsack alone
        if not math.isinf(rate):
            movable = [not any(g in forced for g in b) for b in free]  # an op's results move whole
            host = sum(groups[g].nbytes for g in p.offloaded)
            placing = placer(graph, self.cost, rate, costs_, weights, movable, host, MAX_CELLS)

        def solve(limit: int, planner, of: str = "") -> tuple[set[int], set[int]]:
            if forced_bytes > limit:
                names = ", ".join(sorted({groups[g].node.name for g in forced}))
                raise CheckpointError(
                    f"region {graph.name!r}: the policy must keep {human_bytes(forced_bytes)} (MUST_SAVE "
                    f"results of {names}), more than {planner!r} allows ({human_bytes(limit)}"
                    f"{': ' + of if of else ''}). Raise the budget, or make those decisions "
                    "PREFER_SAVE so the budget may drop them."
                )
            moved: list[int] = []
            if placing is not None:
                chosen, moved = placing(limit - forced_bytes)
            if not moved:  # nothing worth offloading: the plan offload=False makes, exactly
                chosen, _ = knapsack(weights, costs_, limit - forced_bytes)
            return {g for i in chosen for g in free[i]} | forced, {g for i in moved for g in free[i]}

        return solve

    def __repr__(self) -> str:
        extra = "" if self.cost == "flops" else f", cost={self.cost!r}"
        extra += "" if self.offload is False else f", offload={self.offload!r}"
        return f"memory_budget({self.budget!r}{extra})"


@dataclass(frozen=True)
class MinCut(Planner):
    """Keep the fewest bytes from which everything backward needs replays, matmuls not replayed.

    With ``offload`` (True: the link measured; or a ``Link``), of what the cut keeps, as many
    bytes go to host memory as the link moves out and back within the region's forward
    compute time (copies hidden by compute: no added step time), whole ops' results at a time."""

    replay_matmuls: bool = False
    offload: bool | Link = False
    holds_unsaved = True

    def place(self, p: Problem) -> tuple[set[int], set[int]]:
        keep, _, _ = min_cut_keep(
            p.graph,
            p.wanted,
            replay_matmuls=self.replay_matmuls,
            decisions=must_decisions(p.graph),
            keepable=p.live,
        )
        keep = set(keep)
        if self.offload is False or not keep:
            return keep, set()
        groups = p.graph.groups
        rate = exchange(p.graph, self.offload, "flops")
        host = sum(groups[g].nbytes for g in p.offloaded)
        hide = hide_bytes(p.graph, "flops", rate, host)
        movable = [
            b
            for b in bundles_of(p.graph, sorted(keep))
            if all(groups[g].node.decision is not MUST_SAVE and g not in p.kept_anyway for g in b)
        ]
        weights = [sum(groups[g].nbytes for g in b) for b in movable]
        if math.isinf(hide):
            chosen = range(len(movable))
        else:  # the most bytes whose copies the compute hides
            chosen, _ = knapsack(weights, [(w,) for w in weights], int(hide))
        moved = {g for i in chosen for g in movable[i]}
        return keep - moved, moved

    def __repr__(self) -> str:
        args = ["replay_matmuls=True"] if self.replay_matmuls else []
        args += [] if self.offload is False else [f"offload={self.offload!r}"]
        return f"min_cut({', '.join(args)})"


@interning
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
        if budget >= 2:
            n = int(budget)  # bytes are whole: the int the user most likely meant, said once
            hint = f" For {n} bytes, pass an int: memory_budget({n}); to keep everything, memory_budget(1.0)."
        elif budget > 1:  # (int(budget) would be 1, itself refused as ambiguous: not a hint to give)
            hint = " To keep everything, pass memory_budget(1.0); for bytes, an int of at least 2."
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


@interning
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


def planner_of(policy):
    """The planner in ``policy`` (itself, or one inside ``either``), or None."""
    if isinstance(policy, Planner):
        return policy
    return getattr(policy, "planner", None)
