"""The trade-off between bytes kept and replay: ``trade_off(fn, ...)`` and its plot.

One forward is recorded; every budget is then planned on that graph (the same knapsack
``memory_budget`` runs), and what replay would run is worked out for each plan with the
replay planner's own rules. Nothing is run again, so a sweep costs one forward.
"""

from __future__ import annotations

from dataclasses import dataclass

from .decisions import is_save, resolve
from .graph import human_bytes
from .inspect import record
from .planners import MemoryBudget, Planner, closure, problem, region_values
from .policies import OffloadKept, either, memory_budget, recompute_all, save_all, save_matmuls

__all__ = ["TradeOff", "TradeOffRow", "trade_off"]


@dataclass(frozen=True)
class TradeOffRow:
    """One plan: what it keeps, and what replaying the rest costs in backward."""

    budget: float | int | None  # None for a per-op policy's point
    bytes_kept: int  # computed in the region and kept (inputs are not counted)
    replay_flops: int  # by torch's FLOP formulas, as saved_report counts them
    ops_replayed: int
    policy: str


class TradeOff(list):
    """Rows of ``trade_off``; ``references`` holds the points of per-op policies."""

    def __init__(self, rows, references, full: int):
        super().__init__(rows)
        self.references = references
        self.full = full  # bytes kept without checkpointing, summed over the regions

    def __str__(self) -> str:
        lines = [f"{'budget':>8}  {'bytes kept':>12}  {'replay GFLOP':>12}  {'ops':>5}  policy"]
        for r in [*self, *self.references]:
            budget = (
                ""
                if r.budget is None
                else (f"{r.budget:.2f}" if isinstance(r.budget, float) else str(r.budget))
            )
            lines.append(
                f"{budget:>8}  {human_bytes(r.bytes_kept):>12}  {r.replay_flops / 1e9:>12.4f}  "
                f"{r.ops_replayed:>5}  {r.policy}"
            )
        lines.append(f"(without checkpointing the region keeps {human_bytes(self.full)})")
        return "\n".join(lines)

    def plot(self, ax=None):
        """Draw the frontier (bytes kept against replay FLOPs) and the per-op policies' points
        with matplotlib; returns the axes."""
        import matplotlib.pyplot as plt

        if ax is None:
            _, ax = plt.subplots(figsize=(6, 4))
        mib = [r.bytes_kept / 2**20 for r in self]
        gflop = [r.replay_flops / 1e9 for r in self]
        ax.step(mib, gflop, where="post", marker="o", label="memory_budget")
        for r in self.references:
            ax.scatter([r.bytes_kept / 2**20], [r.replay_flops / 1e9], marker="x", s=60, zorder=3)
            ax.annotate(
                r.policy,
                (r.bytes_kept / 2**20, r.replay_flops / 1e9),
                textcoords="offset points",
                xytext=(5, 5),
                fontsize=8,
            )
        ax.set_xlabel("bytes kept after forward (MiB)")
        ax.set_ylabel("replay in backward (GFLOP)")
        ax.set_title("memory vs. replay")
        ax.legend(loc="upper right")
        return ax


class _Region:
    """One recorded region's planning problem."""

    def __init__(self, region):
        self.graph = graph = region.graph
        self.problem = problem(graph, region_values(graph, region.handles))
        self.wanted = self.problem.wanted
        self.items = self.problem.items
        self.item_set = set(self.items)
        self.full = self.problem.full
        self._prepared: dict = {}

    def evaluate(self, kept: set) -> tuple[int, int, int]:
        """(bytes kept, replay FLOPs, ops replayed) when the storages ``kept`` are held."""
        graph = self.graph
        run = closure(
            graph, self.wanted, kept | self.problem.offloaded
        )  # offloaded: replay starts on the host copy
        read = {m.group for i in run for m in graph.nodes[i].tensor_args}
        used = {g for g in kept if g in self.item_set or g in read}  # a kept result nothing reads is let go
        return (sum(graph.groups[g].nbytes for g in used), sum(graph.nodes[i].flops for i in run), len(run))

    def plan(self, planner: MemoryBudget) -> set:
        solve = self._prepared.get(planner.cost)
        if solve is None:  # priced once per cost model, whatever the number of budgets
            solve = self._prepared[planner.cost] = planner.prepare(self.problem)
        p = self.problem  # a collective's result is kept whatever the budget: counted first
        return solve(max(0, planner.bytes_for(self.full) - p.reserved), planner) | p.kept_anyway

    def kept_by(self, policy) -> set:
        """What a per-op policy keeps: the storages whose last writer it decides to save."""
        return {g.id for g in self.graph.groups if g.creator is not None and is_save(resolve(policy, g.node))}


def _recording_policy(fn):
    """Record under the region's own per-op decisions, with nothing left to the planner to drop."""
    policy = getattr(getattr(fn, "_tracedac", None), "policy", None)
    if isinstance(policy, OffloadKept):  # the sweep is of what the policy inside would keep
        policy = policy.policy
    rest = [p for p in getattr(policy, "policies", (policy,)) if p is not None and not isinstance(p, Planner)]
    return either(*rest, memory_budget(1.0)) if rest else memory_budget(1.0)


def trade_off(fn, *args, budgets=None, **kwargs) -> TradeOff:
    """Bytes kept against replay cost for ``fn(*args, **kwargs)``, planned by ``memory_budget``.

    ``budgets``: fractions (or int bytes) to plan for; by default, fractions 0.00, 0.01, ..,
    1.00, of which only the Pareto frontier is returned (no row keeps more and replays more
    than another). Rows are summed over the regions ``fn`` runs (a plain function or module
    is one region). ``.references`` holds ``recompute_all()``, ``save_matmuls()`` and
    ``save_all()``; ``.plot()`` draws it all.
    """
    regions, out = record(fn, args, kwargs, _recording_policy(fn))
    del out
    problems = [_Region(r) for r in regions]
    frontier = budgets is None
    if frontier:
        budgets = [i / 100 for i in range(101)]

    def row(budget, kept_by, policy) -> TradeOffRow:
        totals = [p.evaluate(kept_by(p)) for p in problems]  # summed over the regions
        return TradeOffRow(budget, *(sum(t[k] for t in totals) for k in range(3)), repr(policy))

    rows = []
    for b in budgets:
        planner = memory_budget(b)  # validates the budget
        rows.append(row(b, lambda p: p.plan(planner), planner))
    if frontier:
        rows = _pareto(rows)
    references = [
        row(None, lambda p: p.kept_by(policy), policy)
        for policy in (recompute_all(), save_matmuls(), save_all())
    ]
    return TradeOff(rows, references, sum(p.full for p in problems))


def _pareto(rows: list[TradeOffRow]) -> list[TradeOffRow]:
    """The rows no other row beats on bytes, FLOPs and ops replayed; of equal ones, the
    lowest budget."""
    out = []
    for r in sorted(rows, key=lambda r: (r.bytes_kept, r.replay_flops, r.ops_replayed, r.budget)):
        if not any(e.replay_flops <= r.replay_flops and e.ops_replayed <= r.ops_replayed for e in out):
            out.append(r)
    return out
