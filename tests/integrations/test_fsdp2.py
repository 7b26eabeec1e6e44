"""tracedac regions inside FSDP2 (``torch.distributed.fsdp.fully_shard``), on real gloo groups:
2 ranks, and 4 for a (dp, tp) mesh. What FSDP2's users do: each block checkpointed and
``fully_shard``-ed, then the model; eager and compiled (``aot_eager_decomp_partition``, per
block or the whole model), ``reshard_after_forward`` on and off, FSDP2's bf16
``MixedPrecisionPolicy``, tensor parallel on a 2-D mesh.

A stack of pre-norm MLP blocks, ``fully_shard`` on each block then on the model, as FSDP2's
users write it; each block is a tracedac region (``tracedac.checkpoint(block)``, before or
after ``fully_shard``), torch's checkpoint (``use_reentrant=False``, or selective keeping the
matmuls), or not checkpointed. Every rank function builds each of them from the same seed
under the same FSDP2 set-up (a ``Setup``) and checks, on the rank that computed
(tests/support/ranks.py; one check per rank function and set-up, which a test reports):

- gradients (``full_tensor()``) bit for bit those of no checkpointing, over two SGD steps;
- each block's side effects once a step (a buffer it adds to; eager, a Python counter too),
  where torch's checkpoint runs them twice;
- the allocator's bytes held after the forward (glibc's ``mallinfo2``, from outside the
  library) no more than torch's checkpoint (recompute_all), torch's selective checkpointing
  of the matmuls (save_matmuls) or half of what no checkpointing adds (memory_budget(0.5)),
  and under half of one block's unsharded parameters: no region keeps a block's gathered
  parameters alive (with ``reshard_after_forward=False`` FSDP2 itself keeps them, for every
  variant alike, and the check reads that they are there).
"""

from __future__ import annotations

import ctypes
import functools
import gc
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import tracedac
from tracedac import policies

from ..support.probe import allocated_bytes
from ..support.ranks import check, run_parts

pytestmark = pytest.mark.slow  # the quick loop (pytest -m "not slow") leaves this file out

BACKEND = "aot_eager_decomp_partition"
POLICIES = {
    "recompute_all": policies.recompute_all,
    "save_matmuls": policies.save_matmuls,
    "memory_budget(0.5)": lambda: policies.memory_budget(0.5),
}
# Allocator noise between two readings of the same forward, after the least of three: a few
# KiB (a gloo buffer, a dict grown); tracedac's margins over torch here are 20 KiB and more.
SLACK = 8 * 1024
STEPS = 2


class Block(nn.Module):
    """Pre-norm MLP with a residual; counts its calls in a buffer (FSDP2 leaves buffers
    whole) and, when ``count_calls``, in a Python attribute (dynamo would guard on that int
    and compile again each step, so compiled blocks count in the buffer only)."""

    def __init__(self, d: int, count_calls: bool = True):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)
        self.register_buffer("seen", torch.zeros(()))
        self.count_calls = count_calls
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, d]
        if self.count_calls:
            self.calls += 1
        self.seen.add_(1)
        return x + self.down(F.gelu(self.up(self.norm(x))))  # [N, d]


class Net(nn.Module):
    def __init__(self, d: int, layers: int, count_calls: bool = True):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, count_calls) for _ in range(layers))
        self.head = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, d] -> loss
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


@dataclass(frozen=True)
class Setup:
    """One way to run FSDP2: where tracedac's checkpoint goes, FSDP2's options, compiling."""

    order: str = "before"  # tracedac.checkpoint(block) before or after fully_shard(block)
    reshard: bool = True  # reshard_after_forward
    mp: bool = False  # MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
    compiled: str | None = None  # None, "block" (each block's .compile()) or "model" (torch.compile)
    tp: bool = False  # a (dp, tp) mesh: parallelize_module over tp, then fully_shard over dp

    def __str__(self) -> str:
        parts = [f"checkpoint {self.order} fully_shard", f"reshard_after_forward={self.reshard}"]
        parts += ["bf16 MixedPrecisionPolicy"] if self.mp else []
        parts += [f"compiled per {self.compiled}"] if self.compiled else []
        parts += ["2-D mesh with tensor parallel"] if self.tp else []
        return ", ".join(parts)


def _label(worker: str, setup: Setup) -> str:
    return f"{worker}: {setup}"


