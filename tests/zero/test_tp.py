"""Zero and tensor parallel composed on a 2 x 2 mesh (issue 29, item 4), on 4 gloo ranks.

Four gloo ranks as ``init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))``. A model
of three pre-norm MLP blocks and a head; each block's ``up`` is ``ColwiseParallel`` and its
``down`` ``RowwiseParallel`` over ``mesh["tp"]`` (torch's ``parallelize_module``: their weights
DTensors, an all-reduce after ``down``), then ``zero.shard`` over ``mesh["dp"]``'s group, then
every block a tracedac region, eager and compiled. The two ranks of one ``dp`` coordinate take
the same half of the batch; the loss is averaged over ``dp``.

The oracles (docs/design.md, "ZeRO with tensor parallelism"): ``reference``, the same model,
not parallelized, not sharded, not checkpointed, on the whole batch, in one process (each rank
computes it); and FSDP2 with the same tensor (and sequence) parallel (``against_fsdp2``). One
spawn runs every rank function below, each checking what it computes (tests/support/ranks.py).
"""

from __future__ import annotations

import copy
import functools
import os
import re
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

import tracedac
import tracedac.zero as zero

from ..support import compiled_graphs as cg
from ..support.ranks import check, message_of, run_parts
from ..support.zero_logs import WireLog

pytestmark = pytest.mark.slow  # the quick loop (pytest -m "not slow") leaves this file out

D, H, OUT = 16, 32, 4  # width, MLP hidden, head
BATCH, STEPS, BLOCKS = 8, 3, 3
LR, CLIP = 1e-2, 0.5  # clipping at 0.5 is active: every step's norm is above it


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, D)

    def forward(self, x):  # [B, D]
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(D, OUT)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def model(seed: int = 0) -> Model:
    torch.manual_seed(seed)
    return Model()


def batches() -> list:
    """``STEPS + 1`` whole batches (the last one for the step after a checkpoint)."""
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(BATCH, D, generator=g), torch.randn(BATCH, OUT, generator=g)) for _ in range(STEPS + 1)
    ]


@functools.cache
def reference(autocast: bool = False) -> dict:
    """One process, the whole batch: each step's loss and gradient norm, the parameters after
    ``STEPS`` steps. ``autocast``: every Linear under bf16 autocast (what MixedPrecision() does)."""
    m = model()
    if autocast:
        for mod in m.modules():
            if isinstance(mod, nn.Linear):
                mod.forward = _autocast(mod.forward)
    opt = torch.optim.AdamW(m.parameters(), lr=LR)
    losses, norms = [], []
    for x, y in batches()[:STEPS]:
        loss = F.mse_loss(m(x).float(), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {
        "losses": losses,
        "norms": norms,
        "params": {k: v.detach().clone() for k, v in m.named_parameters()},
    }


def _autocast(forward):
    def run(*args):
        with torch.autocast("cpu", torch.bfloat16):
            return forward(*args)

    return run


@functools.cache
def mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def parallel(seed: int = 0, sp: bool = False) -> Model:
    """The model with its blocks tensor parallel over "tp". ``sp``: sequence parallel too, as
    torchtitan plans it: each TP rank holds half of the rows between blocks, the norm runs on
    them (its weights replicated DTensors), ``up`` gathers the rows, ``down`` scatters them back
    (a reduce-scatter for the all-reduce), and the head gathers them for the loss."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    m = model(seed)
    tp = mesh()["tp"]
    for block in m.blocks:
        if sp:
            plan = {
                "norm": SequenceParallel(sequence_dim=0),
                "up": ColwiseParallel(input_layouts=Shard(0)),
                "down": RowwiseParallel(output_layouts=Shard(0)),
            }
        else:
            plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
        parallelize_module(block, tp, plan)
    if sp:
        parallelize_module(m.head, tp, ColwiseParallel(input_layouts=Shard(0), output_layouts=Replicate()))
    return m


def sharded(seed: int = 0, regions: bool = True, sp: bool = False, policy=None, **shard_kw) -> Model:
    """The model, its blocks tensor parallel over "tp" (``parallel``), sharded over "dp",
    blocks in regions (under ``policy``, default recompute_all)."""
    m = parallel(seed, sp)
    shard_kw.setdefault("group", mesh()["dp"].get_group())
    zero.shard(m, **shard_kw)
    if regions:
        tracedac.wrap(m, Block, policy=policy)
    return m


def step(m, opt, x, y) -> tuple[float, float]:
    """One AdamW step on this rank's half of the batch: (loss averaged over dp, gradient norm)."""
    dp = mesh()["dp"]
    x, y = x.chunk(2)[dp.get_local_rank()], y.chunk(2)[dp.get_local_rank()]
    loss = F.mse_loss(m(x).float(), y)
    loss.backward()
    norm = float(zero.clip_grad_norm_(m, CLIP))
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total, group=dp.get_group())
    return total.item() / 2, norm


