"""One budget for a whole model: ``peak(budget)``, the step's peak on the device at most
``budget``, every region planned to fit it at the least estimated replay.

The user's constraint is the device ("this step fits in 70 GiB"), not a region's bytes. One
``Peak`` object is the policy of every region of a model (``wrap(model, Block,
policy=peak("70GiB"))``); each region asks it for its planner when it starts (``bind``), so
the object sees the step's regions in order and coordinates them. How (docs/design.md, "One
budget for a whole model"):

1. **Measure a step that fits.** The first step with a new input shape runs every region
   with no planner, keeping the least it may (what full recompute keeps: the regions' inputs,
   and results a policy or a collective must keep), under a ``Meter`` (``meter.py``: the allocator's figures
   on CUDA, live tensor storages on the CPU). At each region's start, the end of its forward
   and the start of its backward (the first saved tensor autograd unpacks) the meter is read:
   bytes in use, and the most in use since the last reading. Between two readings the regions
   whose forward has ended and whose backward has not begun hold what they keep. Each region's
   frontier is priced there too (``frontier``: the plans ``memory_budget`` makes at every byte
   limit, each with the bytes it keeps beyond the least and what its replay costs).
2. **Plan.** In an interval where regions ``L`` are alive, a plan that keeps ``extra[j]`` more
   bytes in region ``j`` than the measured step would measure ``most + sum(extra[j], j in L)``,
   plus what the step left allocated (the optimizer state a first step makes). Regions become
   alive in call order and end in reverse, so the intervals constrain prefixes of the call order
   (an interval's set is bounded by the prefix up to its last region). ``allocate`` picks one
   frontier point per region by dynamic programming over the prefix's bytes: the least summed
   replay cost (FLOPs, then bytes the replayed ops move, then their number) whose estimated
   peak is within the budget, and of those the least estimated peak. Being the optimum under
   a peak constraint, the estimate is monotone in the budget: a larger budget's optimum either
   fits the smaller budget too (then the smaller budget's optimum is as cheap and peaks no
   higher) or peaks above it. Planned regions decide from a plan put in the plan cache for
   them (``bind``), so they never hold more than it keeps.
3. **Check, re-plan once.** The next step runs the plan and is measured again; if its peak
   exceeds the budget, the plan is made again from both measurements (each interval's
   constant the larger) and checked once more; still over, a warning says by how much.
4. **Cannot fit.** When keeping the least already exceeds the budget, a ``CheckpointError``
   says the least peak reachable, where it occurs and what holds it.

Plans are kept per input shape of the step's first region (a new shape is measured once).
"""

from __future__ import annotations

import math
import re
import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..errors import CheckpointError
from ..record.graph import human_bytes
from .meter import Meter, meter_for
from .plan_cache import plan_key, plans, signature
from .planners import MAX_CELLS as PLANNER_CELLS
from .planners import (
    MemoryBudget,
    Planner,
    Problem,
    bundles_of,
    closure,
    costs,
    must_decisions,
    node_cost,
    problem,
    region_values,
)

__all__ = ["Peak", "PeakReport", "Point", "allocate", "frontier", "parse_bytes", "peak"]

# The dynamic program's byte axis has at most this many cells (bytes counted in coarser units
# beyond it, each region's rounded up and each limit down: the estimate never undercounts).
MAX_CELLS = 1 << 13
# At most this many points of a region's frontier (evenly spaced in bytes beyond it).
MAX_POINTS = 48
# Plans kept per Peak, one per input shape of the step's first region (least recently used out).
MAX_PLANS = 16

_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(budget) -> int:
    """``budget`` as bytes: an int, or a string with a unit (``"70GiB"``, ``"1.5 GB"``, ``"512MiB"``)."""
    if isinstance(budget, bool) or not isinstance(budget, (int, str)):
        hint = ""
        if isinstance(budget, float):
            hint = (
                f" A float is ambiguous (memory_budget's floats are fractions of a region); for "
                f"{budget:g} bytes pass peak({int(budget)}) or a string with a unit, "
                f"peak('{budget / 2**30:.3g}GiB')."
            )
        raise TypeError(
            f"peak() takes an int of bytes or a string with a unit (e.g. '70GiB'), got {budget!r}.{hint}"
        )
    if isinstance(budget, int):
        n = budget
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", budget)
        unit = m.group(2).lower() if m else ""
        if m is None or unit not in _UNITS:
            raise ValueError(
                f"peak({budget!r}): a budget string is a number and a unit, one of B, KB, MB, GB, TB "
                "(powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. '70GiB' or '1.5 GB'."
            )
        n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise ValueError(
            f"peak({budget!r}): the budget is the most bytes a step may hold; it must be positive."
        )
    return n


