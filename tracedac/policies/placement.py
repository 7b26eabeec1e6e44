"""Keep, offload or replay: the cost model a planner that may offload uses, and its solver.

Each item (a storage backward reads, or the results of one op together) is kept on the
device, offloaded to host memory, or replayed. The model, in the cost's own unit (FLOPs for
``cost="flops"``, nanoseconds for ``cost="time"``):

- **replay** costs what rebuilding the item costs (``planners.costs``): its FLOPs, which at
  the device's ``flop_rate`` take FLOPs / flop_rate seconds;
- **keep** costs nothing but its bytes on the device, which the budget bounds;
- **offload** costs no device bytes, and the copy out in the forward and back in backward,
  ``bytes / bandwidth`` seconds each way. Copies run beside the compute (a side stream on CUDA)
  and overlap the region's own compute, each way up to ``C``, the region's forward compute
  time (its FLOPs / flop_rate; backward computes at least as much as the forward, so the copies
  back hide as well as the copies out). A copy hidden in ``C`` adds nothing to the step; one
  that is not adds its copy time out and back. Tensors are placed whole: a copy is hidden
  or paid in full. Copies the policy itself asked for (``offload_ops``...) fill ``C`` first.
  The copies back hide only where they are issued ahead of their use: ``offload.py``
  prefetches a region ahead (``prefetch_regions``), which is what the model assumes; on a
  GPU that is still to be measured.

In the cost's unit a byte over the link is worth ``flop_rate / bandwidth`` FLOPs (``1e9 /
bandwidth`` ns): the exchange rate ``per_byte``. The least estimated step time within the
budget is a knapsack with two capacities (device bytes, and the bytes the link moves in ``C``),
solved by ``place``. Of plans of equal estimated time, the one moving fewer bytes over the
link wins (keeping within the budget beats an offload that looks free), then the one that
replays fewer bytes and ops, then the one holding fewer device bytes.
"""

from __future__ import annotations

import math
import warnings

import torch

from ..offload.link import Link, resolve
from ..record.graph import RegionGraph

__all__ = [
    "MAX_HIDE_CELLS",
    "exchange",
    "figures",
    "forward_cost",
    "hide_bytes",
    "per_byte",
    "Placer",
    "place",
    "placer",
    "values",
]

# The hidden-copy dimension of ``place``'s table has at most this many cells (the device's has
# ``planners.MAX_CELLS``): copies are counted in coarser units beyond it, rounded up, so the
# plan never counts on more overlap than the model allows.
MAX_HIDE_CELLS = 32


def figures(graph: RegionGraph, link: Link) -> Link:
    """``link`` with what it leaves out measured for the device the region ran on, matmuls in
    the dtype of its largest matmul (``link.measure``)."""
    if not link.measured:
        return link
    groups = [g for g in graph.groups if g is not None]
    device = max(groups, key=lambda g: g.nbytes).device if groups else torch.device("cpu")
    nodes = [n for n in graph.nodes if n is not None and n.flops]
    top = max(nodes, key=lambda n: n.flops) if nodes else None
    dtype = top.outputs[0].dtype if top is not None and top.outputs and top.outputs[0] is not None else None
    dtype = dtype if dtype is not None and dtype.is_floating_point else torch.float32
    if device.type == "cpu" and link.bandwidth is None:
        _warn_cpu()
        return Link(0.0, resolve(Link(1.0, link.flop_rate), device, dtype).flop_rate)  # no offload
    return resolve(link, device, dtype)


_WARNED_CPU: list = []


def _warn_cpu() -> None:
    """Once per process: a planner asked to offload (``offload=True``) on the CPU plans without."""
    if _WARNED_CPU:
        return
    _WARNED_CPU.append(True)
    warnings.warn(
        "tracedac: a planner with offload=True ran on the CPU, where host memory is the device's "
        "memory: a copy there saves nothing (it would hold the same bytes twice), so it plans without "
        "offload. Offload is for CUDA devices; to exercise the choice on the CPU anyway, pass the "
        "figures: offload=tracedac.policies.Link(bandwidth=..., flop_rate=...).",
        stacklevel=2,
    )