def _full(m) -> dict:
    return {k: v.full_tensor().detach().clone() for k, v in m.named_parameters()}


def _seen(module) -> list:
    """What ``module``'s forward reads as its weight: (type, mesh dims, placements, dtype, shape)."""
    seen = []

    def hook(mod, args):
        w = mod.weight
        seen.append(
            (type(w).__name__, w.device_mesh.mesh_dim_names, tuple(w.placements), w.dtype, tuple(w.shape))
        )

    module.register_forward_pre_hook(hook)
    return seen


def _close(a, b, tol):
    assert len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b)), (a, b)


_EAGER: dict = {}  # what ``train`` and ``collectives`` found in this rank, for ``compiled``


def train(rank, world, tmp):
    """``STEPS`` steps against the reference (checks "losses", "norms", "params"), the
    parameters' placements ("placements"), what ``up`` and ``down`` compute with ("seen"); then
    a DCP checkpoint ("dcp": the next step of a fresh model loaded from it is the next step of
    the model that went on), and the full state dict and parameters ("full")."""
    m = sharded()
    seen = {"up": _seen(m.blocks[0].up), "down": _seen(m.blocks[0].down)}
    opt = torch.optim.AdamW(m.parameters(), lr=LR)
    data = batches()
    losses, norms = zip(*(step(m, opt, x, y) for x, y in data[:STEPS]))
    params = _full(m)
    placements = {k: (v.device_mesh.mesh_dim_names, tuple(v.placements)) for k, v in m.named_parameters()}
    path = os.path.join(tmp, "tp")
    zero.save_checkpoint(path, m, opt)
    saved = copy.deepcopy(params)
    continued = step(m, opt, *data[STEPS])
    fresh = sharded(seed=5)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=LR)
    zero.load_checkpoint(path, fresh, fresh_opt)
    loaded = _full(fresh)
    resumed = step(fresh, fresh_opt, *data[STEPS])
    # the unsharded model's tensors, into another sharded model; full_parameters writes back
    full = zero.full_state_dict(fresh)
    other = sharded(seed=6)
    zero.load_full_state_dict(other, full)
    with zero.full_parameters(other), torch.no_grad():
        inside = tuple(other.blocks[0].up.weight.shape)
        other.blocks[0].up.weight.add_(1.0)
    written = float(
        (other.blocks[0].up.weight.full_tensor() - full["blocks.0.up.weight"]).sub(1.0).abs().max()
    )
    full_fresh, full_other = _full(fresh), _full(other)  # (collectives: before any check)
    ref = reference()
    _EAGER["train"] = losses, norms
    with check("losses"):
        assert len(losses) == STEPS, losses
        _close(losses, ref["losses"], 1e-5)
    with check("norms"):
        assert all(n > CLIP for n in ref["norms"]), ref["norms"]  # clipping is active at every step
        _close(norms, ref["norms"], 1e-5)
    with check("params"):
        assert params.keys() == ref["params"].keys(), (params.keys(), ref["params"].keys())
        for name, want in ref["params"].items():
            assert params[name].shape == want.shape, name
            assert float((params[name] - want).abs().max()) <= 1e-5, name
    with check("placements"):
        strided = _StridedShard(0, split_factor=2)
        want = {
            "blocks.0.up.weight": (strided, Shard(0)),
            "blocks.0.up.bias": (strided, Shard(0)),
            "blocks.0.down.weight": (Shard(0), Shard(1)),
            "blocks.0.down.bias": (Shard(0), Replicate()),
            "blocks.0.norm.weight": (Shard(0), Replicate()),
            "head.weight": (Shard(0), Replicate()),
        }
        assert {dims for dims, _ in placements.values()} == {("dp", "tp")}, placements
        assert {k: placements[k][1] for k in want} == want, placements
    with check("seen"):
        assert seen["up"][0] == ("DTensor", ("tp",), (Shard(0),), torch.float32, (H, D)), seen["up"]
        assert seen["down"][0] == ("DTensor", ("tp",), (Shard(1),), torch.float32, (D, H)), seen["down"]
    with check("dcp"):
        loaded_diff = max(float((loaded[k] - saved[k]).abs().max()) for k in saved)
        assert loaded_diff == 0.0, loaded_diff
        _close(resumed, continued, 1e-6)
    with check("full"):
        # full_state_dict: every parameter's full value, TP gathered too
        assert max(float((full[k] - full_fresh[k]).abs().max()) for k in saved) == 0.0
        # loaded into another sharded model
        others = {k: v for k, v in full_other.items() if k != "blocks.0.up.weight"}
        assert max(float((v - full[k]).abs().max()) for k, v in others.items()) == 0.0
        assert inside == (H, D), inside  # the unsharded weight, not its TP piece
        assert written <= 1e-6, written  # a write inside lands in this rank's rows of its TP piece


_COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")


class _Count(TorchDispatchMode):
    """tracedac.zero's gathers and the functional collectives tensor parallel issues, seen
    beneath DTensor (declining its ops, as torch's CommDebugMode does)."""

    def __init__(self):
        super().__init__()
        self.counts = Counter()
        self.gathered = []  # a weak reference to each gathered buffer's storage

    def held(self) -> int:
        """How many of the buffers gathered under this mode are still alive."""
        return sum(not ref.expired() for ref in self.gathered)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        name = str(func)
        if name.startswith(("tracedac.all_gather", *(f"_c10d_functional.{c}" for c in _COLLECTIVES))):
            self.counts[name] += 1
        out = func(*args, **(kwargs or {}))
        if name.startswith("tracedac.all_gather"):
            self.gathered.append(StorageWeakRef(out.untyped_storage()))
        return out


def collectives(rank, world):
    """A region records the block's TP all-reduce once and keeps it; zero's gathers it
    replays: with regions and without, one step issues the same collectives, each unit
    gathered in forward and again in backward, and no gathered buffer alive between them."""
    out = {}
    x, y = batches()[0]
    dp = mesh()["dp"].get_local_rank()
    for regions in (True, False):
        m = sharded(regions=regions)
        with _Count() as forward:
            loss = F.mse_loss(m(x.chunk(2)[dp]), y.chunk(2)[dp])
        held = forward.held()
        with _Count() as backward:
            loss.backward()
        out[regions] = (dict(forward.counts), dict(backward.counts), held)
    _EAGER["backward all-reduces"] = out[True][1].get("_c10d_functional.all_reduce.default")
    gathers, all_reduce = "tracedac.all_gather.default", "_c10d_functional.all_reduce.default"
    for regions in (True, False):
        forward, backward, held = out[regions]
        assert forward == backward == {gathers: BLOCKS + 1, all_reduce: BLOCKS}, out
        assert held == 0, out


def mixed(rank, world):
    """``MixedPrecision()`` (bf16 Linears): ``up`` computes with a bf16 DTensor weight; the
    losses are the reference's with its Linears under bf16 autocast, within bf16 rounding (a
    Rowwise layer sums its two partial products in bf16, the reference in one matmul)."""
    m = sharded(mixed_precision=zero.MixedPrecision())
    seen = _seen(m.blocks[0].up)
    opt = torch.optim.AdamW(m.parameters(), lr=LR)
    losses = [step(m, opt, x, y)[0] for x, y in batches()[:STEPS]]
    assert seen[0] == ("DTensor", ("tp",), (Shard(0),), torch.bfloat16, (H, D)), seen[0]
    _close(losses, reference(autocast=True)["losses"], 2e-3)


