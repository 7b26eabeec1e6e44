"""``torchrun --nproc-per-node 2 -m benchmarks --zero``: ZeRO-3 implementations compared.

On a GPU: ``python -m benchmarks --zero --device cuda`` (add ``--compile`` for the compiled
rows, size flags such as ``--dim 1024 --layers 8 --seq 512 --batch 8 --experts 8
--expert-hidden 2048 --heads 16`` for a model worth an H100) runs as one process, a world of
one rank on NCCL (rendezvous in a fresh temporary file). A world of one shards nothing and
sends nothing: tracedac.zero's gathers are casts and its gradients go into ``.grad`` without a
reduce-scatter, as FSDP2 (torch 2.13 at least) skips its collectives there; both all-gather
columns read "none". Under torchrun, ``--device cuda`` puts each rank on
``cuda:LOCAL_RANK`` with NCCL. Models, batches and optimizer states live on the GPU; bytes
held are ``torch.cuda.memory_allocated()`` differences (after a synchronize), each row also
gets the peak of ``torch.cuda.max_memory_allocated()`` over one step (``peak over step``:
above what was allocated when the step began; the JSON has the absolute peak too), and
every timed interval starts and ends with ``torch.cuda.synchronize()``. The JSON names the
device, torch, CUDA and Triton. Without a visible GPU ``--device cuda`` is refused. On CPU
nothing changes: gloo, at least two ranks, under torchrun.

tracedac.zero, FSDP2 and DeepSpeed ZeRO-3 (when installed), each in fp32 and bf16, plus
an unsharded replicated run as the reference, all in one run of the same processes (see
``zero_variants`` for how each is set up). Same seeded model, same optimizer, same data:
the global batch of ``make_batch`` split between ranks, each rank its own rows; for
every step a seed shared by all variants and ranks, so dropout draws alike. Figures:

- **step time**: forward + backward + optimizer step, after a ``barrier``, ended by a
  ``barrier``, so a step ends when the slowest rank ends; per step the max over ranks,
  then the median over the timed steps. One untimed step first; variants take turns in
  each round, the first turn rotating, so drift hits all alike. Ratios are to FSDP2 at
  the same precision.
- **bytes held after forward**: ``probe.allocated_bytes()`` (glibc ``mallinfo2``) after
  the forward minus before it, the loss alive, ``gc.collect()`` before each reading; the
  max over ranks. Shards exist before the first reading, so this is what the forward
  left behind: activations, plus any gathered parameters still referenced.
- **fixed part** and **full unit held?**: the same measurement on the rank's batch
  doubled (its rows twice, so every token routes alike) gives ``held(2b)``; activations
  grow with the batch and held parameters do not, so ``2 * held(b) - held(2b)`` is the
  part independent of the batch. "full unit held" is when that part is at least half of
  the smallest unit's parameters in the row's compute dtype (a held unit adds all of its
  bytes; allocator noise is kilobytes). Not for compiled rows: the doubled batch is a new
  shape, which compiles new graphs whose workspace differs, so the difference would say
  nothing (it read -10 MiB), and the recompiles took half of a ``--zero --compile`` run.
- **all-gather bytes per step, by dtype**: one more step under ``AllGatherCounter``, a
  dispatch mode that counts ``c10d``/``_c10d_functional`` all-gather ops (the gathered
  tensors' bytes), entering custom ops so that collectives inside them are seen too.
  Counted on rank 0 (all-gathers are symmetric). With two ranks or more tracedac gathers a
  unit's groups in one all-gather of bytes, each group in its own dtype (``uint8`` here, as
  FSDP2 counts when a unit's parameters differ in dtype): the split by dtype is then not
  seen from outside; the total is what the bf16 / fp32 bytes goal reads.
- **loss after N steps**: the loss of the last timed step averaged over ranks (= the
  loss of the global batch), and its difference from the replicated run's.

Memory and all-gather counts come after the timed steps, so they see steady state and do
not change the losses reported.

``--zero --compile`` runs ``COMPILED_VARIANTS`` instead: every block checkpointed (tracedac
regions; torch's checkpoint inside FSDP2's compiled forwards), tracedac.zero eager and
compiled per block with ``fullgraph=True``, FSDP2 compiled, fp32 and bf16, on the model
with fixed-capacity routing and no dropout; step ratios are to FSDP2 compiled, and each
row's first step (where it compiles) and its graph breaks are reported. The all-gather
counter runs inside compiled graphs (``ignore_compile_internals``). A last row, in
parentheses, is the compiled bf16 row with tracedac's per-collective order check switched
off: what that check costs, which FSDP2 does not pay (a measurement; no target reads it).
"""