def per_byte(link: Link, cost: str) -> float:
    """What moving one byte one way over the link costs, in the cost's unit (0 for an infinite
    bandwidth, ``inf`` for none)."""
    if link.bandwidth == 0:
        return math.inf
    if math.isinf(link.bandwidth):
        return 0.0
    return (1e9 if cost == "time" else link.flop_rate) / link.bandwidth


def exchange(graph: RegionGraph, offload, cost: str) -> float:
    """``per_byte`` for a planner's ``offload`` (True, or a ``Link``), the figures it leaves out
    measured for ``graph``'s device."""
    return per_byte(figures(graph, offload if isinstance(offload, Link) else Link()), cost)


def forward_cost(graph: RegionGraph, cost: str) -> int:
    """``C`` in the cost's unit: the region's forward FLOPs, or its recorded nanoseconds."""
    if cost == "time":
        return sum(graph.times.values())
    return sum(n.flops for n in graph.nodes if n is not None)


def hide_bytes(graph: RegionGraph, cost: str, rate: float, offloaded: int) -> float:
    """The bytes the link moves each way within the region's compute, less ``offloaded`` (the
    policy's own offloads, hidden first): ``inf`` for a free link, 0 for none."""
    if rate == 0:
        return math.inf
    if math.isinf(rate):
        return 0.0
    return max(0.0, forward_cost(graph, cost) / rate - offloaded)


def values(replay: tuple, nbytes: int, rate: float) -> tuple:
    """(keep, hidden, exposed) value tuples of an item whose replay costs ``replay`` (a tuple,
    its first component in the cost's unit): what each choice saves against replaying it,
    with the bytes moved over the link as the second component (negative: fewer is better)."""
    first, rest = replay[0], tuple(replay[1:])
    exposed = None if math.isinf(rate) else first - math.ceil(2 * nbytes * rate)
    return (
        (first, 0, *rest),
        (first, -nbytes, *rest),
        None if exposed is None else (exposed, -nbytes, *rest),
    )


def placer(graph: RegionGraph, cost: str, rate: float, replay, weights, movable, host: int, max_cells: int):
    """``place`` for items whose replay costs ``replay[i]`` (tuples, ``planners.costs``) and
    which weigh ``weights[i]`` bytes, ``movable[i]`` whether it may be offloaded, ``host`` the
    bytes the policy offloads anyway: a function of the device capacity."""
    hide = hide_bytes(graph, cost, rate, host)
    keep, hidden, exposed = [], [], []
    for c, w, m in zip(replay, weights, movable):
        k, h, e = values(c, w, rate)
        keep.append(k)
        hidden.append(h if m else None)
        exposed.append(e if m else None)
    return Placer(weights, keep, hidden, exposed, hide, max_cells)


def _unit(weights, capacity: float, cells: int) -> int:
    """Bytes per cell: the weights' gcd (exact), coarser if that leaves more than ``cells``."""
    q = 0
    for w in weights:
        q = math.gcd(q, w)
    q = max(q, 1)
    if capacity // q > cells:
        q = max(q, math.ceil(capacity / cells))
    return q


def _greater(a, b) -> torch.Tensor:
    """Where tuple ``a`` (one tensor per component, stacked) is greater than ``b``, compared in
    order."""
    better = torch.zeros(a[0].shape, dtype=torch.bool)
    tied = torch.ones(a[0].shape, dtype=torch.bool)
    for x, y in zip(a, b):
        better |= tied & (x > y)
        tied &= x == y
    return better


def place(weights, keep, hidden, exposed, capacity: int, hide: float, max_cells: int):
    """Indices to keep and to offload: the greatest summed value (tuples compared in order)
    with at most ``capacity`` device bytes kept and at most ``hide`` bytes of hidden copies,
    and of those the plan with the fewest device bytes, then the fewest hidden bytes.

    Each item is kept (``keep[i]``, its ``weights[i]`` bytes on the device), offloaded with its
    copy hidden (``hidden[i]``, its bytes out of ``hide``), offloaded with its copy paid
    (``exposed[i]``) or replayed (value 0). ``hidden[i]`` None: the item may not be offloaded;
    ``exposed[i]`` None: not with its copy paid.
    Dynamic programming over both capacities, each counted in units as ``planners.knapsack``
    counts bytes (weights rounded up, capacities down): the plan never holds more than
    ``capacity`` nor hides more than ``hide``."""
    return Placer(weights, keep, hidden, exposed, hide, max_cells)(capacity)