# (how it is compiled, whether blocks are regions, backend): torchtitan's order (shard, wrap,
# then compile each block), and the whole model, whose gathers gather_prefetch splits
COMPILED = (
    ("per-block", True, "aot_eager_decomp_partition"),
    ("whole", True, "aot_eager_decomp_partition"),
    ("whole", False, "aot_eager_decomp_partition"),
    ("whole", True, "inductor"),
)


def _collectives(gms) -> dict:
    """{functional collective: count} over graphs ``gms`` (its waits left out)."""
    names = [
        n.target._opname
        for gm in gms
        for n in gm.graph.nodes
        if getattr(n.target, "namespace", None) == "_c10d_functional" and "wait" not in str(n.target)
    ]
    return {name: names.count(name) for name in set(names)}


def _compiled_run(how, regions, backend, mixed_precision=None, tmp=None) -> dict:
    """Three steps of the model compiled fullgraph: losses and norms, the parameters after
    them, and, on ``aot_eager_decomp_partition``, the graphs' gathers and collectives. Compiled
    whole, ``zero``'s functions are handed what ``torch.compile`` returned: the norm, the
    parameters (``full_state_dict``) and, with ``tmp``, a DCP checkpoint saved from it and
    loaded into a fresh eager model ("loaded": the largest difference)."""
    cg.fresh()
    graphs = cg.Graphs() if backend == cg.BACKEND else None
    m = sharded(regions=regions, mixed_precision=mixed_precision)
    call = cg.compiled(m, how, backend=graphs.backend if graphs else backend)
    opt = torch.optim.AdamW(m.parameters(), lr=LR)
    with torch.autocast("cpu", torch.bfloat16, enabled=mixed_precision is not None):
        losses, norms = zip(*(step(call, opt, x, y) for x, y in batches()[:STEPS]))
    out = {"losses": list(losses), "norms": list(norms), "params": zero.full_state_dict(call)}
    if tmp is not None:
        path = os.path.join(tmp, f"compiled-{how}")
        zero.save_checkpoint(path, call, opt)
        fresh = sharded(seed=5)
        zero.load_checkpoint(path, fresh, torch.optim.AdamW(fresh.parameters(), lr=LR))
        out["loaded"] = max(float((v - out["params"][k]).abs().max()) for k, v in _full(fresh).items())
    if graphs is not None:
        out.update(cg.graph_counts(graphs, m))
        out["fw_collectives"] = _collectives(graphs.forward)
        out["bw_collectives"] = _collectives(graphs.backward)
        out["gather_dtypes"] = sorted(
            cg.gather_dtype(n)
            for gm in graphs.forward
            for n in gm.graph.nodes
            if n.target in (cg.GATHER, cg.START)
        )
    cg.fresh()
    return out


def case_id(case) -> str:
    return "-".join(map(str, case))


