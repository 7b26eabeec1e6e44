"""Zero + tensor parallel on a 2 x 2 mesh, what each rank runs (imported by spawned processes).

Four gloo ranks as ``init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))``. A
model of three pre-norm MLP blocks and a head; each block's ``up`` is ``ColwiseParallel``
and its ``down`` ``RowwiseParallel`` over ``mesh["tp"]`` (their weights DTensors, an
all-reduce after ``down``), then ``zero.shard`` over ``mesh["dp"]``'s group, then every block a
tracedac region. The two ranks of one ``dp`` coordinate take the same half of the batch; the
loss is averaged over ``dp``.

The oracles: ``reference``, run in the test's own process, the same model, not parallelized,
not sharded, not checkpointed, on the whole batch; and ``fsdp2``, the model parallelized the
same way and sharded by FSDP2 (``against_fsdp2``).
"""

from __future__ import annotations

import copy
import functools
import os
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

import tracedac
import tracedac.zero as zero

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


def train(rank, world, tmp):
    """Losses and norms over ``STEPS`` steps, the parameters after them (full tensors), the
    parameters' placements, what ``up`` and ``down`` compute with; then a DCP checkpoint: the
    next step's loss continued and resumed in a fresh model, and the parameters loaded."""
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
    return {
        "losses": list(losses),
        "norms": list(norms),
        "params": params if rank == 0 else None,
        "placements": placements,
        "seen": {k: v[0] for k, v in seen.items()},
        "loaded": max(float((loaded[k] - saved[k]).abs().max()) for k in saved),
        "continued": continued,
        "resumed": resumed,
        "full": max(float((full[k] - _full(fresh)[k]).abs().max()) for k in saved),
        "full_parameters": (inside, written),
        "full_loaded": max(
            float((v - full[k]).abs().max()) for k, v in _full(other).items() if k != "blocks.0.up.weight"
        ),
    }


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
    """With and without regions: (forward counts, backward counts, how many gathered buffers
    are alive between forward and backward) of one step."""
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
    return out


def mixed(rank, world):
    """``MixedPrecision()`` (bf16 Linears): losses, and what ``up`` computes with."""
    m = sharded(mixed_precision=zero.MixedPrecision())
    seen = _seen(m.blocks[0].up)
    opt = torch.optim.AdamW(m.parameters(), lr=LR)
    losses = [step(m, opt, x, y)[0] for x, y in batches()[:STEPS]]
    return {"losses": losses, "seen": seen[0]}


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
    from . import compile_workers as cw

    cw._fresh()
    graphs = cw.Graphs() if backend == cw.BACKEND else None
    m = sharded(regions=regions, mixed_precision=mixed_precision)
    call = cw.compiled(m, how, backend=graphs.backend if graphs else backend)
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
        out.update(cw._graph_counts(graphs, m))
        out["fw_collectives"] = _collectives(graphs.forward)
        out["bw_collectives"] = _collectives(graphs.backward)
        out["gather_dtypes"] = sorted(
            str(n.kwargs.get("dtype", n.args[2] if len(n.args) > 2 else None))
            for gm in graphs.forward
            for n in gm.graph.nodes
            if n.target in (cw.GATHER, cw.START)
        )
    cw._fresh()
    return out


def compiled(rank, world, tmp):
    """Zero + TP compiled: each ``COMPILED`` case (the first whole one checkpointed through
    DCP), and under bf16 autocast (blocks compiled one by one, in regions) ``MixedPrecision()``
    and ``MixedPrecision("auto")``, keyed "mixed" and "auto"."""
    out = {case: _compiled_run(*case, tmp=tmp if case == COMPILED[1] else None) for case in COMPILED}
    for name, mp in (("mixed", zero.MixedPrecision()), ("auto", zero.MixedPrecision("auto"))):
        out[name] = _compiled_run("per-block", True, "aot_eager_decomp_partition", mp)
    return out


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


def against_fsdp2(rank, world):
    """FSDP2 + TP and zero + TP (blocks in regions) per ``AGAINST_FSDP2`` case, each block
    compiled or not: per parameter, its placements and this rank's local shard before
    training and after three steps (no clipping: torch's clip_grad_norm_ refuses FSDP2's two
    meshes), and the losses. With sequence parallel each TP rank feeds its half of the rows."""
    from . import compile_workers as cw

    out = {}
    dp, tp = mesh()["dp"], mesh()["tp"]
    for case in AGAINST_FSDP2:
        compile_blocks, sp, policy = case
        ours = functools.partial(sharded, sp=sp, policy=policy and getattr(tracedac.policies, policy)())
        for name, make in (("fsdp2", functools.partial(fsdp2, sp=sp)), ("zero", ours)):
            cw._fresh()
            m = make()
            before = {
                k: (tuple(v.placements), v.to_local().detach().clone()) for k, v in m.named_parameters()
            }
            if compile_blocks:
                cw.compiled(m, "per-block")
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
            out[case, name] = {"before": before, "after": after, "losses": losses}
    cw._fresh()
    return out


def auto(rank, world):
    """``MixedPrecision("auto")`` under bf16 autocast, eager, with regions and without: losses,
    each group's dtype after the first step (decided), all-gather bytes by dtype."""
    from benchmarks.collectives import AllGatherCounter

    out = {}
    for regions in (True, False):
        m = sharded(regions=regions, mixed_precision=zero.MixedPrecision("auto"))
        opt = torch.optim.AdamW(m.parameters(), lr=LR)
        counter = AllGatherCounter()
        with counter, torch.autocast("cpu", torch.bfloat16):
            losses = [step(m, opt, x, y)[0] for x, y in batches()[:STEPS]]
        dtypes = {g.name: g.dtype for g in m._tracedac_zero.all_groups}
        out[regions] = {"losses": losses, "dtypes": dtypes, "wire": dict(counter.bytes)}
    return out


def _refused(fn) -> str | None:
    try:
        fn()
    except zero.ZeroError as e:
        return str(e)
    return None


def refusals(rank, world):
    """The messages of what zero + tensor parallel refuses (None where nothing was raised)."""

    return {
        "world": _refused(lambda: sharded(group=dist.group.WORLD)),
    }


def several(rank, world, parts):
    from .workers import several as run

    return run(rank, world, parts, where=globals())