from __future__ import annotations

import datetime
import gc
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, replace
from typing import TextIO

import torch
import torch.distributed as dist

from . import probe
from .checkpointing import QUICK
from .child import Progress, mib, target, target_lines, time_in_turns
from .collectives import AllGatherCounter
from .model import GPT, Config, make_batch
from .zero_variants import COMPILED_VARIANTS, LR, ZERO_VARIANTS, Trainer, ZeroVariant

__all__ = [
    "NOT_DISTRIBUTED",
    "NO_CUDA",
    "QUICK",
    "STEPS",
    "check_settings",
    "finish",
    "format_report",
    "init",
    "one_process_rendezvous",
    "rank_device",
    "run",
]

NOT_DISTRIBUTED = (
    "--zero compares sharded training, which needs several processes on CPU: run it as "
    "`torchrun --nproc-per-node 2 -m benchmarks --zero`. Without torchrun, start one "
    "process per rank with RANK and WORLD_SIZE in its environment and the same "
    "`--init-method file:///some/shared/path`. On a GPU, `python -m benchmarks --zero "
    "--device cuda` runs as one process (a world of one rank, NCCL)."
)
NO_CUDA = "--zero --device cuda needs a CUDA device; none is visible"
_COUNT_SEED, _MEMORY_SEED, _PEAK_SEED = 10_000, 20_000, 30_000  # steps after the timed ones
_FULL_UNIT = 0.5  # fixed part held / smallest unit at or over which a unit counts as held
# Below this the check says nothing: what the allocator holds for the autograd graph itself
# (nodes, saved-variable records) does not grow with the batch either, about 0.6 MiB for
# the default model (the replicated row's fixed part).
_MIN_UNIT_BYTES = 1 << 20
STEPS = 4  # default timed steps: bf16 matmuls are slow on CPUs without AVX512-BF16


def _device_type(device: str | torch.device) -> torch.device:
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(
            f"--device {device!r} is no device torch knows ({e}); --zero runs on cpu or cuda."
        ) from e
    if parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"--zero runs on cpu (gloo) or cuda (NCCL); got --device {device}.")
    return parsed


def _no_cuda() -> str:
    built = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "built without CUDA"
    return f"{NO_CUDA} (torch.cuda.is_available() is False; this torch {torch.__version__} is {built})."


def rank_device(device: str | torch.device, local_rank: int | None = None) -> torch.device:
    """The device this rank runs on: ``cpu``, or a CUDA device with its index: ``cuda:LOCAL_RANK``
    under torchrun (``local_rank`` given), else the index ``device`` names (0 without one).
    Raises a ValueError for another device type, no visible GPU, or an index out of range."""
    parsed = _device_type(device)
    if parsed.type == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(_no_cuda())
    index = local_rank if local_rank is not None else (parsed.index or 0)
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        where = f"LOCAL_RANK {local_rank}" if local_rank is not None else f"--device {device}"
        raise ValueError(
            f"{where} asks for CUDA device {index}, but {count} {'is' if count == 1 else 'are'} visible "
            f"(cuda:0 to cuda:{count - 1}); start at most {count} rank(s) per machine."
        )
    return torch.device("cuda", index)


def check_settings(cfg: Config, steps: int, device: str | torch.device, world: int) -> None:
    """Raise a ValueError saying what cannot run, before any process group exists. On CPU:
    gloo, two ranks or more; on CUDA: NCCL, one rank or more."""
    cfg.check()
    if steps < 1:
        raise ValueError(f"steps must be at least 1 to have a time to report, got {steps}")
    kind = _device_type(device).type
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(_no_cuda())
        if not dist.is_nccl_available():
            raise ValueError("--zero --device cuda runs on NCCL, which this build of torch lacks.")
        if world < 1:
            raise ValueError(f"WORLD_SIZE is {world}: at least one rank is needed.")
    elif world < 2:
        raise ValueError(
            f"WORLD_SIZE is {world}: ZeRO-3 with one rank shards nothing. Use --nproc-per-node 2."
        )
    if cfg.batch % world:
        raise ValueError(
            f"--batch {cfg.batch} does not split into {world} ranks' equal slices; use a multiple of {world}."
        )
    if kind == "cpu":
        probe.allocated_bytes("cpu")  # raises ProbeUnavailable where the allocator cannot be read


