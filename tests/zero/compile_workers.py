"""What each rank runs in the compiled ZeRO-3 tests (imported by spawned processes: top-level).

Oracles: the same model trained by eager ``zero.shard`` (losses, final parameters), the
graphs AOTAutograd hands its compilers (read as torch wrote them), fx's own dead-code
elimination, and glibc's allocator statistics.
"""

from __future__ import annotations

import gc
import operator

import torch
import torch.nn.functional as F

import tracedac
import tracedac.zero as zero
from benchmarks import probe
from tracedac.zero import group as zgroup

from . import workers as w

BACKEND = "aot_eager_decomp_partition"
GATHER = torch.ops.tracedac.all_gather.default
RELEASE = torch.ops.tracedac.release.default
REDUCE = torch.ops.tracedac.reduce_grad.default
WAIT = torch.ops.tracedac.all_gather_wait.default
START = torch.ops.tracedac.all_gather_start.default


def _fresh():
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = 64  # every block instance is a cache entry of _call_impl


def build(where: str, d: int = w.D):
    """A sharded model (regions before or after sharding, or none) and how to compile it."""
    m = w.model(d=d)
    if where == "wrap-before":
        m = zero.shard(tracedac.wrap(m, w.Block))
    elif where == "wrap-after":
        m = tracedac.wrap(zero.shard(m), w.Block)
    else:
        m = zero.shard(m)
    return m


def compiled(m, how: str, backend=BACKEND, dynamic=None):
    if how == "whole":
        return torch.compile(m, fullgraph=True, backend=backend, dynamic=dynamic)
    for b in m.blocks:  # torchtitan's order: shard (and checkpoint) each block, then compile it
        b.compile(fullgraph=True, backend=backend, dynamic=dynamic)
    return m