def compiled(rank, world, tmp):
    """Zero + TP compiled: each ``COMPILED`` case (check "compiled <case>": the losses, norms
    and parameters of eager zero + TP and of one process; "graphs <case>" on
    aot_eager_decomp_partition); the first whole one checkpointed through DCP ("compiled
    loaded"); and under bf16 autocast (blocks compiled one by one, in regions)
    ``MixedPrecision()`` and ``MixedPrecision("auto")`` ("compiled mixed", "compiled auto")."""
    ref = reference()
    eager_losses, eager_norms = _EAGER["train"]
    for case in COMPILED:
        got = _compiled_run(*case, tmp=tmp if case == COMPILED[1] else None)
        with check(f"compiled {case_id(case)}"):
            _close(got["losses"], eager_losses, 1e-6)
            _close(got["norms"], eager_norms, 1e-6)
            _close(got["losses"], ref["losses"], 1e-5)
            params = got["params"]  # full_state_dict of what was compiled
            assert params.keys() == ref["params"].keys(), params.keys()  # the model's keys: no "_orig_mod."
            for name, want in ref["params"].items():
                assert float((params[name] - want).abs().max()) <= 1e-5, name
        if case == COMPILED[1]:
            with check("compiled loaded"):
                assert got["loaded"] == 0.0, got["loaded"]
        if case[2] != "inductor":
            with check(f"graphs {case_id(case)}"):
                how = case[0]
                units = BLOCKS if how == "per-block" else BLOCKS + 1  # the root unit: compiled whole only
                assert got["fw_gathers"] == got["bw_gathers"] == got["fw_releases"] == units, got
                assert got["saved_gathered"] == [], got
                assert got["fw_collectives"] == {"all_reduce": BLOCKS}, got
                assert got["bw_collectives"] == {"all_reduce": _EAGER["backward all-reduces"]}, got
    want = reference(autocast=True)["losses"]
    for name, mp in (("mixed", zero.MixedPrecision()), ("auto", zero.MixedPrecision("auto"))):
        got = _compiled_run("per-block", True, "aot_eager_decomp_partition", mp)
        with check(f"compiled {name}"):
            linears, others = BLOCKS, BLOCKS  # per block: its Linears' group and its norm's
            assert got["gather_dtypes"] == ["torch.bfloat16"] * linears + ["torch.float32"] * others, got
            _close(got["losses"], want, 2e-3)


def fsdp2(seed: int = 0, sp: bool = False) -> Model:
    """The model as FSDP2 shards it with the same tensor parallel: the oracle of the layout."""
    from torch.distributed.fsdp import fully_shard

    m = parallel(seed, sp)
    for block in m.blocks:
        fully_shard(block, mesh=mesh()["dp"])
    return fully_shard(m, mesh=mesh()["dp"])


# (compiled, sequence parallel, the regions' policy): against FSDP2 with the same parallelism
AGAINST_FSDP2 = (
    (False, False, None),
    (True, False, None),
    (False, True, "save_matmuls"),
    (True, True, "save_matmuls"),
)


def fsdp2_id(case) -> str:
    return f"{'compiled' if case[0] else 'eager'}-{'sp' if case[1] else 'tp'}-{case[2]}"