def _sync(device: torch.device) -> None:
    """Wait for the device's queued kernels (CUDA; nothing to wait for on CPU), so that a
    clock or memory reading sees the work before it done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rank_batch(
    cfg: Config, rank: int, world: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    per = cfg.batch // world
    return tuple(t[rank * per : (rank + 1) * per].to(device) for t in make_batch(cfg))  # [B / world, T] each


def _step(trainer: Trainer, batch, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    loss = trainer.forward(*batch)
    trainer.finish(loss)
    return loss.detach().float()


def _timed_step(trainer: Trainer, batch, seed: int, device: torch.device) -> tuple[float, torch.Tensor]:
    _sync(device)  # nothing of an earlier step still running on the GPU
    dist.barrier()  # (time_in_turns collected garbage just before)
    start = time.perf_counter()
    loss = _step(trainer, batch, seed)
    _sync(device)  # the step's kernels done, not just queued
    dist.barrier()  # the step ends when the slowest rank's does
    return time.perf_counter() - start, loss


def _held_after_forward(trainer: Trainer, batch, seed: int, device: torch.device) -> int:
    gc.collect()
    dist.barrier()
    torch.manual_seed(seed)
    before = probe.allocated_bytes(device)  # (CUDA: synchronizes, then memory_allocated)
    loss = trainer.forward(*batch)
    gc.collect()
    held = probe.allocated_bytes(device) - before
    trainer.finish(loss)
    del loss
    return held


def _peak_over_step(trainer: Trainer, batch, seed: int, device: torch.device) -> tuple[int, int]:
    """CUDA: ``max_memory_allocated`` over one step (its statistic reset just before), and that
    peak less what was allocated when the step began."""
    gc.collect()
    dist.barrier()
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    _step(trainer, batch, seed)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    return peak, peak - before


def _unit_numels(model: GPT) -> dict[str, int]:
    """Parameter elements per ZeRO unit: each block, and the rest of the model as the root."""
    blocks = {f"blocks.{i}": sum(p.numel() for p in b.parameters()) for i, b in enumerate(model.blocks)}
    return {"<root>": sum(p.numel() for p in model.parameters()) - sum(blocks.values()), **blocks}


def _build(
    variants: list[ZeroVariant], base: GPT, per_rank: int, say, device: torch.device
) -> tuple[dict, dict]:
    """Trainers that built on every rank, and why the others did not."""
    trainers, status = {}, {}
    for i, v in enumerate(variants, 1):
        missing = v.unavailable()
        if missing is None:
            try:
                trainers[v.key] = v.build(base, per_rank)
            except Exception as e:  # a library that cannot run here: report it, run the rest
                missing = f"failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
        # Every rank must agree on which variants run, or their collectives would not match.
        # (On the device: NCCL moves only CUDA tensors.)
        ok = torch.tensor([1 if missing is None else 0], device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if ok.item() == 0:
            trainers.pop(v.key, None)
            status[v.key] = missing or "failed on another rank"
            say(f"[{i}/{len(variants)}] {v.label}: skipped ({status[v.key]})")
        else:
            status[v.key] = "ok"
            say(f"[{i}/{len(variants)}] {v.label}: built")
    return trainers, status


def _first_step(trainer: Trainer, batch, seed: int, device: torch.device) -> tuple[float, int]:
    """The untimed first step (a compiled row compiles in it): its seconds and dynamo's graph
    breaks during it."""
    from torch._dynamo.utils import counters

    counters["graph_break"].clear()
    _sync(device)
    start = time.perf_counter()
    _step(trainer, batch, seed)
    _sync(device)
    return time.perf_counter() - start, sum(counters["graph_break"].values())


def _measure(
    cfg: Config, steps: int, say, variants, device: torch.device
) -> tuple[dict[str, dict], dict[str, int]]:
    """This rank's figures per variant (see module doc), and the model's parameters per unit;
    collectives in the same order on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    base = GPT.seeded(cfg).to(device)  # drawn on CPU from cfg.seed: the same weights on every device
    batch = _rank_batch(cfg, rank, world, device)
    doubled = tuple(torch.cat([t, t]) for t in batch)  # [2B / world, T]: the same tokens twice
    trainers, status = _build(list(variants), base, cfg.batch // world, say, device)
    found = {key: {"status": s} for key, s in status.items()}
    say(f"timing: one untimed step per variant (compiles), then {steps} timed")
    for key, trainer in trainers.items():
        first_s, breaks = _first_step(trainer, batch, cfg.seed, device)
        found[key].update(first_step_s=first_s, graph_breaks=breaks)
    # The libraries imported by now (dynamo, DeepSpeed) leave millions of objects; frozen,
    # the gc.collect() before every step and memory reading skips them (0.5 s -> ms).
    gc.collect()
    gc.freeze()
    losses: dict[str, float] = {}

    def timed_step(key, rep):
        seconds, loss = _timed_step(trainers[key], batch, cfg.seed + 1 + rep, device)
        losses[key] = float(loss)
        return seconds

    times = time_in_turns(trainers, steps, timed_step, say)
    cuda = device.type == "cuda"
    say(
        "all-gather bytes, then bytes held after forward at the rank's batch and (eager rows) at twice it"
        + (", then the peak allocated over a step" if cuda else "")
    )
    compiled = {v.key for v in variants if v.compiled}
    for key, trainer in trainers.items():
        with AllGatherCounter() as counter:
            _step(trainer, batch, cfg.seed + _COUNT_SEED)
        held = _held_after_forward(trainer, batch, cfg.seed + _MEMORY_SEED, device)
        held_doubled = (
            None
            if key in compiled
            else _held_after_forward(trainer, doubled, cfg.seed + _MEMORY_SEED, device)
        )
        peak, peak_step = (
            _peak_over_step(trainer, batch, cfg.seed + _PEAK_SEED, device) if cuda else (None, None)
        )
        found[key].update(
            step_times_s=times[key],
            loss=losses[key],
            all_gather_bytes=dict(counter.bytes),
            all_gather_bytes_total=counter.total(),
            all_gather_calls=counter.calls,
            bytes_held=held,
            bytes_held_doubled=held_doubled,
            peak_bytes=peak,
            peak_step_bytes=peak_step,
        )
    return found, _unit_numels(base)


def _combine(per_rank: list[dict[str, dict]]) -> dict[str, dict]:
    """Every rank's figures into one: times and bytes held at their max over ranks, losses
    averaged (each rank's loss is the mean over an equal share of the batch), all-gathers
    from rank 0."""
    out = {}
    for key, first in per_rank[0].items():
        row = dict(first)
        if first["status"] == "ok":
            rows = [r[key] for r in per_rank]
            row["step_times_s"] = [max(ts) for ts in zip(*(r["step_times_s"] for r in rows))]
            row["loss"] = statistics.fmean(r["loss"] for r in rows)
            for field in ("bytes_held", "graph_breaks", "first_step_s"):
                row[field] = max(r[field] for r in rows)
            for field in ("peak_bytes", "peak_step_bytes"):  # (CUDA only)
                values = [r.get(field) for r in rows]
                row[field] = None if None in values else max(values)
            doubled = [r["bytes_held_doubled"] for r in rows]
            row["bytes_held_doubled"] = None if None in doubled else max(doubled)
            row["bytes_fixed"] = (
                None if None in doubled else max(2 * r["bytes_held"] - d for r, d in zip(rows, doubled))
            )
        out[key] = row
    return out


def _rows(found: dict[str, dict], units: dict[str, int], variants) -> list[dict]:
    smallest = min(units.values())
    reference = found.get("replicated", {}).get("loss")
    step = {k: statistics.median(r["step_times_s"]) for k, r in found.items() if r["status"] == "ok"}
    rows = []
    for v in variants:
        row = {"key": v.key, "label": v.label, "library": v.library, "precision": v.precision, **found[v.key]}
        if row["status"] == "ok":
            baseline = step.get(f"{v.baseline}_{v.precision}")
            row["step_s"] = step[v.key]
            row["step_vs_fsdp2"] = None if baseline is None else step[v.key] / baseline
            unit = row["smallest_unit_bytes"] = smallest * (2 if v.bf16 else 4)
            fixed = row["bytes_fixed"]
            row["full_unit_held"] = (
                None if unit < _MIN_UNIT_BYTES or fixed is None else fixed >= _FULL_UNIT * unit
            )
            row["loss_diff"] = None if reference is None else abs(row["loss"] - reference)
        rows.append(row)
    return rows


def _compiled_targets(rows: list[dict]) -> list[dict]:
    """``--zero --compile``'s targets (issue 13)."""
    by = {r["key"]: r for r in rows if r["status"] == "ok"}

    def get(key, field):
        return by[key].get(field) if key in by else None

    def ratio(a, b, field):
        x, y = get(a, field), get(b, field)
        return None if x is None or not y else x / y

    breaks = [get(k, "graph_breaks") for k in ("tracedacc_fp32", "tracedacc_bf16")]
    return [
        target(
            "graph breaks, tracedac.zero compiled (checkpointed MoE)",
            None if None in breaks else float(max(breaks)),
            0,
            "",
        ),
        target(
            "tracedac.zero compiled fp32 step / FSDP2 compiled fp32",
            get("tracedacc_fp32", "step_vs_fsdp2"),
            1.00,
        ),
        target(
            "tracedac.zero compiled bf16 auto step / FSDP2 compiled bf16, same autocast",
            get("tracedacc_bf16", "step_vs_fsdp2"),
            1.00,
        ),
        target(
            "tracedac.zero compiled fp32 step / eager",
            ratio("tracedacc_fp32", "tracedac_fp32", "step_s"),
            0.90,
        ),
        target(
            "tracedac.zero compiled bf16 step / eager",
            ratio("tracedacc_bf16", "tracedac_bf16", "step_s"),
            0.90,
        ),
        target(
            "tracedac.zero compiled all-gather bytes, bf16 auto / fp32",
            ratio("tracedacc_bf16", "tracedacc_fp32", "all_gather_bytes_total"),
            0.55,
        ),
    ]


def _targets(rows: list[dict]) -> list[dict]:
    by = {r["key"]: r for r in rows if r["status"] == "ok"}

    def get(key, field):
        return by[key].get(field) if key in by else None

    fp32, bf16 = (
        get("tracedac_fp32", "all_gather_bytes_total"),
        get("tracedac_bf16", "all_gather_bytes_total"),
    )
    auto = get("tracedac_auto", "all_gather_bytes_total")
    targets = [
        target("tracedac.zero fp32 step time / FSDP2 fp32", get("tracedac_fp32", "step_vs_fsdp2"), 1.00),
        target("tracedac.zero bf16 step time / FSDP2 bf16", get("tracedac_bf16", "step_vs_fsdp2"), 1.00),
        target(
            "tracedac.zero all-gather bytes, bf16 / fp32", None if not (fp32 and bf16) else bf16 / fp32, 0.55
        ),
        target(
            "tracedac.zero all-gather bytes, bf16 auto / fp32",
            None if not (fp32 and auto) else auto / fp32,
            0.55,
        ),
    ]
    for key in ("tracedac_fp32", "tracedac_bf16"):
        fixed, unit, held = (
            get(key, "bytes_fixed"),
            get(key, "smallest_unit_bytes"),
            get(key, "full_unit_held"),
        )
        fixed_part = target(
            f"{by[key]['label'] if key in by else key}: fixed part held after forward / "
            "smallest unit (no full unit held)",
            None if unit is None else fixed / unit,
            _FULL_UNIT,
        )
        # the row's verdict; None where units are too small to tell from the graph's own bookkeeping
        fixed_part["passed"] = None if held is None else not held
        targets.append(fixed_part)
    return targets


def run(
    cfg: Config = Config(),
    *,
    steps: int = STEPS,
    quick: bool = False,
    progress: TextIO | None = sys.stderr,
    system_malloc: bool = False,
    compile: bool = False,
    device: str | torch.device = "cpu",
) -> dict:
    """Run the comparison on the initialized default process group; every rank gets the figures.

    ``device``: where this rank's models, batches and optimizer states live: ``cpu`` (gloo),
    or this rank's CUDA device (NCCL; ``rank_device`` picks it, ``init`` starts the group).

    ``quick`` swaps in ``checkpointing.QUICK`` (a tiny model) and at most two timed steps.
    ``compile``: the compiled rows (``COMPILED_VARIANTS``) on the model with fixed-capacity
    routing (``compiled.CAPACITY``: one graph per block needs static shapes) and no dropout.
    Only rank 0 writes progress lines to ``progress``.
    """
    if quick:
        cfg, steps = QUICK, min(steps, 2)
    variants = ZERO_VARIANTS
    if compile:
        from .compiled import CAPACITY

        # dropout off: a compiled graph draws other random numbers than eager, and the loss
        # column compares every row with the eager replicated run
        cfg, variants = replace(cfg, capacity=cfg.capacity or CAPACITY, dropout=0.0), COMPILED_VARIANTS
        from torch import _dynamo  # (``import torch._dynamo`` would make ``torch`` local here)

        # Each compiled block instance is a cache entry of one code object (Module._call_impl),
        # per variant and per batch shape (the memory reading doubles the batch): more than
        # dynamo's default of 8, which fullgraph=True turns into an error.
        _dynamo.config.recompile_limit = max(_dynamo.config.recompile_limit, 64)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    check_settings(cfg, steps, device, world)
    say = Progress(progress if rank == 0 else None)
    start = time.perf_counter()
    load = os.getloadavg()[0]
    # CPU: glibc keeps freed memory, as torch's caching allocator does on CUDA (probe.py)
    steady = device.type == "cpu" and not system_malloc and probe.keep_freed_memory()
    try:
        found, units = _measure(cfg, steps, say, variants, device)
    finally:
        gc.unfreeze()
    everyone = [None] * world
    dist.all_gather_object(everyone, found)
    rows = _rows(_combine(everyone), units, variants)
    wall = time.perf_counter() - start
    say(f"finished in {wall:.1f}s")
    cuda = device.type == "cuda"
    if cuda:
        allocator = "torch's CUDA caching allocator"
    else:
        allocator = "glibc keeping freed memory (mallopt)" if steady else "default"
    return {
        "config": asdict(cfg),
        "steps": steps,
        "world_size": world,
        "threads_per_rank": torch.get_num_threads(),
        "optimizer": f"AdamW(lr={LR})",
        "torch": torch.__version__,
        "triton": _version("triton"),
        "deepspeed": _version("deepspeed"),
        "backend": str(dist.get_backend()),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if cuda else "CPU",
        "cuda": torch.version.cuda if cuda else None,
        "device_memory_bytes": torch.cuda.get_device_properties(device).total_memory if cuda else None,
        "probe": probe.describe(device),
        "timing_allocator": allocator,
        "units": units,
        "compiled": compile,
        "variants": rows,
        "targets": _compiled_targets(rows) if compile else _targets(rows),
        "wall_s": wall,
        "load_average_before": load,
        "cpus": os.cpu_count(),
    }


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:  # not installed, or installed without metadata
        return None


def one_process_rendezvous() -> str:
    """A ``file://`` rendezvous in a fresh, empty temporary file, for a world of one process
    (``leave_ranks`` removes it after a finished run)."""
    fd, path = tempfile.mkstemp(prefix="tracedac-zero-", suffix=".rendezvous")
    os.close(fd)
    return f"file://{path}"


def init(
    init_method: str,
    timeout_s: float = 600.0,
    *,
    device: str | torch.device = "cpu",
    rank: int | None = None,
    world: int | None = None,
) -> int:
    """Start the process group ``run`` works in: gloo on CPU, NCCL on CUDA (this rank's
    ``device`` made current and bound to the group). Rank and world size from the
    environment (torchrun sets them) unless given (a world of one: ``rank=0, world=1``);
    returns this process's rank. ``timeout_s`` bounds every collective, so a rank that dies
    makes the others fail instead of waiting forever."""
    rank = int(os.environ["RANK"]) if rank is None else rank
    world = int(os.environ["WORLD_SIZE"]) if world is None else world
    device = torch.device(device)
    bound = {}
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)  # object collectives and DeviceMesh use the current device
        backend, bound = "nccl", {"device_id": device}
    else:
        backend = "gloo"
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
        **bound,
    )
    return rank