def batch(step, rank, world, rows=None, d=w.D):
    """This rank's slice of step ``step``'s batch; ``rows`` per rank (default: an equal share)."""
    per = rows or w.BATCH // world
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(per * world, d, generator=g), torch.randn(per * world, generator=g)
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def train(m, call, rank, world, rows=(None, None, None)):
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    losses = []
    for step, r in enumerate(rows):
        x, y = batch(step, rank, world, r)
        loss = F.mse_loss(call(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, zero.full_state_dict(m)


def equal_to_eager(rank, world, cases, backend=BACKEND):
    """Per (regions, how, dynamic): max |loss - eager's|, max |parameter - eager's|, and
    how many gathered buffers are still registered after training. With the default backend
    the compiler's graphs are kept (``Graphs`` is that backend) for ``graphs`` to read."""
    out = {}
    for where, how, dynamic in cases:
        rows = (2, 3, 5) if dynamic else (None, None, None)  # recompiles on new sizes
        _fresh()
        eager = build(where)
        ref_losses, ref_sd = train(eager, eager, rank, world, rows)
        m = build(where)
        g = Graphs() if backend == BACKEND else None
        losses, sd = train(m, compiled(m, how, g.backend if g else backend, dynamic), rank, world, rows)
        out[(where, how, dynamic)] = (
            max(abs(a - b) for a, b in zip(losses, ref_losses)),
            w.max_diff(sd, ref_sd),
            len(zgroup.LIVE),
        )
        if g is not None and not dynamic:
            _GRAPHS[(where, how)] = _graph_counts(g, m)
    _fresh()
    return out


class Graphs:
    """``aot_eager_decomp_partition`` (``tracedac.inspect.compiled.partition_backend``), keeping
    the forward and backward graphs of each compile."""

    def __init__(self):
        from tracedac.inspect.compiled import partition_backend

        self.backend, self._made = partition_backend()

    @property
    def forward(self) -> list:
        return [p.fw for p in self._made]

    @property
    def backward(self) -> list:
        return [p.bw for p in self._made]


def _count(gms, op) -> int:
    n = 0
    for gm in gms:
        for node in gm.graph.nodes:
            if node.target is op or (
                node.op == "call_function" and len(node.args) > 1 and node.args[1] is op
            ):
                n += 1  # op itself, or with_effects(token, op, ...)
    return n


def _saved_gathered(gm) -> list:
    """Forward outputs (what backward is handed) computed from gathered parameters alone."""
    gathered = set()
    for n in gm.graph.nodes:
        if n.op == "call_function" and (
            n.target in (GATHER, START)
            or (n.all_input_nodes and all(a in gathered for a in n.all_input_nodes))
        ):
            gathered.add(n)
    return [n.name for n in gm.graph.output_node().args[0] if n in gathered]


_GRAPHS: dict = {}  # (regions, how) -> _graph_counts of the model equal_to_eager compiled


def _graph_counts(g, m) -> dict:
    return dict(  # a gather is one op, or a start and a wait (gather_prefetch)
        fw_gathers=_count(g.forward, GATHER) + _count(g.forward, WAIT),
        fw_releases=_count(g.forward, RELEASE),
        bw_gathers=_count(g.backward, GATHER) + _count(g.backward, WAIT),
        bw_reduces=_count(g.backward, REDUCE),
        saved_gathered=[s for gm in g.forward for s in _saved_gathered(gm)],
        bw_slice_scatters=_count(g.backward, torch.ops.aten.slice_scatter.default)
        + _count(g.backward, torch.ops.aten.slice_backward.default),
        trainable_groups=sum(1 for u in m._tracedac_zero.all_units for grp in u.groups if grp.requires_grad),
        groups=sum(len(u.groups) for u in m._tracedac_zero.all_units),
        keys=len({grp.key for u in m._tracedac_zero.all_units for grp in u.groups}),
        graphs=(len(g.forward), len(g.backward)),
    )


def graphs(rank, world):
    """Per block-compiled and whole-compiled model: gathers, releases and reduce_grads in the
    forward and backward graphs, and what the forward saves of gathered parameters. A model
    ``equal_to_eager`` compiled and trained in this process is read, not compiled again (its
    steps all have the first one's shapes: the graphs are the first step's)."""
    out = {}
    for where, how in (("plain", "per-block"), ("plain", "whole"), ("wrap-before", "per-block")):
        if (where, how) not in _GRAPHS:
            _fresh()
            g = Graphs()
            m = build(where)
            call = compiled(m, how, backend=g.backend)
            x, y = batch(0, rank, world)
            F.mse_loss(call(x), y).backward()
            _GRAPHS[(where, how)] = _graph_counts(g, m)
        out[(where, how)] = _GRAPHS[(where, how)]
    _fresh()
    return out


def dead_code(rank, world):
    """make_fx of a forward, then fx's dead-code elimination: every release stays."""
    from torch.fx.experimental.proxy_tensor import make_fx

    m = build("plain")
    x, _ = batch(0, rank, world)
    gm = make_fx(lambda x: m(x).sum())(x)
    before = len(gm.graph.find_nodes(op="call_function", target=RELEASE))
    gm.graph.eliminate_dead_code()
    after = len(gm.graph.find_nodes(op="call_function", target=RELEASE))
    return before, after, sum(len(u.groups) for u in m._tracedac_zero.all_units)


def _tensors() -> int:
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def memory(rank, world, steps=10, d=192):
    """Compiled per block: bytes the allocator holds after step 10 beyond after step 1, the
    live tensors after step 1 and after step 10, and the bytes of one unit's full parameters."""
    _fresh()
    m = build("plain", d=d)
    call = compiled(m, "per-block")
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    held = []
    for step in range(steps + 1):
        x, y = batch(step, rank, world, d=d)
        F.mse_loss(call(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # the .grad buffers stay: only a leak can grow
        gc.collect()
        held.append((probe.allocated_bytes(), _tensors()))
    _fresh()
    unit = 4 * sum(p.numel() for p in m.blocks[0].parameters())
    return held[steps][0] - held[1][0], held[1][1], held[steps][1], unit, len(zgroup.LIVE)


def several(rank, world, parts):
    out = {}
    for name, args in parts:
        try:
            out[name] = ("ok", globals()[name](rank, world, *args))
        except Exception:  # noqa: BLE001 (reported per part; the others still run)
            import traceback

            out[name] = ("error", traceback.format_exc())
    return out


def inductor(rank, world):
    """Compiled by inductor itself (its C++ compile is the slow part): per block, and whole
    (each gather a start and a wait, the next unit's start moved ahead: gather_prefetch)."""
    return equal_to_eager(
        rank, world, [("plain", "per-block", None), ("plain", "whole", None)], backend="inductor"
    )


class LinearBlock(torch.nn.Module):
    """A unit of Linear layers only: under bf16 autocast every use of its gathered
    parameters is a cast to bf16 (the bias too: autocast casts every input of ``linear``)."""

    def __init__(self, d=w.D):
        super().__init__()
        self.lin1, self.lin2 = torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.lin2(F.gelu(self.lin1(x))).float()


class LinearModel(torch.nn.Module):
    def __init__(self, d=w.D):
        super().__init__()
        self.blocks = torch.nn.ModuleList([LinearBlock(d), LinearBlock(d)])
        self.norm = torch.nn.LayerNorm(d)  # the root unit: read in fp32, never cast

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.norm(x)


def _autocast_training(call, m, rank, world, steps=3):
    """Losses, final parameters and all-gather bytes by dtype (counted at the process group)."""
    from benchmarks.collectives import AllGatherCounter

    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    losses, counter = [], AllGatherCounter()
    with counter:
        for step in range(steps):
            x, y = batch(step, rank, world)
            with torch.autocast("cpu", torch.bfloat16):
                loss = F.mse_loss(call(x).float().sum(-1), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses, zero.full_state_dict(m), dict(counter.bytes)


def fused_cast(rank, world):
    """A fp32-sharded model compiled under bf16 autocast, with the gather-cast pass and with it
    patched out: losses and parameters (must be bit-identical: a cast moved before a copy),
    all-gather bytes by dtype, and the dtypes of the gathers in the forward and backward graphs."""
    import tracedac.compile.passes.gather_cast as gather_cast

    out = {}
    bf16 = zero.MixedPrecision(torch.bfloat16, torch.float32)
    for fuse in (True, False, "mixed_precision"):
        _fresh()
        torch.manual_seed(0)
        m = zero.shard(LinearModel(), mixed_precision=bf16 if fuse == "mixed_precision" else None)
        saved = gather_cast.fuse_gather_casts
        if not fuse:
            gather_cast.fuse_gather_casts = lambda gm: gm
        try:
            g = Graphs()
            call = torch.compile(m, fullgraph=True, backend=g.backend)
            losses, sd, wire = _autocast_training(call, m, rank, world)
        finally:
            gather_cast.fuse_gather_casts = saved

        def dtypes(gms):
            return sorted(
                str(n.kwargs.get("dtype", n.args[2] if len(n.args) > 2 else "none"))
                for gm in gms
                for n in gm.graph.nodes
                if n.target in (GATHER, START)
            )

        out[fuse] = dict(
            losses=losses,
            sd=sd,
            wire=wire,
            forward=dtypes(g.forward),
            backward=dtypes(g.backward),
            casts_of_gathers=sum(
                1
                for gm in g.forward
                for n in gm.graph.nodes
                if n.target is torch.ops.prims.convert_element_type.default and _from_gather(n)
            ),
        )
    _fresh()
    torch.manual_seed(0)
    m = zero.shard(LinearModel(), mixed_precision=bf16)
    try:  # mixed_precision compiled outside autocast: its forward hooks cannot run autocast
        torch.compile(m, fullgraph=True, backend=BACKEND)(batch(0, rank, world)[0])
        out["error"] = None
    except Exception as e:  # noqa: BLE001 (dynamo wraps the ZeroError raised while tracing)
        out["error"] = str(e)
    _fresh()
    return out


def _from_gather(node) -> bool:
    """Whether ``node`` reads a gather's output through views only."""
    while node.all_input_nodes:
        node = node.all_input_nodes[0]
        if node.target in (GATHER, WAIT):
            return True
        if node.target not in (
            torch.ops.aten.slice.Tensor,
            torch.ops.aten.view.default,
            torch.ops.aten.split_with_sizes.default,
            operator.getitem,
            torch.ops.prims.convert_element_type.default,
        ):
            return False
    return False


def auto_compiled(rank, world):
    """The tests' model (LayerNorm, Linear and Block-owned parameters in each unit) compiled
    whole under bf16 autocast, sharded plainly and with ``MixedPrecision("auto")``: losses,
    wire bytes by dtype, and (auto) each gather's group name and dtype in the forward graph."""
    out = {}
    for name, mp in (("plain", None), ("auto", zero.MixedPrecision("auto"))):
        _fresh()
        m = zero.shard(w.model(), mixed_precision=mp)
        g = Graphs()
        losses, _, wire = _autocast_training(
            torch.compile(m, fullgraph=True, backend=g.backend), m, rank, world
        )
        names = {grp.key: grp.name for grp in m._tracedac_zero.all_groups}
        out[name] = dict(
            losses=losses,
            wire=wire,
            gathers=sorted(
                (names[n.args[1]], str(n.kwargs.get("dtype", n.args[2] if len(n.args) > 2 else None)))
                for gm in g.forward
                for n in gm.graph.nodes
                if n.target in (GATHER, START)
            ),
        )
    _fresh()
    return out


def prefetch_order(rank, world):
    """The whole model compiled, runtime prefetch off (``prefetch=False``): the forward graph's
    sequence of starts, waits and compute, and the losses against eager ``zero.shard``."""
    out = {}
    _fresh()
    g = Graphs()
    m = zero.shard(w.model(), prefetch=False)
    call = torch.compile(m, fullgraph=True, backend=g.backend)
    losses, sd = train(m, call, rank, world)
    eager = zero.shard(w.model(), prefetch=False)
    want_losses, want_sd = train(eager, eager, rank, world)
    seq = []
    for n in g.forward[0].graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is START:
            seq.append(("start", n.args[1]))
        elif n.target is WAIT:
            seq.append(("wait", n.args[1]))
        elif n.target is GATHER:
            seq.append(("gather", n.args[1]))
        elif any(a.target is WAIT for a in n.all_input_nodes if a.op == "call_function"):
            seq.append(
                (
                    "reads",
                    next(
                        a.args[1] for a in n.all_input_nodes if a.op == "call_function" and a.target is WAIT
                    ),
                )
            )
        else:
            seq.append(("other", None))
    out["seq"] = seq
    out["units"] = [[grp.key for grp in u.groups] for u in m._tracedac_zero.all_units]
    out["losses"] = max(abs(a - b) for a, b in zip(losses, want_losses))
    out["params"] = w.max_diff(sd, want_sd)
    out["bw_waits"] = _count(g.backward, WAIT)
    _fresh()
    return out


def odd_sizes(rank, world):
    """Parameters whose rows do not divide by ``world`` (padding rows in every gathered unit),
    trained eager and compiled whole (``layout.split_views``: the padding is a piece of its
    own): the largest loss and parameter difference over three steps."""
    out = {}
    for compiled in (False, True):
        _fresh()
        torch.manual_seed(0)
        m = zero.shard(
            torch.nn.Sequential(
                torch.nn.Linear(7, 5),
                torch.nn.LayerNorm(5),
                torch.nn.Linear(5, 3, bias=False),
                torch.nn.Linear(3, 1),
            )
        )
        call = torch.compile(m, fullgraph=True, backend=BACKEND) if compiled else m
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        losses = []
        for step in range(3):
            g = torch.Generator().manual_seed(step * 10 + rank)
            x, y = torch.randn(4, 7, generator=g), torch.randn(4, 1, generator=g)
            loss = F.mse_loss(call(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[compiled] = losses, {k: v.full_tensor().clone() for k, v in m.state_dict().items()}
    _fresh()
    (eager_losses, eager), (losses, params) = out[False], out[True]
    return (
        max(abs(a - b) for a, b in zip(eager_losses, losses)),
        max((eager[k] - params[k]).abs().max().item() for k in eager),
    )
