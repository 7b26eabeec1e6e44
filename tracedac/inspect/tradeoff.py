"""The trade-off between bytes kept and replay: ``trade_off(fn, ...)`` and its plot.

One forward is recorded; every budget is then planned on that graph (the same knapsack
``memory_budget`` runs), and what replay would run is worked out for each plan with the
replay planner's own rules. Nothing is run again, so a sweep costs one forward. With
``offload``, every budget is planned again by ``memory_budget(b, offload=...)``: the offload
frontier, the third choice's bytes in host memory beside each point.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..policies import either, memory_budget, recompute_all, save_all, save_matmuls
from ..policies.planners import MemoryBudget, Planner, closure, problem, region_values
from ..policies.spec import spec_of
from ..policies.wrappers import OffloadKept
from ..record.decisions import is_save, resolve
from ..record.graph import human_bytes
from .saved import record

__all__ = ["TradeOff", "TradeOffRow", "trade_off"]


@dataclass(frozen=True)
class TradeOffRow:
    """One plan: what it keeps, and what replaying the rest costs in backward."""

    budget: float | int | None  # None for a per-op policy's point
    bytes_kept: int  # computed in the region and kept (inputs are not counted)
    replay_flops: int  # by torch's FLOP formulas, as saved_report counts them
    ops_replayed: int
    policy: str
    bytes_offloaded: int = 0  # in host memory after the forward (what the plan or policy offloads)


class TradeOff(list):
    """Rows of ``trade_off``; ``references`` holds the points of per-op policies."""

    def __init__(self, rows, references, full: int, offloaded=(), offload=False):
        super().__init__(rows)
        self.references = references
        self.full = full  # bytes kept without checkpointing, summed over the regions
        self.offloaded = list(offloaded)  # the rows of memory_budget(b, offload=...), if asked for
        self.offload = offload

    def __str__(self) -> str:
        every = [*self, *self.offloaded, *self.references]
        host = any(r.bytes_offloaded for r in every)  # the column only where something is offloaded
        extra = f"  {'offloaded':>12}" if host else ""
        lines = [f"{'budget':>8}  {'bytes kept':>12}{extra}  {'replay GFLOP':>12}  {'ops':>5}  policy"]
        for r in every:
            budget = (
                ""
                if r.budget is None
                else (f"{r.budget:.2f}" if isinstance(r.budget, float) else str(r.budget))
            )
            extra = f"  {human_bytes(r.bytes_offloaded):>12}" if host else ""
            lines.append(
                f"{budget:>8}  {human_bytes(r.bytes_kept):>12}{extra}  {r.replay_flops / 1e9:>12.4f}  "
                f"{r.ops_replayed:>5}  {r.policy}"
            )
        lines.append(f"(without checkpointing the region keeps {human_bytes(self.full)})")
        return "\n".join(lines)

    def plot(self, ax=None):
        """Draw the frontier (bytes kept on the device against replay FLOPs), the offload
        frontier if planned (its points labelled with the bytes they offload) and the per-op
        policies' points with matplotlib; returns the axes."""
        try:
            import matplotlib.pyplot as plt
        except ImportError as e:
            raise ImportError(
                "TradeOff.plot() draws with matplotlib, which is not installed here. Install it "
                "(pip install matplotlib, or tracedac's 'plot' extra), or print() the trade-off: "
                "the same frontier as a table."
            ) from e

        if ax is None:
            # constrained layout keeps the axis labels inside the figure (a plain 6x4 figure cut
            # the y-label off on the left)
            _, ax = plt.subplots(figsize=(7, 4), layout="constrained")
        mib = [r.bytes_kept / 2**20 for r in self]
        gflop = [r.replay_flops / 1e9 for r in self]
        ax.step(mib, gflop, where="post", marker="o", label="memory_budget")
        if self.offloaded:
            rows = self.offloaded
            x, y = [r.bytes_kept / 2**20 for r in rows], [r.replay_flops / 1e9 for r in rows]
            ax.step(x, y, where="post", marker="s", label=f"memory_budget(b, offload={self.offload!r})")
            for r, xy in zip(rows, zip(x, y)):
                if r.bytes_offloaded:
                    text = f"+{human_bytes(r.bytes_offloaded)} host"
                    ax.annotate(text, xy, textcoords="offset points", xytext=(4, -10), fontsize=7)
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
        # outside the axes, to the right: inside, it covered a point of the frontier
        ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize=8)
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

    def evaluate(self, kept: set, moved=frozenset()) -> tuple[int, int, int, int]:
        """(bytes kept, replay FLOPs, ops replayed, bytes offloaded) when the storages ``kept``
        are held and those ``moved`` (and those the policy offloads) are on the host."""
        graph = self.graph
        host = moved | self.problem.offloaded
        run = closure(graph, self.wanted, kept | host)  # offloaded: replay starts on the host copy
        read = {m.group for i in run for m in graph.nodes[i].tensor_args}
        used = {g for g in kept if g in self.item_set or g in read}  # a kept result nothing reads is let go
        host = {g for g in host if g in self.item_set or g in read}
        nbytes = graph.groups
        return (
            sum(nbytes[g].nbytes for g in used),
            sum(graph.nodes[i].flops for i in run),
            len(run),
            sum(nbytes[g].nbytes for g in host),
        )

    def plan(self, planner: MemoryBudget) -> set:
        """What ``planner`` keeps on the device."""
        return self.place(planner)[0]

    def place(self, planner: MemoryBudget) -> tuple[set, set]:
        """(kept, offloaded) by ``planner``."""
        key = (planner.cost, planner.offload)
        solve = self._prepared.get(key)
        if solve is None:  # priced once per cost model and link, whatever the number of budgets
            solve = self._prepared[key] = planner.prepare(self.problem)
        p = self.problem  # a collective's result is kept whatever the budget: counted first
        kept, moved = solve(max(0, planner.bytes_for(self.full) - p.reserved), planner)
        return kept | p.kept_anyway, moved

    def kept_by(self, policy) -> tuple[set, set]:
        """What a per-op policy keeps: the storages whose last writer it decides to save."""
        spec = spec_of(policy)
        kept = {g.id for g in self.graph.groups if g.creator is not None and is_save(resolve(spec, g.node))}
        return kept, frozenset()


