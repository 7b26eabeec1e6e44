"""``--compile``'s equal-bytes comparison: replay FLOPs against bytes saved, for tracedac's
``memory_budget(b)`` and torch's ``activation_memory_budget = b``, on the same compiled graph.

A budget is a fraction of a different baseline in each library (torch's: the activation
memory its own partitioner counts; tracedac's: what the region keeps compiled without
checkpointing, less what the next region reads), so ``b = 0.5`` names two different points.
The fair question is the issue's: at the same bytes saved, who replays fewer FLOPs? Each
point is read off the partition AOTAutograd makes for the code (``compile.report.partition``:
torch's min-cut partitioner, inductor's decompositions, no inductor compile, so a sweep costs
seconds). torch's points form a curve (bytes -> FLOPs, linear between points, its lower
envelope); tracedac's points are compared with that curve at their own bytes.

torch's budget spans the whole graph, so tracedac's is placed two ways:

- **one region** over the whole model (``"tracedac, one region"``): the same scope, the
  planners compared;
- **per block** (``"tracedac"``), as users checkpoint: each block's input is saved at the
  boundary whatever the plan (torch's partitioner stashes what a later region reads, as
  torch's own checkpoint does), and what lies outside every block keeps the partitioner's
  default. Its plans are also read against their floor (``hull.floor``: the least any
  choice of kept values within the same bytes can replay), summed over the blocks
  (``"floor"``: budget, FLOPs the plans replay by their own price, the floor's FLOPs).
"""

from __future__ import annotations

import copy

import tracedac

from . import hull

__all__ = ["BUDGETS", "at_bytes", "sweep"]

BUDGETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def _point(model, batch, functorch: dict) -> tuple[int, int]:
    import torch._dynamo
    import torch._functorch.config as functorch_config

    from tracedac.inspect.compiled import partition

    torch._dynamo.reset()
    with functorch_config.patch(functorch):
        parts = partition(model, *batch)
    torch._dynamo.reset()
    return sum(p.saved_bytes for p in parts), sum(p.replay_flops for p in parts)


def _tracedac_point(base, batch, budget: float, whole: bool):
    model = copy.deepcopy(base)
    for region in [model] if whole else model.blocks:
        tracedac.checkpoint(region, policy=tracedac.policies.memory_budget(budget))
    with hull.capture() as plans:
        point = _point(model, batch, {})
    return point, plans


def sweep(base, batch, budgets=BUDGETS, tracedac_budgets=None) -> dict:
    """{"torch": [(budget, bytes, flops)], "tracedac": [...], "tracedac, one region": [...],
    "floor": [(budget, plan flops, floor flops)]}, one partition per point (tracedac's at
    ``tracedac_budgets``, by default the same budgets)."""
    out = {"torch": [], "tracedac": [], "tracedac, one region": [], "floor": []}
    for b in budgets:
        out["torch"].append((b, *_point(copy.deepcopy(base), batch, {"activation_memory_budget": b})))
    for b in budgets if tracedac_budgets is None else tracedac_budgets:
        point, plans = _tracedac_point(base, batch, b, whole=False)
        out["tracedac"].append((b, *point))
        out["floor"].append(
            (b, sum(p.flops for p in plans), sum(hull.floor(p.problem, p.limit)[0] for p in plans))
        )
        point, _ = _tracedac_point(base, batch, b, whole=True)
        out["tracedac, one region"].append((b, *point))
    return out


def at_bytes(points: list, nbytes: int) -> float | None:
    """The least FLOPs torch's curve reaches at ``nbytes`` saved: the lower envelope of its
    points, linear between neighbours; None below its smallest bytes (it cannot get there)."""
    least: dict = {}
    for _, b, f in points:
        least[b] = min(f, least.get(b, f))
    pts = sorted(least.items())
    if not pts or nbytes < pts[0][0]:
        return None
    best = min(f for b, f in pts if b <= nbytes)  # a point with fewer bytes is reachable too
    for (b0, f0), (b1, f1) in zip(pts, pts[1:]):
        if b0 <= nbytes <= b1 and b1 > b0:
            best = min(best, f0 + (f1 - f0) * (nbytes - b0) / (b1 - b0))
    return best