def _sac_matmuls(ctx, op, *args, **kwargs):
    keep = op.overloadpacket in policies.MATMUL_OPS
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def _torch(block: nn.Module, selective: bool) -> None:
    """Torch's checkpoint around the block's forward (FSDP2's hooks stay outside it, as with
    torch's ``checkpoint_wrapper`` applied before ``fully_shard``)."""
    kwargs = {"use_reentrant": False}
    if selective:
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _sac_matmuls)
    block.forward = functools.partial(torch_checkpoint, block.forward, **kwargs)


def build(kind: str, setup: Setup, d: int, layers: int, policy: str | None = None) -> nn.Module:
    """The seeded model under ``setup``: ``kind`` "none", "torch", "torch_sac" (torch's
    selective checkpointing keeping the matmuls) or "tracedac" (``policy`` from POLICIES)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch._dynamo.reset()  # each model compiles afresh: no recompile limit carried over
    torch.manual_seed(0)
    model = Net(d, layers, count_calls=setup.compiled is None)
    world = torch.distributed.get_world_size()
    if setup.tp:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        mesh = mesh["dp"]
    else:
        mesh = init_device_mesh("cpu", (world,))
    mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if setup.mp else MixedPrecisionPolicy()

    def checkpoint(block):
        if kind == "tracedac":
            tracedac.checkpoint(block, policy=POLICIES[policy]())
        elif kind in ("torch", "torch_sac"):
            _torch(block, selective=kind == "torch_sac")

    for block in model.blocks:
        if setup.order == "before":
            checkpoint(block)
        fully_shard(block, mesh=mesh, reshard_after_forward=setup.reshard, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=setup.reshard, mp_policy=mp)
    if setup.order == "after":
        for block in model.blocks:
            checkpoint(block)
    if setup.compiled == "block":
        for block in model.blocks:
            block.compile(backend=BACKEND)
    elif setup.compiled == "model":
        model = torch.compile(model, backend=BACKEND)
    return model


def _inner(model: nn.Module) -> nn.Module:
    return getattr(model, "_orig_mod", model)  # torch.compile's wrapper, or the model


def batch(setup: Setup, d: int, rows: int = 8) -> torch.Tensor:
    """This rank's rows: its own for each data-parallel rank (the tp ranks of one dp rank share)."""
    rank = torch.distributed.get_rank()
    torch.manual_seed(100 + (rank // 2 if setup.tp else rank))
    return torch.randn(rows, d)


def _train(model: nn.Module, x: torch.Tensor) -> list[list[torch.Tensor]]:
    """Each step's full gradients, over STEPS steps of SGD."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for _ in range(STEPS):
        model(x).backward()
        grads.append([p.grad.full_tensor() for p in model.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return grads


def gradients(rank, world, setup: Setup, names=tuple(POLICIES), d: int = 32, layers: int = 2) -> None:
    """Each policy's gradients against no checkpointing, bit for bit, and each block's side
    effects once a step; torch's checkpoint counted beside (twice a step: what the counters
    would read if the region ran the block's Python again)."""
    with check(_label("gradients", setup)):
        from torch._dynamo.utils import counters

        from tracedac.region import reporting

        x = batch(setup, d)
        plain = build("none", setup, d, layers)
        want = _train(plain, x)
        out = {}
        for name in names:
            model = build("tracedac", setup, d, layers, name)
            counters.clear()
            with reporting() as eager_regions:
                got = _train(model, x)
            # eager: a recorded region per block and step; compiled: none recorded (the regions
            # were traced into the graphs), and no graph break
            if setup.compiled is None:
                assert len(eager_regions) == STEPS * layers, (name, str(setup), len(eager_regions))
            else:
                breaks = dict(counters["graph_break"])
                assert not eager_regions and not breaks and counters["stats"]["unique_graphs"], (
                    f"{name}, {setup}: {len(eager_regions)} regions ran eagerly, graph breaks {breaks}"
                )
            for step, (g, w) in enumerate(zip(got, want, strict=True)):
                bad = [i for i, (a, b) in enumerate(zip(g, w, strict=True)) if not torch.equal(a, b)]
                diff = max(float((a - b).abs().max()) for a, b in zip(g, w))
                assert not bad, f"{name}, {setup}: step {step + 1} gradients {bad} differ (max |diff| {diff})"
            out[name] = _side_effects(model)
            assert out[name] == (
                [float(STEPS)] * layers,
                [STEPS] * layers if setup.compiled is None else None,
            ), f"{name}, {setup}: each block's side effects ran {out[name]} times in {STEPS} steps"
        torch_model = build("torch", setup, d, layers)
        _train(torch_model, x)
        out["torch"] = _side_effects(torch_model)
        # the counters tell: twice a step (a Python counter only eager)
        calls = [2 * STEPS] * layers if setup.compiled is None else None
        assert out["torch"] == ([2.0 * STEPS] * layers, calls), out["torch"]


def _side_effects(model: nn.Module):
    blocks = _inner(model).blocks
    calls = [b.calls for b in blocks] if blocks[0].count_calls else None
    return [b.seen.item() for b in blocks], calls


_libc = ctypes.CDLL(None)
_libc.malloc.restype, _libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
_libc.free.argtypes = [ctypes.c_void_p]


def allocated() -> int:
    """The allocator's bytes in use, glibc's per-thread cache of small freed chunks (which
    ``mallinfo2`` counts as in use) filled first, so that it holds as much before a forward
    as after it (tests/integrations/test_hf.py's reading)."""
    chunks = [_libc.malloc(n) for n in range(8, 1040, 8) for _ in range(8)]
    for c in chunks:
        _libc.free(c)
    return allocated_bytes()


def held_after_forward(model: nn.Module, x: torch.Tensor, repeats: int = 3) -> tuple[int, int]:
    """(bytes held after the first forward, the median of ``repeats`` later ones): the
    allocator's reading after the forward, the loss alive, minus before it; a backward after
    each. Shards exist before the first reading; what FSDP2 allocates once (its all-gather
    buffers, lazily) may land in the first. The median, not the least: under load one step of
    torch's checkpoint read -8,023,248 bytes (a block's gathered parameters, alive before the
    forward, freed in it), and the least made that the bound tracedac was held to."""
    readings = []
    for _ in range(1 + repeats):
        for _ in range(10):  # until a pass finds nothing: garbage freed in stages reads as held
            if not gc.collect():
                break
        before = allocated()
        loss = model(x)
        gc.collect()
        readings.append(allocated() - before)
        loss.backward()
        for p in model.parameters():
            p.grad = None
        del loss
    return readings[0], sorted(readings[1:])[len(readings[1:]) // 2]


def unsharded_block_bytes(model: nn.Module, setup: Setup) -> int:
    """One block's parameters as this rank's forward sees them, gathered over the data-parallel
    ranks (with tensor parallel, its tp shard of them), in the compute dtype."""
    dp = torch.distributed.get_world_size() // (2 if setup.tp else 1)
    local = sum(p.to_local().numel() for p in _inner(model).blocks[0].parameters())
    return local * dp * (2 if setup.mp else 4)


def memory(rank, world, setup: Setup, names=tuple(POLICIES), d: int = 512, layers: int = 4) -> None:
    """Bytes held after forward: tracedac's recompute_all no more than torch's checkpoint,
    save_matmuls no more than torch's selective checkpointing keeping the matmuls,
    memory_budget(0.5) no more than half of what no checkpointing adds over recompute_all;
    and no region holds a block's unsharded parameters (first step included)."""
    with check(_label("memory", setup)):
        x = batch(setup, d, rows=32)
        held = {}
        # torch's selective checkpointing only beside save_matmuls (each build compiles, compiled)
        kinds = [("none", None), ("torch", None)] + ([("torch_sac", None)] if "save_matmuls" in names else [])
        for kind, name in kinds + [("tracedac", n) for n in names]:
            model = build(kind, setup, d, layers, name)
            held[name or kind] = held_after_forward(model, x)
        block = unsharded_block_bytes(model, setup)
        steady = {k: v[1] for k, v in held.items()}
        msg = f"{setup}: held after forward (first, steady) {held}; one block unsharded {block}"
        if setup.reshard:
            for key, (first, later) in held.items():
                # (a compiled model's first forward compiles: that reading holds the compiler's)
                if key != "none":
                    assert (later if setup.compiled else max(first, later)) < block / 2, (
                        f"{key} holds a block's parameters: {msg}"
                    )
        else:  # FSDP2 keeps every block gathered: the reading sees them, for every variant
            assert min(steady.values()) >= layers * block, msg
        if "recompute_all" in steady:
            assert steady["recompute_all"] <= steady["torch"] + SLACK, msg
        if "save_matmuls" in steady:
            assert steady["save_matmuls"] <= steady["torch_sac"] + SLACK, msg
        if "memory_budget(0.5)" in steady:
            floor = steady.get("recompute_all", steady["torch"])
            assert steady["memory_budget(0.5)"] <= floor + 0.5 * (steady["none"] - floor) + SLACK, msg


EAGER = [
    Setup(order=order, reshard=reshard, mp=mp)
    for order in ("before", "after")
    for reshard in (True, False)
    for mp in (False, True)
]
EAGER_MEMORY = [Setup(), Setup(order="after"), Setup(reshard=False), Setup(mp=True)]
# Each compile costs seconds on 2 cores: every policy compiled per block, the others with one.
COMPILED = {
    Setup(compiled="block"): tuple(POLICIES),
    Setup(compiled="model"): ("recompute_all",),
    Setup(compiled="block", mp=True): ("recompute_all",),
    Setup(compiled="block", reshard=False, order="after"): ("save_matmuls",),
}
COMPILED_MEMORY = {Setup(compiled="block"): tuple(POLICIES), Setup(compiled="model"): ("recompute_all",)}
TP = {Setup(tp=True): tuple(POLICIES), Setup(tp=True, compiled="block"): ("recompute_all",)}


@pytest.fixture(scope="module")
def eager():
    parts = [(gradients, s) for s in EAGER] + [(memory, s) for s in EAGER_MEMORY]
    return run_parts(2, parts, timeout=600)


@pytest.fixture(scope="module")
def compiled():
    parts = [(gradients, s, names) for s, names in COMPILED.items()]
    parts += [(memory, s, names) for s, names in COMPILED_MEMORY.items()]
    return run_parts(2, parts, timeout=600)


@pytest.fixture(scope="module")
def tensor_parallel():
    parts = [(w, s, names) for s, names in TP.items() for w in (gradients, memory)]
    return run_parts(4, parts, timeout=600)


@pytest.mark.parametrize("setup", EAGER, ids=str)
def test_regions_in_fully_shard_blocks_give_the_gradients_of_no_checkpointing_and_run_side_effects_once(
    eager, setup
):
    """Checkpoint before or after fully_shard, resharded after forward or not, fp32 or bf16
    parameters: FSDP2 gathers before the region and frees after it, so the region computes
    what the block computes; torch's checkpoint runs the block's Python twice a step."""
    eager.passed(_label("gradients", setup))


@pytest.mark.parametrize("setup", EAGER_MEMORY, ids=str)
def test_regions_hold_no_more_than_torchs_checkpoint_and_never_a_blocks_unsharded_parameters(eager, setup):
    """The region's inputs are FSDP2's gathered parameters, which FSDP2 frees after the block
    (their storage, whoever refers to them): a region keeps its activations only. Checkpointed
    after fully_shard, a region whose hooks wrapped FSDP2's recorded the all-gather and held
    the gathered buffer of every block through the first step (34 MB against 0.4 here)."""
    eager.passed(_label("memory", setup))


@pytest.mark.parametrize("setup", list(COMPILED), ids=str)
def test_compiled_regions_in_fully_shard_blocks_give_the_gradients_of_the_same_compiled_model(
    compiled, setup
):
    """torch.compile per block or of the whole model: dynamo runs FSDP2's hooks outside the
    graphs, the regions are traced into them (no region recorded eagerly, no graph break);
    the buffer update runs once a step (torch's checkpoint, compiled, applies it twice)."""
    compiled.passed(_label("gradients", setup))


@pytest.mark.parametrize("setup", list(COMPILED_MEMORY), ids=str)
def test_compiled_regions_hold_no_more_than_torchs_checkpoint_compiled(compiled, setup):
    compiled.passed(_label("memory", setup))


@pytest.mark.parametrize("setup", list(TP), ids=str)
def test_regions_in_blocks_tensor_parallel_then_fully_sharded_on_a_2d_mesh_match_no_checkpointing(
    tensor_parallel, setup
):
    """parallelize_module over tp, then fully_shard over dp, 4 ranks: the region sees DTensor
    parameters of the tp mesh and records the local ops and the tp all-reduce once."""
    tensor_parallel.passed(_label("gradients", setup), _label("memory", setup))