def _show(n: int) -> str:
    """A budget as a person wrote it: '70GiB' when it is whole in a unit, else bytes."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


# --- one region's frontier --------------------------------------------------------------


@dataclass(frozen=True)
class Point:
    """One plan of one region: it keeps the storages ``keep``, ``extra`` bytes more than the
    region's least plan (``budget``: those bytes as ``memory_budget``'s int, for a region that
    must plan again), and its replay costs ``cost`` (FLOPs, bytes the replayed ops move, ops)."""

    budget: int
    extra: int
    cost: tuple
    keep: frozenset = frozenset()


def price(p: Problem, keep, moved=()) -> tuple:
    """(FLOPs, bytes moved, ops) that replay runs in backward when ``keep`` is held on the
    device and ``moved`` on the host (replay starts from either): the replay plan's own walk
    (``closure``), each node counted once."""
    held = set(keep) | set(moved) | set(p.offloaded) | set(p.kept_anyway)
    run = closure(p.graph, p.wanted, held)
    flops = moved_bytes = 0
    for i in run:
        c = node_cost(p.graph.nodes[i])
        flops += c[0]
        moved_bytes += c[1]
    return (flops, moved_bytes, len(run))


def least_budget(p: Problem) -> int:
    """The int budget of the least plan: what the region must keep (MUST_SAVE, collectives)."""
    groups = p.graph.groups
    return sum(groups[g].nbytes for g in p.forced_in) + p.reserved


def knapsack_frontier(weights: list[int], values: list[tuple], points: int = MAX_POINTS) -> list[list[int]]:
    """Subsets of the items (indices), most weight first, each the greatest summed ``values``
    (tuples compared in order) within its own weight, as ``planners.knapsack`` chooses within a
    capacity: the table is filled once for the whole weight, then read back at each capacity
    where the best value changes (at most ``points`` of them, evenly spaced in capacity beyond
    that). Weights are counted in units of their gcd, coarser past ``planners.MAX_CELLS`` cells
    (rounded up: a subset's true weight is never above the capacity it was chosen within)."""
    n = len(weights)
    if n == 0:
        return [[]]
    q = 0
    for w in weights:
        q = math.gcd(q, w)
    q = max(q, 1)
    total = sum(weights)
    if total // q > PLANNER_CELLS:
        q = -(-total // PLANNER_CELLS)
    units = [-(-w // q) for w in weights]
    cells = sum(units)
    width = len(values[0])
    best = torch.zeros((width, cells + 1), dtype=torch.int64)
    take = torch.zeros((n, cells + 1), dtype=torch.bool)
    for i, (u, v) in enumerate(zip(units, values)):
        cand = best[:, : cells + 1 - u] + torch.tensor(v, dtype=torch.int64).view(-1, 1)
        better = _less(best[:, u:], cand)
        take[i, u:] = better
        best[:, u:] = torch.where(better, cand, best[:, u:])
    table = take.numpy()
    stride = max(1, cells // points)
    out, c = [], cells
    while c >= 0:
        # the least capacity reaching the best value within c
        same = torch.ones(c + 1, dtype=torch.bool)
        for b in best:
            same &= b[: c + 1] == b[c]
        c = int(torch.nonzero(same)[0])
        chosen, d = [], c
        for i in range(n - 1, -1, -1):
            if table[i, d]:
                chosen.append(i)
                d -= units[i]
        out.append(sorted(chosen))
        if c == 0:
            break
        c = max(0, min(c - 1, c - stride))
    return out


def frontier(p: Problem, points: int = MAX_POINTS) -> list[Point]:
    """The plans of a region, least bytes first: the knapsack ``memory_budget`` solves (its
    items, weights and replay costs, ``planners.costs``), read at every capacity where its
    choice changes (``knapsack_frontier``), each point priced exactly (``price``); a point must
    replay less than every point with fewer bytes."""
    graph = p.graph
    groups = graph.groups
    forced = set(p.forced_in)
    fixed = p.forced_out | p.offloaded | p.kept_anyway  # replayed, on the host, or kept: no choice
    free = [
        b
        for b in bundles_of(graph, p.items)
        if not any(g in fixed for g in b) and not all(g in forced for g in b)
    ]
    weights = [sum(groups[g].nbytes for g in b if g not in forced) for b in free]
    values = costs(graph, free, "flops", p.items)
    least = sum(groups[g].nbytes for g in forced) + p.reserved
    found = []
    for chosen in knapsack_frontier(weights, values, points):
        keep = forced.union(*(free[i] for i in chosen))
        extra = sum(weights[i] for i in chosen)
        found.append(Point(least + extra, extra, price(p, keep), frozenset(keep)))
    out: list[Point] = []
    for pt in reversed(found):  # least bytes first; a point must replay less than those before it
        if not out or pt.cost < out[-1].cost:
            out.append(pt)
    return out


# --- the whole model's plan ---------------------------------------------------------------


def _less(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Where column tuples ``a`` (rows are components) are lexicographically below ``b``."""
    less = torch.zeros(a.shape[1:], dtype=torch.bool)
    tied = torch.ones(a.shape[1:], dtype=torch.bool)
    for x, y in zip(a, b):
        less |= tied & (x < y)
        tied &= x == y
    return less


def allocate(frontiers: list[list[Point]], bases: dict[int, int], budget: int):
    """One point per region (indices into each frontier) for the least summed cost, then the
    least estimated peak, with every estimate within ``budget``; and that estimate. None when
    even the least points do not fit.

    ``bases[p]`` is the most measured in an interval whose regions alive are at most the prefix
    ``0..p`` of the call order (``p = -1``: none alive), plus what the step left allocated; the
    estimate of an interval is its base plus the extra bytes of the prefix. Dynamic programming
    over regions in call order and the prefix's extra bytes, counted in units of ``q`` bytes
    (the points' gcd, or coarser to stay within ``MAX_CELLS``), each point's bytes rounded up:
    the estimate never undercounts. ``q`` does not depend on the budget, so neither does the
    estimate of a given choice."""
    n = len(frontiers)
    floor = bases.get(-1, -(2**62))
    if floor > budget:
        return None
    extras = [pt.extra for f in frontiers for pt in f if pt.extra > 0]
    q = 0
    for e in extras:
        q = math.gcd(q, e)
    q = max(q, 1)
    total = sum(max(pt.extra for pt in f) for f in frontiers) if frontiers else 0
    if total // q > MAX_CELLS:
        q = -(-total // MAX_CELLS)
    cells = -(-total // q) + 1
    width = len(frontiers[0][0].cost) if frontiers and frontiers[0] else 3
    big = torch.iinfo(torch.int64).max // 4
    # best[k, s]: component k (costs, then the estimated peak so far) of the best choice for
    # the regions so far whose extra bytes sum to s units
    best = torch.full((width + 1, cells), big, dtype=torch.int64)
    best[:, 0] = 0
    best[width, 0] = floor
    reach = torch.zeros(cells, dtype=torch.bool)
    reach[0] = True
    sizes = torch.arange(cells, dtype=torch.int64) * q  # bytes each cell stands for (rounded up)
    choices = []
    for j, points in enumerate(frontiers):
        base = bases.get(j)
        allowed = torch.ones(cells, dtype=torch.bool)
        if base is not None:
            if base > budget:
                return None
            allowed = base + sizes <= budget
        new = torch.full_like(best, big)
        new_reach = torch.zeros(cells, dtype=torch.bool)
        choice = torch.full((cells,), -1, dtype=torch.int64)
        for i, pt in enumerate(points):
            u = -(-pt.extra // q)
            if u >= cells:
                continue
            cand = best[:, : cells - u].clone()
            cand[:width] += torch.tensor(pt.cost, dtype=torch.int64).view(-1, 1)
            if base is not None:
                cand[width] = torch.maximum(cand[width], base + sizes[u:])
            ok = reach[: cells - u] & allowed[u:]
            better = ok & (~new_reach[u:] | _less(cand, new[:, u:]))
            new[:, u:] = torch.where(better, cand, new[:, u:])
            new_reach[u:] |= better
            choice[u:] = torch.where(better, i, choice[u:])
        best, reach = new, new_reach
        choices.append(choice)
        if not bool(reach.any()):
            return None
    if not bool(reach.any()):
        return None
    # the best final state: least cost, then least estimated peak
    order = torch.nonzero(reach).flatten()
    s = int(order[0])
    for c in order[1:].tolist():
        if bool(_less(best[:, c : c + 1], best[:, s : s + 1])[0]):
            s = c
    estimate = int(best[width, s])
    picked = []
    for j in range(n - 1, -1, -1):
        i = int(choices[j][s])
        picked.append(i)
        s -= -(-frontiers[j][i].extra // q)
    picked.reverse()
    return picked, estimate


# --- what a step looked like ---------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    """A reading of the meter: at ``kind`` ("start", "enter", "end", "backward", "stop") of
    region ``index`` (named ``name``), ``now`` bytes in use and ``most`` since the last reading."""

    kind: str
    index: int
    name: str
    now: int
    most: int

    def describe(self) -> str:
        if self.kind == "start":
            return "the start of the step"
        if self.kind == "stop":
            return "the end of the step (its optimizer step included)"
        if self.kind == "done":
            return "the end of the backward"
        what = {"enter": "the start of {}'s forward", "end": "the end of {}'s forward"}
        return what.get(self.kind, "the start of {}'s backward").format(self.name)


@dataclass(frozen=True)
class Interval:
    """From reading ``after`` to reading ``until``: the most in use, and the regions alive
    (forward ended, backward not begun)."""

    after: Event
    until: Event
    most: int
    alive: frozenset

    @property
    def prefix(self) -> int:
        return max(self.alive) if self.alive else -1

    def describe(self) -> str:
        return f"from {self.after.describe()} to {self.until.describe()}"


class _Window:
    """One measured step: the meter, its readings, and each region's frontier. It is read from
    the step's first region to the end of the first optimizer step after its backward (a
    ``torch.optim`` step post-hook), or to the next step's first region without one."""

    def __init__(self, plan: _Plan, meter: Meter, number: int):
        self.plan = plan
        self.meter = meter
        self.number = number
        self.names: list[str] = []
        self.regions: dict[int, _Measured] = {}
        self.queued = False  # a callback at the end of the backward
        self.closed = False
        self.after = None  # bytes in use at the next step's first region
        start = meter.start()
        self.events = [Event("start", -1, "", start, start)]
        self.hook = register_optimizer_step_post_hook(self._stepped)

    def event(self, kind: str, index: int, name: str) -> None:
        if not self.closed:
            now, most = self.meter.mark()
            self.events.append(Event(kind, index, name, now, most))

    def _stepped(self, optimizer, args, kwargs) -> None:
        if any(e.kind == "done" for e in self.events):  # the step's own optimizer step, not one before
            self.close()

    def close(self) -> None:
        """Stop measuring (idempotent): the meter's last reading ends the step."""
        if not self.closed:
            now, most = self.meter.stop()
            self.events.append(Event("stop", -1, "", now, most))
            self.closed = True
            self.hook.remove()

    @property
    def start(self) -> int:
        return self.events[0].now

    @property
    def growth(self) -> int:
        """What the step left allocated beyond what it started with (a first step's optimizer
        state), read at the next step's first region: alive in every interval of the steps
        after it."""
        end = self.after if self.after is not None else self.events[-1].now
        return max(0, end - self.events[0].now)

    @property
    def most(self) -> int:
        return max(e.most for e in self.events)

    def intervals(self) -> list[Interval]:
        ended, begun, out = set(), set(), []
        for before, e in zip(self.events, self.events[1:]):
            out.append(Interval(before, e, e.most, frozenset(ended - begun)))
            if e.kind == "end":
                ended.add(e.index)
            elif e.kind == "backward":
                begun.add(e.index)
        return out


def _constants(window: _Window, extra: list[int]) -> list[tuple[Interval, int]]:
    """Each interval with its constant: the most measured there, less the extra bytes the regions
    alive there kept in this step, plus what the step left allocated (its next steps hold it
    throughout; from the end of the backward on, the optimizer step that made it is measured)."""
    out = []
    growth, after = window.growth, False
    for iv in window.intervals():
        after = after or iv.after.kind == "done"
        out.append(
            (iv, iv.most - sum(extra[j] for j in iv.alive if j < len(extra)) + (0 if after else growth))
        )
    return out


def _bases(window: _Window, extra: list[int], into: dict, where: dict) -> None:
    """Each prefix's base (``allocate``) into ``into``: the largest constant of the intervals it
    bounds (of this window's and what ``into`` held), and ``where`` that interval is."""
    for iv, c in _constants(window, extra):
        p = iv.prefix
        if p not in into or c > into[p]:
            into[p], where[p] = c, iv.describe()


# --- the report ------------------------------------------------------------------------


@dataclass
class PeakReport:
    """What ``peak(budget)`` measured and chose for one input shape (``Peak.report()``)."""

    budget: int
    meter: str
    start: int  # in use when the step's first region began: parameters, gradients, optimizer state, inputs
    growth: int  # left allocated by the measured step (a first step's optimizer state)
    least: int  # the least peak the model estimates (every region keeping its least)
    estimate: int  # the chosen plan's estimated peak
    where: str  # the interval the estimate's peak is in
    regions: list  # (name, bytes kept beyond the least, replay cost of the plan, of the least plan)
    measured: list = field(default_factory=list)  # peaks of the steps measured after planning
    replanned: bool = False

    def __str__(self) -> str:
        lines = [
            f"peak({_show(self.budget)!r}): estimated peak {human_bytes(self.estimate)} "
            f"(budget {human_bytes(self.budget)}, least reachable {human_bytes(self.least)}), {self.where}",
            f"  in use at the step's start {human_bytes(self.start)} (parameters, gradients, optimizer "
            f"state, inputs); left by the first step {human_bytes(self.growth)}; measured with {self.meter}",
        ]
        if self.measured:
            said = ", ".join(human_bytes(m) for m in self.measured)
            lines.append(
                f"  measured peak of the steps after planning: {said}"
                + (" (re-planned once)" if self.replanned else "")
            )
        lines.append(
            f"  {'region':<24} {'kept beyond least':>18} {'replay GFLOP':>13} {'(least)':>9} {'ops':>5}"
        )
        for name, extra, cost, least in self.regions:
            gflop, least_gflop = cost[0] / 1e9, least[0] / 1e9
            lines.append(
                f"  {name:<24} {human_bytes(extra):>18} {gflop:>13.4f} {least_gflop:>9.4f} {cost[2]:>5}"
            )
        return "\n".join(lines)


# --- the planners a region runs ----------------------------------------------------------


@dataclass(frozen=True)
class _Share(Planner):
    """What one region runs under ``peak`` once it is planned: ``memory_budget(budget)`` (an
    int of bytes), or with ``budget`` None the least the region may keep. It plans only where
    the plan prepared for the region does not apply (``Peak.bind`` puts that one in the plan
    cache, so the region decides as it records: a new structure, an MoE's routing)."""

    peak: Peak
    budget: int | None = None

    def place(self, p: Problem) -> tuple[set, set]:
        budget = least_budget(p) if self.budget is None else max(self.budget, least_budget(p))
        return MemoryBudget(budget).place(p)

    def __repr__(self) -> str:
        what = "the least" if self.budget is None else f"memory_budget({self.budget})"
        return f"{self.peak!r}: {what}"


class _Watch:
    """Follows one region call for its ``Peak``: the end of its forward and the start of its
    backward (the first saved tensor autograd unpacks), which also tells the next step apart."""

    __slots__ = ("state", "index", "name", "window", "armed")

    def __init__(self, state: _State, index: int, name: str, window: int):
        self.state, self.index, self.name, self.window, self.armed = state, index, name, window, True

    def unpack(self, handle):
        if self.armed:
            self.armed = False
            self.state.reached(self)
        return handle.unpack()

    def finished(self, region) -> None:
        self.state.ended(self, region)


MEASURE, CHECK, STEADY = "measure", "check", "steady"


@dataclass(frozen=True)
class _Measured:
    """A region as the measured step recorded it: its frontier, and what the plan cache checks a
    plan against (each node's signature; what autograd saved and the MUST decisions)."""

    name: str
    frontier: list
    signatures: tuple
    context: tuple


class _Plan:
    """The plan for one input shape: measured, then checked, then kept."""

    def __init__(self, key):
        self.key = key
        self.phase = MEASURE
        self.names: list[str] = []
        self.frontiers: list[list[Point]] = []
        self.regions: list[_Measured | None] = []
        self.bases: dict[int, int] = {}
        self.where: dict[int, str] = {}  # prefix -> the interval its base was measured in
        self.picked: list[int] | None = None
        self.report: PeakReport | None = None
        self.cached: set = set()  # the region indices whose prepared plan is in the plan cache
        self.shares: dict = {}  # budget -> the _Share regions run under

    def point(self, index: int) -> Point | None:
        if self.picked is None or index >= len(self.picked):
            return None
        return self.frontiers[index][self.picked[index]]


class _State:
    """A ``Peak``'s coordination of the regions it runs: the step's call order, the plans by
    input shape, the window being measured."""

    def __init__(self):
        self.plans: OrderedDict = OrderedDict()
        self.plan: _Plan | None = None
        self.window: _Window | None = None
        self.windows = 0
        self.index = 0
        self.backward_seen = True  # the first region starts a step
        self.frontiers: dict = {}  # a region's structure -> its frontier (blocks alike priced once)

    def __deepcopy__(self, memo):
        return _State()  # a copied model measures its own steps

    def close(self) -> None:
        """Stop measuring now; a step measured in part is measured again."""
        w, self.window = self.window, None
        if w is not None:
            w.close()
            self.backward_seen = True

    def __getstate__(self):
        return {}

    def __setstate__(self, state):
        self.__init__()

    # -- events --
    def ended(self, watch: _Watch, region) -> None:
        w = self.window
        if w is None or w.number != watch.window:
            return
        w.event("end", watch.index, watch.name)
        if w.plan.phase == MEASURE:
            w.meter.pause()  # (what pricing allocates is not the step's)
            try:
                w.regions[watch.index] = self.measured(watch.name, region)
            finally:
                w.meter.resume()

    def measured(self, name: str, region) -> _Measured:
        """``region`` (run keeping the least, at its end with its graph whole) as ``_Measured``:
        its frontier priced on the problem a planner would see, shared by regions alike."""
        graph = region.graph
        kept = [s for s in region.kept if not s.exact]
        wanted = region_values(graph, graph.slots()) | region_values(graph, kept)
        held = [g.id for g in graph.groups if g.held is not None and g.node is not None]
        signatures = tuple(signature(n) for n in graph.nodes)
        context = (frozenset(wanted), tuple(must_decisions(graph).items()))
        points = self.frontiers.get((signatures, context))
        if points is None:
            points = self.frontiers[(signatures, context)] = frontier(problem(graph, wanted, None, held))
            while len(self.frontiers) > 4 * MAX_PLANS:
                self.frontiers.pop(next(iter(self.frontiers)))
        return _Measured(name, points, signatures, context)

    def reached(self, watch: _Watch) -> None:
        if watch.window == self.windows:
            self.backward_seen = True
        w = self.window
        if w is not None and w.number == watch.window:
            w.event("backward", watch.index, watch.name)
            if not w.queued:  # the end of this backward: what follows (the optimizer) is apart
                w.queued = True
                try:
                    torch.autograd.Variable._execution_engine.queue_callback(lambda: self.done(w))
                except RuntimeError:  # unpacked outside a backward (a saved tensor read by hand)
                    w.queued = False

    def done(self, w: _Window) -> None:
        if self.window is w and w.events[-1].kind != "done":
            w.event("done", -1, "")


def _device(region) -> torch.device:
    for _, ref in region.arg_refs:
        t = ref()
        if t is not None:
            return t.device
    module = region.module
    if module is not None:
        for t in module.parameters():
            return t.device
    return torch.device("cpu")


def _signature(region) -> tuple:
    """What a step's plan is kept by: the shapes and dtypes of its first region's inputs."""
    out = []
    for label, ref in region.arg_refs:
        t = ref()
        if t is not None:
            out.append((label, tuple(t.shape), t.dtype, t.device))
    return (region.graph.name, tuple(out), torch.is_autocast_enabled())


@dataclass(frozen=True, eq=False)
class Peak(Planner):
    """Every region it runs planned so that the step's peak on the device is at most ``budget``
    bytes, at the least estimated replay (module docstring). One object per model: it
    coordinates the regions that share it, so it compares by identity."""

    # Each call of its regions is followed (a watch on the region's unpack and end marks the
    # step's intervals, even once planned), so its regions record every call: no warm path.
    structural = False

    budget: int
    meter: object = None  # None: ``meter_for`` the device; else a Meter, or a callable device -> Meter
    state: _State = field(default_factory=_State, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        # A step measured when the program stops (its last step, an exception) leaves the CPU
        # meter's mode on the dispatch stack until the next step: gone with the policy at the latest.
        weakref.finalize(self, self.state.close)

    def close(self) -> None:
        """Stop measuring now (a program that stops in a measured step: the CPU meter's mode
        leaves the dispatch stack); a step cut short is measured again at the next step."""
        self.state.close()

    # -- a region's planner, chosen when it starts (region.py) --
    def bind(self, region, code=None, args=(), kwargs=None):
        """The planner for ``region`` and the watch that follows it. In a measured step the
        planner is None: the region runs as the policy alone decides (the least, full
        recompute), and is priced at its end (``_State.measured``). Once planned, a ``_Share``
        whose plan is put in the plan cache under the key the region looks up (``code``,
        ``args``, ``kwargs``: the region's call), so it decides as it records and never holds
        more than the plan keeps, from its first planned step on."""
        st = self.state
        if region.report:  # a report: planned as the last plan says, and not part of a step
            return self._reported(region.graph.name), None
        if st.backward_seen:
            self._begin_step(region)
        k = st.index
        st.index += 1
        name = region.graph.name
        w = st.window
        if w is not None:
            w.names.append(name)
            w.event("enter", k, name)
        plan = st.plan
        watch = _Watch(st, k, name, st.windows)
        if plan.phase == MEASURE:
            return None, watch
        same = k < len(plan.names) and plan.names[k] == name
        pt = plan.point(k) if same else None
        measured = plan.regions[k] if same else None
        if pt is None or measured is None:  # no plan for it (the measured step had no such region)
            return None, watch  # the least
        planner = plan.shares.get(pt.budget)
        if planner is None:  # (one per budget: regions alike share a plan-cache entry)
            planner = plan.shares[pt.budget] = _Share(self, pt.budget)
        if k not in plan.cached:
            key = plan_key((region.spec.policy, planner), code, region.module, args, kwargs)
            if key is not None:
                if plans.get(key) is None:
                    plans.put(key, measured.signatures, pt.keep, measured.context)
                plan.cached.add(k)
        return planner, watch

    def _reported(self, name: str) -> _Share:
        plan = self.state.plan
        if plan is not None and plan.picked is not None and name in plan.names:
            pt = plan.point(plan.names.index(name))
            return _Share(self, pt.budget if pt is not None else None)
        return _Share(self, None)

    def _begin_step(self, region) -> None:
        st = self.state
        st.backward_seen = False
        st.index = 0
        st.windows += 1
        done, st.window = st.window, None
        if done is not None:
            done.close()
            done.after = done.meter.now()
            self._learn(done)  # may raise: the budget cannot be met
        key = _signature(region)
        plan = st.plans.get(key)
        if plan is None:
            plan = st.plans[key] = _Plan(key)
            while len(st.plans) > MAX_PLANS:
                st.plans.popitem(last=False)
        st.plans.move_to_end(key)
        st.plan = plan
        if plan.phase != STEADY:
            m = self.meter
            meter = (
                meter_for(_device(region))
                if m is None
                else (m if isinstance(m, Meter) else m(_device(region)))
            )
            st.window = _Window(plan, meter, st.windows)

    # -- after a measured step --
    def _learn(self, w: _Window) -> None:
        plan = w.plan
        if plan.phase == MEASURE:
            n = len(w.names)
            plan.names = list(w.names)
            plan.regions = [w.regions.get(j) for j in range(n)]
            plan.frontiers = [r.frontier if r is not None else [Point(0, 0, (0, 0, 0))] for r in plan.regions]
            _bases(w, [0] * n, plan.bases, plan.where)
            self._choose(plan, w)
            plan.phase = CHECK
            return
        measured = w.most
        plan.report.measured.append(measured)
        if measured <= self.budget:
            plan.phase = STEADY
            return
        if plan.report.replanned:
            plan.phase = STEADY
            warnings.warn(
                f"{self!r}: the step after re-planning peaked at {human_bytes(measured)}, "
                f"{human_bytes(measured - self.budget)} over the budget ({human_bytes(self.budget)}); "
                f"the plan is kept. Lower the budget by that much to leave room (Peak.report() has the "
                "figures), or measure again with a new Peak.",
                stacklevel=4,
            )
            return
        # Re-plan once: each interval's constant the larger of the two steps' (this one has the
        # steady state: optimizer state, gradients as a step leaves them)
        extra = [(plan.point(j).extra if plan.point(j) is not None else 0) for j in range(len(plan.names))]
        _bases(w, extra, plan.bases, plan.where)
        measured_list = plan.report.measured
        self._choose(plan, w)
        plan.report.measured = measured_list
        plan.report.replanned = True
        plan.cached = set()  # new points: their plans go in the cache at the next step
        plan.phase = CHECK

    def _choose(self, plan: _Plan, w: _Window) -> None:
        found = allocate(plan.frontiers, plan.bases, self.budget)
        least = max(plan.bases.values()) if plan.bases else 0
        if found is None:
            plan.picked = None
            plan.phase = STEADY  # every region keeps its least from now on
            raise CheckpointError(self._cannot_fit(w, plan, least))
        plan.picked, estimate = found
        extra = [plan.point(j).extra for j in range(len(plan.picked))]
        top = max(plan.bases, key=lambda p: plan.bases[p] + sum(extra[: p + 1]))
        plan.report = PeakReport(
            budget=self.budget,
            meter=w.meter.describe(),
            start=w.start,
            growth=w.growth,
            least=least,
            estimate=estimate,
            where=plan.where[top],
            regions=[
                (plan.names[j], plan.point(j).extra, plan.point(j).cost, plan.frontiers[j][0].cost)
                for j in range(len(plan.names))
            ],
        )

    def _cannot_fit(self, w: _Window, plan: _Plan, least: int) -> str:
        top, value = max(_constants(w, [0] * len(plan.names)), key=lambda ivc: ivc[1])
        growth = value - top.most
        alive = [plan.names[j] for j in sorted(top.alive) if j < len(plan.names)]
        held = (
            f"what {len(alive)} region(s) alive there hold for backward ({_names(alive)}: their inputs and "
            "what they must keep)"
            if alive
            else "no region's activations (every region's backward had begun)"
        )
        later = (
            f"{human_bytes(growth)} more is there in the steps after it (left by this step: optimizer state "
            "a first step makes), "
            if growth > 0
            else ""
        )
        return (
            f"{self!r} cannot be met: the least peak tracedac reaches on this step is "
            f"{human_bytes(least)}, above the budget of {human_bytes(self.budget)} (measured with every "
            f"region keeping the least it may, {w.meter.describe()}). It occurs {top.describe()}: "
            f"{human_bytes(top.most)} in use there, of which {human_bytes(w.start)} was in use when the "
            "step's first region began (parameters, gradients, optimizer state, inputs, every other tensor "
            f"on the device), {later}and the rest is {held} and the working set of that moment. To fit: "
            f"raise the budget to at least {human_bytes(least)}, shrink the batch or the sequence, shard "
            "parameters, gradients and optimizer state (tracedac.zero), or checkpoint more of the model "
            "(what lies between the regions is kept)."
        )

    # -- unbound: a report, a compiled region, a direct call --
    def place(self, p: Problem) -> tuple[set, set]:
        return MemoryBudget(least_budget(p)).place(p)

    def report(self) -> PeakReport | None:
        """What was measured and chosen for the last step's input shape (None before a plan)."""
        plan = self.state.plan
        return None if plan is None else plan.report

    def compiled_budget(self, name: str) -> int:
        """The bytes a compiled region may keep: the least any region got in the eager plan
        (compiled regions of one class are one graph, so per-layer limits cannot be told apart
        there). Refused before an eager step has been planned."""
        plan = self.state.plan
        if plan is None or plan.picked is None:
            raise CheckpointError(
                f"{self!r} under torch.compile: the plan is made from a measured eager step, and none has "
                f"run yet (region {name!r}). Run one training step eagerly first (before torch.compile, or "
                "under torch.compiler.set_stance('force_eager')), then compile: each compiled region then "
                "keeps at most the least bytes the eager plan gave a region. Or compile with "
                "memory_budget(...)."
            )
        return min(plan.point(j).budget for j in range(len(plan.picked)))

    def __repr__(self) -> str:
        return f"peak({_show(self.budget)!r})"


def _names(names: list[str]) -> str:
    if len(names) <= 4:
        return ", ".join(names)
    return f"{names[0]}, {names[1]}, ... {names[-1]}"


def peak(budget, *, meter=None) -> Peak:
    """Plan every region so that the step's peak on the device is at most ``budget``: an int of
    bytes or a string with a unit (``"70GiB"``, ``"1.5 GB"``), everything on the device included
    (parameters, gradients, optimizer state, ZeRO's gathered buffers, activations).

    The first step (of each input shape) runs keeping the least (full recompute) and is
    measured; every region is then planned to keep, within the budget, what saves the most
    replay; the next step is measured and, if it peaks above the budget, planned again once.
    A budget below the least reachable peak raises a ``CheckpointError`` saying what it is and
    what holds it. ``meter``: how device memory is read (default: ``torch.cuda``'s allocator
    statistics on CUDA, live tensor storages on the CPU; see ``policies.meter``). Use one
    ``peak`` object per model: it coordinates the regions it runs.
    """
    if meter is not None and not (isinstance(meter, Meter) or callable(meter)):
        raise TypeError(
            f"peak(meter={meter!r}): a meter is a policies.meter.Meter (start(), mark(), stop()) or a "
            "callable taking the device and returning one."
        )
    return Peak(parse_bytes(budget), meter)
