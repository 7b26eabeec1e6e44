"""tracedac.zero under torch.compile, fullgraph, on real gloo groups of 1 and 2 spawned ranks.

Each world size is one spawn running every rank function below, each checking what it
computes (tests/support/ranks.py), both started together; compiling on CPU is slow, so the
models are the zero tests' small ones (tests/support/zero_model.py). Oracles: the same model
trained by eager ``zero.shard`` (losses, final parameters), the graphs AOTAutograd hands its
compilers (read as torch wrote them), fx's own dead-code elimination, and glibc's allocator
statistics.
"""

from __future__ import annotations

import gc
import operator

import pytest
import torch
import torch.nn.functional as F

import tracedac
import tracedac.zero as zero

from ..support import zero_model as zm
from ..support.compiled_graphs import (
    BACKEND,
    GATHER,
    RELEASE,
    START,
    WAIT,
    Graphs,
    compiled,
    count,
    fresh,
    gather_dtype,
    graph_counts,
)
from ..support.probe import allocated_bytes
from ..support.ranks import check, run_ranks, start_parts
from ..support.zero_logs import WireLog, live_gathered

# slow: the quick loop (pytest -m "not slow") leaves this file out
pytestmark = pytest.mark.slow

CASES = [
    ("plain", "per-block", None),
    ("plain", "whole", None),
    ("wrap-before", "per-block", None),
    ("wrap-after", "whole", None),
    ("plain", "whole", True),
]


def build(where: str, d: int = zm.D):
    """A sharded model (regions before or after sharding, or none)."""
    m = zm.model(d=d)
    if where == "wrap-before":
        return zero.shard(tracedac.wrap(m, zm.Block))
    if where == "wrap-after":
        return tracedac.wrap(zero.shard(m), zm.Block)
    return zero.shard(m)


def batch(step, rank, world, rows=None, d=zm.D):
    """This rank's slice of step ``step``'s batch; ``rows`` per rank (default: an equal share)."""
    per = rows or zm.BATCH // world
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


_GRAPHS: dict = {}  # (regions, how) -> graph_counts of the model equal_to_eager compiled


def equal_to_eager(rank, world, cases, backend=BACKEND):
    """Per (regions, how, dynamic): the losses and parameters of eager zero.shard within 1e-5,
    and no gathered buffer registered after training (the compiled path registers none). With
    the default backend the compiler's graphs are kept (``Graphs`` is that backend) for
    ``graphs`` to read."""
    for where, how, dynamic in cases:
        rows = (2, 3, 5) if dynamic else (None, None, None)  # recompiles on new sizes
        fresh()
        eager = build(where)
        ref_losses, ref_sd = train(eager, eager, rank, world, rows)
        m = build(where)
        g = Graphs() if backend == BACKEND else None
        losses, sd = train(m, compiled(m, how, g.backend if g else backend, dynamic), rank, world, rows)
        loss, params = max(abs(a - b) for a, b in zip(losses, ref_losses)), zm.max_diff(sd, ref_sd)
        assert loss < 1e-5 and params < 1e-5, ((where, how, dynamic), loss, params)
        assert live_gathered() == 0, (where, how, dynamic)
        if g is not None and not dynamic:
            _GRAPHS[(where, how)] = graph_counts(g, m)
    fresh()


def inductor(rank, world):
    """Compiled by inductor itself (its C++ compile is the slow part): per block, and whole
    (each gather a start and a wait, the next unit's start moved ahead: gather_prefetch)."""
    equal_to_eager(rank, world, [("plain", "per-block", None), ("plain", "whole", None)], backend="inductor")