class Placer:
    """``place`` for one set of items and any device capacity. The table filled for one
    capacity holds the best plan within every smaller one counted in the same units (its rows
    up to that one), so a sweep over budgets (``trade_off``) fills it once."""

    def __init__(self, weights, keep, hidden, exposed, hide: float, max_cells: int):
        self.weights, self.keep, self.hidden, self.max_cells = weights, keep, hidden, max_cells
        self.width = len(keep[0]) if keep else 0
        self.zero = (0,) * self.width
        # replaying, or offloading with the copy paid: the better of the two, whatever else is chosen
        self.paid = [e is not None and e > self.zero for e in exposed]
        self.base = [e if p else self.zero for e, p in zip(exposed, self.paid)]
        if math.isinf(hide):
            hide = 0  # a free link: every copy costs nothing (``values``), none need hiding
        hide = min(hide, sum(weights))  # (beyond what all items weigh, more cells buy nothing)
        qh = _unit([w for w in weights if w > 0], hide, MAX_HIDE_CELLS)
        self.hcells = int(hide // qh)
        self.hunits = [-(-w // qh) for w in weights]
        self.tables: dict = {}  # device unit -> (cells, best, choice)

    def __call__(self, capacity: int) -> tuple[list[int], list[int]]:
        n = len(self.weights)
        if n == 0:
            return [], []
        capacity = min(capacity, sum(self.weights))
        q = _unit([w for w in self.weights if w > 0], capacity, self.max_cells)
        cells = int(capacity // q)
        table = self.tables.get(q)
        if table is None or table[0] < cells:
            table = self.tables[q] = (cells, *self._fill(q, cells))
        best, choice = table[1][:, : cells + 1], table[2].numpy()  # (numpy: fast to read one cell)
        units = [-(-w // q) for w in self.weights]
        reaching = torch.ones(best.shape[1:], dtype=torch.bool)
        lowest = torch.iinfo(torch.int64).min
        for b in best:  # (torch.where, not b[reaching]: a masked select is a hundred times slower)
            reaching &= b == torch.where(reaching, b, lowest).max()
        d, h = (int(x) for x in torch.nonzero(reaching)[0])  # fewest device units, then hidden ones
        kept, offloaded = [], []
        for i in range(n - 1, -1, -1):
            c = int(choice[i, d, h])
            if c == 1:
                kept.append(i)
                d -= units[i]
            elif c == 2:
                offloaded.append(i)
                h -= self.hunits[i]
            elif self.paid[i]:
                offloaded.append(i)
        return sorted(kept), sorted(offloaded)

    def _fill(self, q: int, cells: int):
        """The table over ``cells`` device units of ``q`` bytes: the best value per (device,
        hidden) capacity, one row of components each, and each item's choice there."""
        hcells, n = self.hcells, len(self.weights)
        best = torch.zeros((self.width, cells + 1, hcells + 1), dtype=torch.int64)
        choice = torch.zeros((n, cells + 1, hcells + 1), dtype=torch.uint8)  # 1 keep, 2 hidden
        for i, w in enumerate(self.weights):
            new = best + torch.tensor(self.base[i]).view(-1, 1, 1)
            u, v = -(-w // q), self.hunits[i]
            if u <= cells:
                cand = best[:, : cells + 1 - u] + torch.tensor(self.keep[i]).view(-1, 1, 1)
                better = _greater(cand, new[:, u:])
                new[:, u:] = torch.where(better, cand, new[:, u:])
                choice[i, u:].masked_fill_(better, 1)
            if self.hidden[i] is not None and v <= hcells:
                cand = best[:, :, : hcells + 1 - v] + torch.tensor(self.hidden[i]).view(-1, 1, 1)
                better = _greater(cand, new[:, :, v:])
                new[:, :, v:] = torch.where(better, cand, new[:, :, v:])
                choice[i, :, v:].masked_fill_(better, 2)
            best = new
        return best, choice
