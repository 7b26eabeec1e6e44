"""``python -m benchmarks --fsdp2``: tracedac regions inside FSDP2 beside torch's checkpoint.

The benchmark's GPT (``model.py``: MoE feed-forward whose router counts its tokens, dropout)
sharded as FSDP2's users shard it: ``fully_shard`` on each block, then on the model, on a
1-D mesh of ``--ranks`` gloo ranks (2 by default) this command starts (one thread each, a
file rendezvous in a temporary directory); with ``--device cuda``, NCCL ranks, each on its own
GPU (one rank by default: FSDP2 then gathers nothing, but its hooks, its parameters and the
checkpoints inside are a real FSDP2 step's). Each rank takes its rows of the batch. Every block
is checkpointed before ``fully_shard``, so FSDP2's all-gather and free stay outside it:

- no checkpoint;
- ``torch.utils.checkpoint`` (``use_reentrant=False``) around each block's forward (as torch's
  ``checkpoint_wrapper`` applied before ``fully_shard`` has it), and torch's selective
  checkpointing keeping the matmuls (``tracedac.policies.MATMUL_OPS``);
- ``tracedac.checkpoint(block, policy=...)``: ``recompute_all`` (against torch's checkpoint),
  ``save_matmuls`` (against torch's selective) and ``memory_budget(0.5)``.

Figures, each measured from outside the library, all variants in the same run:

- **bytes held after forward**: on CUDA ``torch.cuda.memory_allocated`` after the forward minus
  before it (synchronized). On the CPU ``probe.allocated_bytes()`` (glibc ``mallinfo2``) after the
  forward minus before it, the loss alive, ``gc.collect()`` first, the least of three
  forwards; in ranks started with ``PYTHONMALLOC=malloc`` and glibc's per-thread cache off
  (``child.run_child``'s set-up), so Python objects count beside tensors (a recorded graph's
  nodes, a checkpoint's closures). The max over ranks. The header gives one block's unsharded
  parameters (what FSDP2 gathers for a block): a region that kept them alive would hold that
  much over the torch row doing the same job, whose checkpoint FSDP2's free reaches too.
- **step time**: forward + backward (FSDP2's reduce-scatters included) between two barriers,
  the median over the timed steps after an untimed one; variants take turns. In ranks
  started again with CPython's own allocator, glibc keeping freed memory (``probe``); with
  ``--quick``, in the checks' ranks.
- **max |grad difference|**: every parameter's full gradient (``full_tensor()``) after one
  step, against no checkpoint, the max over ranks.
- **router counts / routed**: the tokens the routers counted in one step over the tokens
  they routed: 1 when each block's Python ran once.

Ratios to torch are printed for each tracedac row (to the torch row doing the same job).
"""

from __future__ import annotations

import functools
import gc
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import TextIO

import torch
import torch.distributed as dist
from torch.utils import checkpoint as torch_checkpoint
from torch.utils.checkpoint import CheckpointPolicy

import tracedac
from tracedac.policies import MATMUL_OPS

from . import probe
from .child import Progress, clear_grads, mib, table, target, target_lines, time_in_turns
from .model import GPT, Config, make_batch
from .ranks import launch, serve

__all__ = ["QUICK", "RANKS", "STEPS", "VARIANTS", "check_settings", "format_report", "run"]

QUICK = Config(vocab=256, layers=2, dim=64, heads=2, experts=4, top_k=2, expert_hidden=128, batch=4, seq=32)
RANKS = 2
STEPS = 6  # default timed steps per variant
TIMEOUT_S = 900.0  # one launch of the ranks, at most; also every collective's timeout
_SEED = 1000  # the step whose gradients, counts and bytes are measured


def _sac_matmuls(ctx, func, *args, **kwargs):
    keep = func.overloadpacket in MATMUL_OPS
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def _torch(selective: bool):
    def apply(block):
        kwargs = {"use_reentrant": False}
        if selective:
            kwargs["context_fn"] = functools.partial(
                torch_checkpoint.create_selective_checkpoint_contexts, _sac_matmuls
            )
        block.forward = functools.partial(torch_checkpoint.checkpoint, block.forward, **kwargs)

    return apply