def _recording_policy(fn):
    """Record under the region's own per-op decisions, with nothing left to the planner to drop."""
    policy = getattr(getattr(fn, "_tracedac", None), "policy", None)
    if isinstance(policy, OffloadKept):  # the sweep is of what the policy inside would keep
        policy = policy.policy
    rest = [p for p in getattr(policy, "policies", (policy,)) if p is not None and not isinstance(p, Planner)]
    return either(*rest, memory_budget(1.0)) if rest else memory_budget(1.0)


def trade_off(fn, *args, budgets=None, offload=False, **kwargs) -> TradeOff:
    """Bytes kept against replay cost for ``fn(*args, **kwargs)``, planned by ``memory_budget``.

    ``budgets``: fractions (or int bytes) to plan for; by default, fractions 0.00, 0.01, ..,
    1.00, of which only the Pareto frontier is returned (no row keeps more and replays more
    than another). Rows are summed over the regions ``fn`` runs (a plain function or module
    is one region). ``.references`` holds ``recompute_all()``, ``save_matmuls()`` and
    ``save_all()``; ``.plot()`` draws it all. ``offload`` (True, or a ``policies.Link``):
    ``.offloaded`` holds the same budgets planned by ``memory_budget(b, offload=offload)``,
    each row with the bytes it offloads (``bytes_offloaded``); the plot draws that frontier too.
    """
    regions, out = record(fn, args, kwargs, _recording_policy(fn))
    del out
    problems = [_Region(r) for r in regions]
    frontier = budgets is None
    if frontier:
        budgets = [i / 100 for i in range(101)]

    def row(budget, placed, policy) -> TradeOffRow:
        totals = [p.evaluate(*placed(p)) for p in problems]  # summed over the regions
        kept, flops, ops, host = (sum(t[k] for t in totals) for k in range(4))
        return TradeOffRow(budget, kept, flops, ops, repr(policy), host)

    def sweep(**options) -> list[TradeOffRow]:
        rows = {}
        for i in sorted(range(len(budgets)), key=lambda i: budgets[i], reverse=True):  # (see Placer)
            planner = memory_budget(budgets[i], **options)  # validates the budget (and the link)
            rows[i] = row(budgets[i], lambda p: p.place(planner), planner)
        rows = [rows[i] for i in range(len(budgets))]
        return _pareto(rows) if frontier else rows

    rows = sweep()
    offloaded = sweep(offload=offload) if offload is not False else ()
    references = [
        row(None, lambda p: p.kept_by(policy), policy)
        for policy in (recompute_all(), save_matmuls(), save_all())
    ]
    return TradeOff(rows, references, sum(p.full for p in problems), offloaded, offload)


def _pareto(rows: list[TradeOffRow]) -> list[TradeOffRow]:
    """The rows no other row beats on bytes kept, FLOPs and ops replayed and bytes offloaded;
    of equal ones, the lowest budget."""
    out = []
    key = lambda r: (r.bytes_kept, r.replay_flops, r.ops_replayed, r.bytes_offloaded, r.budget)  # noqa: E731
    for r in sorted(rows, key=key):
        if not any(
            e.replay_flops <= r.replay_flops
            and e.ops_replayed <= r.ops_replayed
            and e.bytes_offloaded <= r.bytes_offloaded
            for e in out
        ):
            out.append(r)
    return out