def finish() -> None:
    """End the process group ``init`` started, after a failed run (a finished one ends with
    ``child.leave_ranks``). The barrier first: gloo's barrier completes only after every
    collective this rank started on the group (a prefetched all-gather nobody consumed)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# --- text ----------------------------------------------------------------------------------


def _gathered(row: dict) -> str:
    parts = [f"{dtype} {mib(n)}" for dtype, n in sorted(row["all_gather_bytes"].items())]
    return " + ".join(parts) if parts else "none"


def _row_cells(row: dict, peak: bool) -> list[str]:
    cells = [
        row["label"],
        str(row["graph_breaks"]),
        f"{row['first_step_s']:.1f} s",
        f"{row['step_s'] * 1e3:.0f} ms",
        "-" if row["step_vs_fsdp2"] is None else f"{row['step_vs_fsdp2']:.2f}x",
        mib(row["bytes_held"]),
        "-" if row["bytes_fixed"] is None else mib(row["bytes_fixed"]),
        {None: "n/a", True: "yes", False: "no"}[row["full_unit_held"]],
        _gathered(row),
        f"{row['loss']:.4f}",
        "-" if row["loss_diff"] is None else f"{row['loss_diff']:.1e}",
    ]
    if peak:  # (CUDA) after "full unit held?"
        cells.insert(8, "-" if row.get("peak_step_bytes") is None else mib(row["peak_step_bytes"]))
    return cells


def format_report(result: dict) -> str:
    """The figures of ``run`` as a table and the targets with marks."""
    cfg = result["config"]
    header = [
        "variant",
        "graph breaks",
        "first step",
        "step (median)",
        "vs FSDP2 compiled" if result.get("compiled") else "vs FSDP2",
        "held after fwd",
        "of it fixed",
        "full unit held?",
        "all-gather / step",
        f"loss after {result['steps']}",
        "|loss - replicated|",
    ]
    peak = any(r.get("peak_step_bytes") is not None for r in result["variants"])
    if peak:
        header.insert(8, "peak over step")
    left = (0, header.index("all-gather / step"))
    cells = {r["key"]: _row_cells(r, peak) for r in result["variants"] if r["status"] == "ok"}
    widths = [max(len(c[i]) for c in [header, *cells.values()]) for i in range(len(header))]
    widths[0] = max([widths[0]] + [len(r["label"]) for r in result["variants"]])

    def line(c: list[str]) -> str:
        return "  ".join(
            x.ljust(w) if i in left else x.rjust(w) for i, (x, w) in enumerate(zip(c, widths))
        ).rstrip()

    def row_line(row: dict) -> str:
        if row["status"] != "ok":  # says why across the row: its message sets no column's width
            return f"{row['label'].ljust(widths[0])}  {row['status']}"
        return line(cells[row["key"]])

    units = result["units"]
    smallest = min(units.values())
    world = result["world_size"]
    backend, device_name = result.get("backend", "gloo"), result.get("device_name", "CPU")
    versions = "".join(f", {name} {result[name]}" for name in ("cuda", "triton") if result.get(name))
    peak_note = (
        "; peak over step = torch.cuda.max_memory_allocated() during one step less what was "
        "allocated when it began"
        if peak
        else ""
    )
    out = [
        f"model: {cfg['layers']} blocks, dim {cfg['dim']}, {cfg['heads']} heads, "
        f"{cfg['experts']} experts (top {cfg['top_k']}, width {cfg['expert_hidden']}), "
        f"global batch {cfg['batch']}x{cfg['seq']} tokens "
        f"({cfg['batch'] // result['world_size']} per rank), vocab {cfg['vocab']}, dropout {cfg['dropout']}",
        f"{world} rank{'s' if world != 1 else ''} ({backend}, {device_name}), "
        f"{result['threads_per_rank']} threads each, torch {result['torch']}"
        f"{versions if device_name != 'CPU' else ''}"
        f"{', deepspeed ' + result['deepspeed'] if result['deepspeed'] else ''}; {result['optimizer']}; "
        f"{result['steps']} timed steps per variant; timing allocator: {result['timing_allocator']}",
        f"units: root {units['<root>']:,} parameters, each block {units.get('blocks.0', 0):,}; "
        f"full unit held? = fixed part >= {_FULL_UNIT} x smallest unit ({smallest:,} parameters: "
        f"{mib(4 * smallest)} fp32, {mib(2 * smallest)} bf16; n/a under {mib(_MIN_UNIT_BYTES)}); "
        f"memory: {result['probe']}, max over ranks{peak_note}",
        "",
        line(header),
        line(["-" * w for w in widths]),
        *(row_line(r) for r in result["variants"]),
        "",
    ]
    out += target_lines(result)
    return "\n".join(out)