def _tracedac(policy):
    return lambda block: tracedac.checkpoint(block, policy=policy)


@dataclass(frozen=True)
class Variant:
    key: str
    label: str
    apply: object  # block -> None (checkpoints it in place), or None
    versus: str | None = None  # the torch row doing the same job, for the ratios


VARIANTS: tuple[Variant, ...] = (
    Variant("none", "FSDP2, no checkpoint", None),
    Variant("torch", "FSDP2 + torch.utils.checkpoint", _torch(False)),
    Variant("torch_sac", "FSDP2 + torch selective (matmuls)", _torch(True)),
    Variant(
        "tracedac_recompute_all",
        "FSDP2 + tracedac recompute_all",
        _tracedac(tracedac.policies.recompute_all()),
        "torch",
    ),
    Variant(
        "tracedac_save_matmuls",
        "FSDP2 + tracedac save_matmuls",
        _tracedac(tracedac.policies.save_matmuls()),
        "torch_sac",
    ),
    Variant(
        "tracedac_budget",
        "FSDP2 + tracedac memory_budget(0.5)",
        _tracedac(tracedac.policies.memory_budget(0.5)),
        "torch",
    ),
)


# --- in each rank ---------------------------------------------------------------------------


def _device() -> torch.device:
    """This rank's device: its GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _allocated() -> int:
    """Bytes in use on this rank's device, read from outside tracedac (see the module's notes)."""
    device = _device()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device)
    return probe.allocated_bytes()


def _build(cfg: Config, variant: Variant) -> GPT:
    """The seeded model: each block checkpointed by ``variant``, then ``fully_shard``-ed; then the model."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = _device()
    model = GPT.seeded(cfg).to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.blocks:
        if variant.apply is not None:
            variant.apply(block)
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _rank_batch(cfg: Config, rank: int, world: int):
    idx, targets = make_batch(cfg)
    per = cfg.batch // world
    return tuple(t[rank * per : (rank + 1) * per].to(_device()) for t in (idx, targets))


def _held_after_forward(model: GPT, batch, seed: int, repeats: int = 3) -> int:
    """The least of ``repeats`` readings (a first-use allocation lands in one reading only)."""
    readings = []
    for _ in range(repeats):
        clear_grads(model)
        torch.manual_seed(seed)
        gc.collect()
        dist.barrier()
        before = _allocated()
        loss = model(*batch)
        gc.collect()
        readings.append(_allocated() - before)
        loss.backward()
        del loss
    clear_grads(model)
    return min(readings)


def _checks(cfg: Config, rank: int, world: int, say) -> dict[str, dict]:
    batch = _rank_batch(cfg, rank, world)
    found, reference = {}, None
    for i, v in enumerate(VARIANTS, 1):
        say(f"[{i}/{len(VARIANTS)}] {v.label}: gradients, router counts, bytes held")
        model = _build(cfg, v)
        for r in model.routers():
            r.tokens_per_expert.zero_()
        torch.manual_seed(cfg.seed + _SEED)
        model(*batch).backward()
        counted = sum(int(r.tokens_per_expert.sum()) for r in model.routers())
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        clear_grads(model)
        if reference is None:
            reference = grads  # no checkpoint: the first variant
        # one block's parameters as FSDP2 gathers them for its forward (its shard, times the ranks)
        block = sum(p.to_local().numel() * p.element_size() for p in model.blocks[0].parameters()) * world
        found[v.key] = {
            "max_grad_diff": max(float((grads[n] - reference[n]).abs().max()) for n in reference),
            "router_counts_per_routed": counted / (cfg.layers * batch[0].numel() * cfg.top_k),
            "bytes_held": _held_after_forward(model, batch, cfg.seed + _SEED),
            "block_bytes": block,
        }
    return found