def graphs(rank, world):
    """Per block-compiled and whole-compiled model: gathers, releases and reduce_grads in the
    forward and backward graphs, and what the forward saves of gathered parameters. A model
    ``equal_to_eager`` compiled and trained in this process is read, not compiled again (its
    steps all have the first one's shapes: the graphs are the first step's)."""
    for where, how in (("plain", "per-block"), ("plain", "whole"), ("wrap-before", "per-block")):
        if (where, how) not in _GRAPHS:
            fresh()
            g = Graphs()
            m = build(where)
            call = compiled(m, how, backend=g.backend)
            x, y = batch(0, rank, world)
            F.mse_loss(call(x), y).backward()
            _GRAPHS[(where, how)] = graph_counts(g, m)
        case, g = (where, how), _GRAPHS[(where, how)]
        root = 1 if how == "per-block" else 0  # per block, the root unit runs eagerly
        # a graph per compiled block (three) or one; none recompiled in the steps read
        assert g["graphs"] == ((3, 3) if how == "per-block" else (1, 1)), (case, g)
        # one release per gather a unit makes; the two gathers of the group a shared
        # parameter lives in (its owner's, its borrower's) may be merged by CSE (same inputs)
        assert g["fw_releases"] == g["groups"] - root, (case, g)
        assert g["keys"] - root <= g["fw_gathers"] <= g["groups"] - root, (case, g)
        assert g["bw_reduces"] == g["trainable_groups"] - root, (case, g)
        assert g["bw_gathers"] == g["bw_reduces"], (case, g)  # backward gathers each trainable group again
        assert g["saved_gathered"] == [], (case, g)
        # a unit's gradient is one cat of its parameters' (layout.split_views), not a sum
        # of one full-size slice_backward (slice_scatter into zeros) per parameter
        assert g["bw_slice_scatters"] == 0, (case, g)
    fresh()


def dead_code(rank, world):
    """make_fx of a forward, then fx's dead-code elimination: every release stays."""
    from torch.fx.experimental.proxy_tensor import make_fx

    m = build("plain")
    x, _ = batch(0, rank, world)
    gm = make_fx(lambda x: m(x).sum())(x)
    before = len(gm.graph.find_nodes(op="call_function", target=RELEASE))
    gm.graph.eliminate_dead_code()
    after = len(gm.graph.find_nodes(op="call_function", target=RELEASE))
    groups = sum(len(u.groups) for u in m._tracedac_zero.all_units)
    assert before == after == groups, (before, after, groups)


def _tensors() -> int:
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def memory(rank, world, steps=10, d=192):
    """Compiled per block: no tensor stays alive from step 1 to step 10, and the allocator
    grows by well under two units' full parameters."""
    fresh()
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
        held.append((allocated_bytes(), _tensors()))
    fresh()
    unit_bytes = 4 * sum(p.numel() for p in m.blocks[0].parameters())
    grown, tensors_before, tensors_after = held[steps][0] - held[1][0], held[1][1], held[steps][1]
    assert tensors_after == tensors_before, (tensors_before, tensors_after)
    # ten leaked units would be 10x one; gloo and Python hold some 40 KB more a step
    assert grown < 2 * unit_bytes, (grown, unit_bytes)
    assert live_gathered() == 0


class LinearBlock(torch.nn.Module):
    """A unit of Linear layers only: under bf16 autocast every use of its gathered
    parameters is a cast to bf16 (the bias too: autocast casts every input of ``linear``)."""

    def __init__(self, d=zm.D):
        super().__init__()
        self.lin1, self.lin2 = torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.lin2(F.gelu(self.lin1(x))).float()


class LinearModel(torch.nn.Module):
    def __init__(self, d=zm.D):
        super().__init__()
        self.blocks = torch.nn.ModuleList([LinearBlock(d), LinearBlock(d)])
        self.norm = torch.nn.LayerNorm(d)  # the root unit: read in fp32, never cast

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.norm(x)