def against_fsdp2(rank, world):
    """FSDP2 + TP and zero + TP (blocks in regions) per ``AGAINST_FSDP2`` case, each block
    compiled or not: per parameter, its placements and this rank's local shard before
    training and after three steps (no clipping: torch's clip_grad_norm_ refuses FSDP2's two
    meshes), and the losses (check "against fsdp2 <case>"). With sequence parallel each TP rank
    feeds its half of the rows."""
    out = {}
    dp, tp = mesh()["dp"], mesh()["tp"]
    for case in AGAINST_FSDP2:
        compile_blocks, sp, policy = case
        ours = functools.partial(sharded, sp=sp, policy=policy and getattr(tracedac.policies, policy)())
        for name, make in (("fsdp2", functools.partial(fsdp2, sp=sp)), ("zero", ours)):
            cg.fresh()
            m = make()
            before = {
                k: (tuple(v.placements), v.to_local().detach().clone()) for k, v in m.named_parameters()
            }
            if compile_blocks:
                cg.compiled(m, "per-block")
            opt = torch.optim.AdamW(m.parameters(), lr=LR)
            losses = []
            for x, y in batches()[:STEPS]:
                x, y = x.chunk(2)[dp.get_local_rank()], y.chunk(2)[dp.get_local_rank()]
                loss = F.mse_loss(m(x.chunk(2)[tp.get_local_rank()] if sp else x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            after = {k: v.to_local().detach().clone() for k, v in m.named_parameters()}
            out[name] = {"before": before, "after": after, "losses": losses}
        want, got = out["fsdp2"], out["zero"]
        with check(f"against fsdp2 {fsdp2_id(case)}"):
            _close(got["losses"], want["losses"], 1e-6)
            for name, (placements, local) in want["before"].items():
                mine, shard = got["before"][name]
                assert torch.equal(shard, local), name
                assert mine == placements or mine == (*placements, Replicate()), (name, mine, placements)
                assert float((got["after"][name] - want["after"][name]).abs().max()) <= 1e-6, name
    cg.fresh()


def auto(rank, world):
    """``MixedPrecision("auto")`` under bf16 autocast, eager, with regions and without (check
    "auto <regions>"): the Linears' groups decided bf16 and the norms' fp32, bf16 on the wire,
    and the losses of the autocast reference within bf16 rounding."""
    want = reference(autocast=True)["losses"]
    for regions in (True, False):
        m = sharded(regions=regions, mixed_precision=zero.MixedPrecision("auto"))
        opt = torch.optim.AdamW(m.parameters(), lr=LR)
        with WireLog() as wire, torch.autocast("cpu", torch.bfloat16):
            losses = [step(m, opt, x, y)[0] for x, y in batches()[:STEPS]]
        dtypes = {g.name: g.dtype for g in m._tracedac_zero.all_groups}
        with check(f"auto {'regions' if regions else 'no-regions'}"):
            linear = {k: v for k, v in dtypes.items() if "Linear" in k}
            norm = {k: v for k, v in dtypes.items() if "LayerNorm" in k}
            assert len(linear) == BLOCKS + 1 and len(norm) == BLOCKS, dtypes
            assert set(linear.values()) == {torch.bfloat16} and set(norm.values()) == {torch.float32}, dtypes
            assert wire.bytes.get("bfloat16", 0) > 0, wire.bytes
            _close(losses, want, 2e-3)


def refusals(rank, world):
    """group=None with TP would mix TP's ranks into dp: ZeroError at the call, on every rank,
    naming the parameter, the world's ranks and what to pass."""
    message = message_of(zero.ZeroError, sharded, group=dist.group.WORLD)
    want = r"blocks\.0\.up\.weight.*no dimension is the process group.*\[0, 1, 2, 3\].*group=mesh"
    assert re.search(want, message, re.S), message


PARTS = (train, collectives, mixed, auto, compiled, against_fsdp2, refusals)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("tp"))
    parts = [(fn, tmp) if fn in (train, compiled) else (fn,) for fn in PARTS]
    return run_parts(4, parts, timeout=480)


def test_losses_equal_one_process_on_the_whole_batch_over_three_steps(ranks):
    """Each dp half of the batch on two TP ranks, gradients reduce-scattered over dp: the
    updates of one process on the whole batch."""
    ranks.passed("losses")


def test_clip_grad_norm_counts_tp_shards_once_each_and_replicated_parameters_once(ranks):
    """zero.clip_grad_norm_ sums a TP-sharded gradient over dp and TP, a replicated one over
    dp only: the whole model's norm (clipping is active at every step)."""
    ranks.passed("norms")


def test_parameters_after_the_steps_equal_the_references(ranks):
    ranks.passed("params")


def test_parameters_are_dtensors_on_the_2d_mesh_sharded_over_dp_and_placed_as_tp_placed_them(ranks):
    """Optimizers and DCP see one mesh for the whole model; a Colwise weight's rows are cut by TP
    first, then by dp (_StridedShard), as FSDP2 lays them out."""
    ranks.passed("placements")


@pytest.mark.parametrize("case", AGAINST_FSDP2, ids=fsdp2_id)
def test_each_rank_holds_fsdp2s_shard_of_every_parameter_and_trains_it_as_fsdp2_does(ranks, case):
    """FSDP2 with the same tensor parallel is the oracle: on every rank each parameter's local
    shard is FSDP2's, bit for bit, before training and within 1e-6 after three AdamW steps
    (eager, and each block compiled; tensor parallel alone, and with sequence parallel, whose
    norm weights are replicated DTensors with partial gradients), with FSDP2's losses. A TP
    parameter is placed as FSDP2 places it; a plain one sits on the 2-D mesh, replicated over
    tp, where FSDP2 leaves it on the dp mesh alone (one mesh for the model: torch's
    clip_grad_norm_ works, above)."""
    ranks.passed(f"against fsdp2 {fsdp2_id(case)}")


def test_a_tp_module_computes_with_its_tp_dtensor_parameters_in_forward(ranks):
    ranks.passed("seen")


def test_a_dcp_checkpoint_loads_into_a_fresh_sharded_model_exactly(ranks):
    """Saved after three steps, loaded into a model built from another seed: the same
    parameters and the same next step (loss and gradient norm) as the model that went on."""
    ranks.passed("dcp")


def test_full_state_dict_load_full_state_dict_and_full_parameters_see_the_unsharded_tensors(ranks):
    ranks.passed("full")


def test_regions_issue_the_collectives_of_no_regions_and_gather_every_unit_again_in_backward(ranks):
    """A region records the block's TP all-reduce once and keeps it; zero's gathers it
    replays: backward gathers each unit (3 blocks and the root) again, as without regions,
    and between forward and backward no gathered buffer is alive, though autograd saved the
    DTensor weights made from them (each becomes a handle that gathers again)."""
    ranks.passed("collectives")


def test_mixed_precision_gathers_bf16_tp_weights_and_trains_as_autocast_would(ranks):
    """MixedPrecision() with TP: the weight a Linear computes with is a bf16 DTensor; the losses
    are those of the reference with its Linears under bf16 autocast, within bf16 rounding (a
    Rowwise layer sums its two partial products in bf16, the reference in one matmul)."""
    ranks.passed("mixed")


@pytest.mark.parametrize("case", COMPILED, ids=case_id)
def test_compiled_zero_with_tp_trains_as_eager_and_as_one_process(ranks, case):
    """Blocks compiled one by one (torchtitan's order) or the whole model, with regions or
    without, aot_eager_decomp_partition or inductor: the losses, gradient norms and parameters
    of eager zero + TP and of one process on the whole batch. The norm is taken of the model
    ``torch.compile`` returned (``zero.clip_grad_norm_`` reads the model it compiled)."""
    ranks.passed(f"compiled {case_id(case)}")


def test_a_checkpoint_saved_from_the_compiled_model_loads_into_an_eager_one_exactly(ranks):
    """``save_checkpoint`` handed what ``torch.compile(model)`` returned writes the model's own
    keys: a fresh eager zero + TP model loads them and holds the trained parameters."""
    ranks.passed("compiled loaded")


@pytest.mark.parametrize("case", [c for c in COMPILED if c[2] != "inductor"], ids=case_id)
def test_compiled_zero_with_tp_gathers_again_in_backward_and_issues_each_all_reduce_once(ranks, case):
    """The graphs torch's partitioner made: every unit gathered in forward and again in
    backward, no gathered parameter (nor the DTensor weight made from it) saved for backward,
    and each block's TP all-reduce issued once, in forward, as eager zero + TP does (backward's
    all-reduces are the TP backward's own: as many as eager's backward issues)."""
    ranks.passed(f"graphs {case_id(case)}")


@pytest.mark.parametrize("mixed", ["mixed", "auto"])
def test_compiled_mixed_precision_with_tp_gathers_the_linears_in_bf16_and_trains_as_autocast(ranks, mixed):
    """MixedPrecision() and MixedPrecision("auto") compiled under bf16 autocast: the Linears'
    groups gathered in bf16 (the cast moved into the gather), the norms' in fp32, and the
    losses those of the reference with its Linears under autocast, within bf16 rounding."""
    ranks.passed(f"compiled {mixed}")


@pytest.mark.parametrize("regions", [True, False], ids=["regions", "no-regions"])
def test_auto_mixed_precision_with_tp_gathers_the_linears_in_bf16_as_the_program_reads_them(ranks, regions):
    """MixedPrecision("auto") with TP, eager under bf16 autocast: the first forward watches each
    gathered weight as the module reads it, a DTensor (or, inside a region, whose recorder
    leaves DTensor ops to DTensor, its local tensor), sees the Linears' weights cast to bf16
    and the norms' read in fp32, and decides so on every rank; the losses are the autocast
    reference's within bf16 rounding, and the wire carries bf16 from the second step."""
    ranks.passed(f"auto {'regions' if regions else 'no-regions'}")


def test_sharding_tp_parameters_over_the_whole_world_is_refused_on_every_rank_saying_what_to_do(ranks):
    """group=None with TP would mix TP's ranks into dp: ZeroError at the call, on every rank."""
    ranks.passed("refusals")