def _timing(cfg: Config, rank: int, world: int, steps: int, say) -> dict[str, list[float]]:
    batch = _rank_batch(cfg, rank, world)
    models = {v.key: _build(cfg, v) for v in VARIANTS}

    def step(key, seed):
        model = models[key]
        dist.barrier()
        _allocated()  # (on CUDA: synchronized, so the step starts with the device idle)
        start = time.perf_counter()
        torch.manual_seed(seed)
        model(*batch).backward()
        _allocated()
        dist.barrier()  # the step ends when the slowest rank's does
        seconds = time.perf_counter() - start
        clear_grads(model)
        return seconds

    say(f"timing: one untimed step per variant, then {steps} timed")
    for key in models:
        step(key, cfg.seed)
    return time_in_turns(models, steps, lambda key, rep: step(key, cfg.seed + 1 + rep), say)


def rank_main(spec_json: str) -> None:
    """A rank's entry point (``ranks.launch`` starts it, ``ranks.serve`` runs the phases the
    spec names: "checks", "timing" or both; rank 0 prints every rank's figures as JSON)."""
    serve(spec_json, Config, _checks, _timing, TIMEOUT_S)


# --- in the launching process ---------------------------------------------------------------


def check_settings(cfg: Config, steps: int, world: int, device: str = "cpu") -> None:
    """Raise a ValueError (or ProbeUnavailable) saying what cannot run, before any rank starts."""
    cfg.check()
    if steps < 1:
        raise ValueError(f"steps must be at least 1 to have a time to report, got {steps}")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is visible here; run --fsdp2 on the CPU")
        if not 1 <= world <= torch.cuda.device_count():
            raise ValueError(
                f"--ranks {world} on CUDA needs a GPU per rank, and {torch.cuda.device_count()} are visible"
            )
    elif world < 2:
        raise ValueError(f"--ranks must be at least 2 for FSDP2 to shard anything, got {world}")
    if cfg.batch % world:
        raise ValueError(
            f"{cfg.batch} sequences (--batch) do not split into {world} ranks' equal shares; "
            f"use a multiple of {world}."
        )
    if not device.startswith("cuda"):
        probe.allocated_bytes("cpu")  # raises ProbeUnavailable where the allocator cannot be read


def _rows(checks: list[dict], times: list[dict]) -> list[dict]:
    rows = []
    for v in VARIANTS:
        mine = [c[v.key] for c in checks]
        step_times = [max(ts) for ts in zip(*(t[v.key] for t in times))]
        held = max(c["bytes_held"] for c in mine)
        rows.append(
            {
                "key": v.key,
                "label": v.label,
                "versus": v.versus,
                "bytes_held_per_rank": [c["bytes_held"] for c in mine],
                "bytes_held": held,
                "block_bytes": mine[0]["block_bytes"],
                "max_grad_diff": max(c["max_grad_diff"] for c in mine),
                "router_counts_per_routed": max(c["router_counts_per_routed"] for c in mine),
                "step_times_s": step_times,
                "step_s": statistics.median(step_times),
            }
        )
    by = {r["key"]: r for r in rows}
    for row in rows:
        other = by.get(row["versus"])
        row["held_vs_torch"] = None if other is None else row["bytes_held"] / other["bytes_held"]
        row["step_vs_torch"] = None if other is None else row["step_s"] / other["step_s"]
        row["step_vs_none"] = row["step_s"] / by["none"]["step_s"]
    return rows


def _targets(rows: list[dict]) -> list[dict]:
    by = {r["key"]: r for r in rows}
    return [
        target(
            "FSDP2 + tracedac recompute_all bytes held / FSDP2 + torch checkpoint",
            by["tracedac_recompute_all"]["held_vs_torch"],
            1.00,
        ),
        target(
            "FSDP2 + tracedac save_matmuls bytes held / FSDP2 + torch selective (matmuls)",
            by["tracedac_save_matmuls"]["held_vs_torch"],
            1.00,
        ),
        target(
            "FSDP2 + tracedac recompute_all step time / FSDP2 + torch checkpoint",
            by["tracedac_recompute_all"]["step_vs_torch"],
            1.00,
        ),
    ]