def _autocast_training(call, m, rank, world, steps=3):
    """Losses, final parameters and all-gather bytes by dtype (counted at the process group)."""
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    losses = []
    with WireLog() as wire:
        for step in range(steps):
            x, y = batch(step, rank, world)
            with torch.autocast("cpu", torch.bfloat16):
                loss = F.mse_loss(call(x).float().sum(-1), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses, zero.full_state_dict(m), dict(wire.bytes)


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


def fused_cast(rank, world):
    """A fp32-sharded model compiled under bf16 autocast, with the gather-cast pass and with it
    patched out, and ``MixedPrecision()`` (checks "fused_cast" and "mixed_precision")."""
    import tracedac.compile.passes.gather_cast as gather_cast

    out = {}
    bf16 = zero.MixedPrecision(torch.bfloat16, torch.float32)
    for fuse in (True, False, "mixed_precision"):
        fresh()
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
                gather_dtype(n) for gm in gms for n in gm.graph.nodes if n.target in (GATHER, START)
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
    fresh()
    torch.manual_seed(0)
    m = zero.shard(LinearModel(), mixed_precision=bf16)
    try:  # mixed_precision compiled outside autocast: its forward hooks cannot run autocast
        torch.compile(m, fullgraph=True, backend=BACKEND)(batch(0, rank, world)[0])
        error = None
    except Exception as e:  # noqa: BLE001 (dynamo wraps the ZeroError raised while tracing)
        error = str(e)
    fresh()
    fused, plain, mixed = out[True], out[False], out["mixed_precision"]
    with check("fused_cast"):
        assert fused["losses"] == plain["losses"], (fused["losses"], plain["losses"])
        for k in plain["sd"]:
            assert torch.equal(fused["sd"][k], plain["sd"][k]), k
        assert fused["forward"] == ["torch.bfloat16", "torch.bfloat16", "torch.float32"], fused["forward"]
        assert fused["backward"] == fused["forward"], fused["backward"]  # backward gathers each again
        assert plain["forward"] == ["torch.float32"] * 3 and plain["casts_of_gathers"] == 8, plain
        assert fused["casts_of_gathers"] == 0, fused["casts_of_gathers"]
        if world == 1:  # one rank sends nothing: a gather is the cast (the dtypes above)
            assert fused["wire"] == plain["wire"] == {}, (fused["wire"], plain["wire"])
        else:
            assert set(plain["wire"]) - {"int64"} == {"float32"}, plain["wire"]  # int64: order checks
            # the Linear units' bytes halve; the root's (the LayerNorm) stay fp32
            assert fused["wire"]["bfloat16"] * 2 + fused["wire"]["float32"] == plain["wire"]["float32"], (
                fused["wire"],
                plain["wire"],
            )
    with check("mixed_precision"):
        assert mixed["losses"] == fused["losses"], (mixed["losses"], fused["losses"])
        assert mixed["wire"] == fused["wire"], (mixed["wire"], fused["wire"])
        assert error is not None and "torch.autocast('cpu', dtype=torch.bfloat16)" in error, error


def auto_compiled(rank, world):
    """The tests' model (LayerNorm, Linear and Block-owned parameters in each unit) compiled
    whole under bf16 autocast, sharded plainly and with ``MixedPrecision("auto")``: the same
    losses, every Linear group gathered bf16 and the rest fp32, and (two ranks) fewer bytes
    on the wire."""
    out = {}
    for name, mp in (("plain", None), ("auto", zero.MixedPrecision("auto"))):
        fresh()
        m = zero.shard(zm.model(), mixed_precision=mp)
        g = Graphs()
        losses, _, wire = _autocast_training(
            torch.compile(m, fullgraph=True, backend=g.backend), m, rank, world
        )
        names = {grp.key: grp.name for grp in m._tracedac_zero.all_groups}
        gathers = sorted(
            (names[n.args[1]], gather_dtype(n))
            for gm in g.forward
            for n in gm.graph.nodes
            if n.target in (GATHER, START)
        )
        out[name] = dict(losses=losses, wire=wire, gathers=gathers)
    fresh()
    plain, auto = out["plain"], out["auto"]
    assert auto["losses"] == plain["losses"], (auto["losses"], plain["losses"])
    linear = [d for name, d in auto["gathers"] if "Linear" in name]
    assert linear and set(linear) == {"torch.bfloat16"}, auto["gathers"]
    assert {d for name, d in auto["gathers"] if "Linear" not in name} == {"torch.float32"}, auto["gathers"]
    # plainly only the root's group (all Linear) travels bf16; "auto", every Linear group,
    # which hold most of the bytes (one rank sends nothing: the dtypes above are the check)
    sent = {k: sum(n for dtype, n in out[k]["wire"].items() if dtype != "int64") for k in out}
    if world == 1:
        assert sent == {"plain": 0, "auto": 0}, out
    else:
        assert sent["auto"] < 0.5 * sent["plain"], sent


def prefetch_order(rank, world):
    """The whole model compiled, runtime prefetch off (``prefetch=False``): the forward graph's
    sequence of starts, waits and compute, and training against eager ``zero.shard``."""
    fresh()
    g = Graphs()
    m = zero.shard(zm.model(), prefetch=False)
    call = torch.compile(m, fullgraph=True, backend=g.backend)
    losses, sd = train(m, call, rank, world)
    eager = zero.shard(zm.model(), prefetch=False)
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
            read = (a.args[1] for a in n.all_input_nodes if a.op == "call_function" and a.target is WAIT)
            seq.append(("reads", next(read)))
        else:
            seq.append(("other", None))
    bw_waits = count(g.backward, WAIT)
    fresh()
    loss, params = max(abs(a - b) for a, b in zip(losses, want_losses)), zm.max_diff(sd, want_sd)
    assert loss < 1e-5 and params < 1e-5, (loss, params)
    if world == 1:
        kinds = {kind for kind, _ in seq}
        assert "gather" in kinds and not kinds & {"start", "wait"}, seq
        return
    assert not [k for kind, k in seq if kind == "gather"], seq  # every gather split
    # units: runs of waits (starts may sit between them), in the order the forward runs them
    units, run = [], None
    for kind, k in seq:
        if kind == "wait":
            if run is None:
                run = []
                units.append(run)
            run.append(k)
        elif kind != "start":
            run = None
    assert len(units) >= 4, seq  # the root's embedding, three blocks (and the head's group)
    for cur, nxt in zip(units, units[1:]):
        first_read = min(i for i, (kind, k) in enumerate(seq) if kind == "reads" and k in cur)
        last_wait = max(i for i, (kind, k) in enumerate(seq) if kind == "wait" and k in cur)
        for k in nxt:
            start = max(
                i for i, (kind, key) in enumerate(seq) if kind == "start" and key == k and i < first_read
            )
            assert last_wait < start < first_read, (cur, nxt, seq)
    assert bw_waits > 0, bw_waits


def odd_sizes(rank, world):
    """Parameters whose rows do not divide by ``world`` (padding rows in every gathered unit),
    trained eager and compiled whole (``layout.split_views``: the padding is a piece of its
    own): the same losses and parameters over three steps, within 1e-6."""
    out = {}
    for is_compiled in (False, True):
        fresh()
        torch.manual_seed(0)
        m = zero.shard(
            torch.nn.Sequential(
                torch.nn.Linear(7, 5),
                torch.nn.LayerNorm(5),
                torch.nn.Linear(5, 3, bias=False),
                torch.nn.Linear(3, 1),
            )
        )
        call = torch.compile(m, fullgraph=True, backend=BACKEND) if is_compiled else m
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
        out[is_compiled] = losses, {k: v.full_tensor().clone() for k, v in m.state_dict().items()}
    fresh()
    (eager_losses, eager), (losses, params) = out[False], out[True]
    loss = max(abs(a - b) for a, b in zip(eager_losses, losses))
    params = max((eager[k] - params[k]).abs().max().item() for k in eager)
    assert loss < 1e-6 and params < 1e-6, (loss, params)


def _parts(world):
    cases = CASES if world == 1 else CASES[1:4]  # two ranks: the cases with regions and the whole model
    return [
        (equal_to_eager, cases),
        (graphs,),
        (dead_code,),
        (memory,),
        (fused_cast,),
        (auto_compiled,),
        (prefetch_order,),
    ]


@pytest.fixture(scope="module")
def started():
    """Both world sizes' ranks, started together: one rank alone would leave a core idle.
    Inductor's part runs on one world size (its C++ compile is the slow part), in a process
    of its own beside them."""
    runs = {
        1: start_parts(1, _parts(1), timeout=400),
        "inductor": start_parts(1, [(inductor,)], timeout=400),
        2: start_parts(2, _parts(2), timeout=400),
    }
    yield runs
    for run in runs.values():
        run.close()


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def ranks(request, started):
    """The checks of the world size's spawn."""
    return started[request.param].checks()


def test_compiled_fullgraph_training_equals_eager_zero_training(ranks):
    """Whole model and per block, with regions wrapped before or after sharding, and with
    dynamic shapes over three batch sizes (recompiles: the group key stays a constant)."""
    ranks.passed("equal_to_eager")


def test_inductor_compiles_the_gathers_and_trains_as_eager(started):
    """One world size only (inductor's C++ compile is slow)."""
    started["inductor"].checks().passed("inductor")


def test_gathers_and_releases_are_graph_nodes_and_backward_gathers_again(ranks):
    """Forward: one gather and one release per group a unit gathers; backward: every
    trainable group gathered again and reduce-scattered; nothing the forward saves is
    computed from gathered parameters alone (no full parameter held until backward)."""
    ranks.passed("graphs")


def test_release_survives_dead_code_elimination(ranks):
    ranks.passed("dead_code")


def test_no_tensor_and_no_unit_leaks_over_ten_compiled_steps(ranks):
    """A release the compiler dropped leaked a unit's gathered parameters every step
    (issue 13: 400 KB a step). Now no tensor stays alive from one step to the next, and
    the allocator's growth over ten steps is well under two units (eager ``zero.shard``
    itself grows by some kilobytes a step of non-tensor memory on CPU: not compared here)."""
    ranks.passed("memory")


def test_autocasts_downcast_of_a_gathered_parameter_moves_into_the_gather(ranks):
    """``compile/passes/gather_cast.py``: a unit whose every parameter autocast casts to bf16 gathers
    bf16 (forward, and backward's gather again), with no cast of a gathered value left; the
    root (a LayerNorm, read in fp32) still gathers fp32. Training is bit-identical to the same
    compiled model without the pass, and the wire carries bf16 for the Linear units."""
    ranks.passed("fused_cast")


def test_mixed_precision_compiles_inside_autocast_and_refuses_outside(ranks):
    """``MixedPrecision`` runs low-precision modules under autocast from hooks, which a compiled
    unit cannot hold: inside the caller's autocast it compiles (the Linear groups travel bf16,
    as the fused fp32 groups do: bit-identical training), outside it is a ZeroError naming the
    autocast to use."""
    ranks.passed("mixed_precision")


def test_auto_dtype_compiled_gathers_every_linear_group_in_bf16(ranks):
    """``MixedPrecision("auto")`` compiled: groups by module class let the pass move autocast's
    cast into each Linear group's gather (sharded plainly, each unit's one trainable group mixes
    LayerNorm and Linear parameters and travels fp32). The same losses; fewer bytes on the
    wire (from the second step a unit's groups go as one all-gather of bytes, each group in
    its own dtype: the total says it)."""
    ranks.passed("auto_compiled")


def test_the_next_units_all_gather_is_issued_before_this_units_compute(ranks):
    """``compile/passes/gather_prefetch.py``: in a whole-model graph each gather is a start and a
    wait, and unit k+1's starts come right after unit k's waits, before anything reads unit
    k's parameters. With the runtime prefetch off the graph's order is the only prefetch;
    training equals eager zero.shard, and backward still gathers every trainable unit again.
    One rank: nothing to overlap (a gather is a cast on the compute stream), every gather whole."""
    ranks.passed("prefetch_order")


def test_compiled_training_equals_eager_where_rows_do_not_divide_by_three_ranks():
    """Padding rows in the gathered units (7, 5, 3 and 1 rows over 3 ranks): the compiled
    forward's views come from one split whose padding pieces no parameter reads."""
    run_ranks(odd_sizes, 3, timeout=300)