def run(
    cfg: Config = Config(),
    *,
    world: int = RANKS,
    steps: int = STEPS,
    quick: bool = False,
    progress: TextIO | None = sys.stderr,
    device: str = "cpu",
) -> dict:
    """Start the ranks twice (checks with Python objects counted, then timing) and return every
    figure. ``quick``: ``QUICK``, at most two timed steps, the ranks started once."""
    if quick:
        cfg, steps = QUICK, min(steps, 2)
    check_settings(cfg, steps, world, device)
    say = Progress(progress)
    start = time.perf_counter()
    load = os.getloadavg()[0]
    spec = {"config": asdict(cfg), "steps": steps, "device": device}
    go = functools.partial(
        launch, "benchmarks.fsdp2", world=world, say=say, what="--fsdp2", timeout=TIMEOUT_S
    )
    say(f"{world} ranks: gradients, router counts and bytes held (PYTHONMALLOC=malloc)")
    if quick:
        found = go(dict(spec, phases=["checks", "timing"]), count_python=True)
        checks, times = [f["checks"] for f in found], [f["timing"] for f in found]
    else:
        checks = [f["checks"] for f in go(dict(spec, phases=["checks"]), count_python=True)]
        say(f"{world} ranks: step times")
        times = [f["timing"] for f in go(dict(spec, phases=["timing"]), count_python=False)]
    rows = _rows(checks, times)
    wall = time.perf_counter() - start
    say(f"finished in {wall:.1f}s")
    return {
        "config": asdict(cfg),
        "world_size": world,
        "steps": steps,
        "threads_per_rank": 1,
        "torch": torch.__version__,
        "device": device if device == "cpu" else f"{device} ({torch.cuda.get_device_name()})",
        "probe": (
            "torch.cuda.memory_allocated, max over ranks"
            if device.startswith("cuda")
            else f"{probe.describe('cpu')}, ranks run with PYTHONMALLOC=malloc, max over ranks"
        ),
        "timing_allocator": (
            "PYTHONMALLOC=malloc (--quick: timed in the checks' ranks)"
            if quick
            else "CPython's, glibc keeping freed memory (mallopt)"
        ),
        "variants": rows,
        "targets": _targets(rows),
        "wall_s": wall,
        "load_average_before": load,
        "cpus": os.cpu_count(),
    }


def _where(result: dict) -> str:
    device = result.get("device", "cpu")
    return "gloo, CPU" if device == "cpu" else f"NCCL, {device}"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _row_cells(row: dict) -> list[str]:
    return [
        row["label"],
        mib(row["bytes_held"]),
        _ratio(row["held_vs_torch"]),
        f"{row['step_s'] * 1e3:.0f} ms",
        _ratio(row["step_vs_torch"]),
        f"{row['step_vs_none']:.2f}x",
        f"{row['router_counts_per_routed']:.2f}",
        f"{row['max_grad_diff']:.1e}",
    ]


def format_report(result: dict) -> str:
    """The figures of ``run`` as a table and the goals with marks."""
    cfg = result["config"]
    header = [
        "variant",
        "held after fwd",
        "held vs torch",
        "step (median)",
        "step vs torch",
        "vs none",
        "router counts",
        "max |grad diff|",
    ]
    out = [
        f"model: GPT, {cfg['layers']} blocks (attention + MoE, {cfg['experts']} experts top "
        f"{cfg['top_k']}), dim {cfg['dim']}, {cfg['batch']} x {cfg['seq']} tokens split over the ranks; "
        "fully_shard per block then the model, each block checkpointed before fully_shard",
        f"{result['world_size']} ranks ({_where(result)}), {result['threads_per_rank']} CPU thread each, "
        f"torch {result['torch']}; {result['steps']} timed steps per variant (forward + backward); memory: "
        f"{result['probe']}; timing allocator: {result['timing_allocator']}",
        f"one block's unsharded parameters: {mib(result['variants'][0]['block_bytes'])} (a region keeping "
        "them alive would hold that much more than its torch row); 'vs torch': to the torch row doing the "
        "same job (recompute_all and the budget: torch.utils.checkpoint; save_matmuls: torch selective); "
        "'router counts': tokens counted / tokens routed in one step",
        "",
        *table(header, [_row_cells(r) for r in result["variants"]]),
        "",
    ]
    out += target_lines(result)
    return "\n".join(out)
