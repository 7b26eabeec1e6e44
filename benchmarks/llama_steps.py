"""``python -m benchmarks --llama``: step time of a Llama-style decoder, each layer checkpointed.

The issue's GPU comparison as a command: ``llama.Llama`` (RMSNorm, rotary embeddings, SDPA,
SwiGLU, no dropout) with every ``DecoderLayer`` checkpointed by each variant below, one
seeded copy of the weights per variant, one batch. On CUDA the default size is the issue's
(dim 2048, 16 heads, FFN 5632, 8 layers, 4 x 2048 tokens, bf16); on CPU a small one (fp32).
Per variant:

- **step ms**: median wall time of forward + backward (gradients set to None before
  each step; no optimizer) over the timed steps, after warm-up steps (three: torch.compile
  compiles in the first, compiled replay on a structure's second sight). Variants take
  turns, as in the main benchmark.
- **peak over weights**: on CUDA, ``torch.cuda.max_memory_allocated`` during a step minus
  what was allocated before it (weights and batch); on CPU the peak of tensor bytes over the
  step, from the profiler's allocation events (``_cpu_memory``).
- **max |grad difference|** from the no-checkpoint run of the first step.
- **held after forward**: what one forward leaves allocated while its loss is alive (what
  backward reads): offloaded tensors count 0 once their copy has left (on CPU, tensor bytes,
  from the same events).
- **first step s**: the first warm-up step, where a compiled variant compiles.

The variants. Eager: no checkpoint; ``torch.utils.checkpoint``; torch's selective checkpoint
keeping matmuls and attention; tracedac ``recompute_all``, ``save_matmuls`` and
``memory_budget(0.5)``, each also with compiled replay (``tracedac.compiled_replay``: on
during that variant's steps only; its default exact fusion, and for ``recompute_all`` and
``save_matmuls`` also ``fusion="all"``, within rounding: the ``_all`` rows). Offload: torch's
``save_on_cpu`` (every saved tensor to pinned host memory), torch's selective checkpoint
offloading matmuls and attention (``MUST_CPU_OFFLOAD``, where torch has it), tracedac
``offload_ops(matmuls)``, ``offload_kept(save_all())`` (everything the region keeps,
offloaded) and ``memory_budget`` at 0.5 and 0.2 with and without ``offload=True``. Compiled,
each layer its own graph (``fullgraph=True``, as torchtitan compiles): torch's checkpoint, its
selective checkpoint, no checkpoint under ``activation_memory_budget=0.5``, and tracedac
``recompute_all``, ``save_matmuls`` and ``memory_budget(0.5)`` regions; and ``torch.compile``
over the whole model with torch's checkpoint. The goals printed at the end are issue 32's
(eager and compiled) and issue 30's (offload).
"""

from __future__ import annotations

import copy
import gc
import statistics
import sys
import time
from dataclasses import asdict
from typing import Callable, TextIO

import torch
import torch._functorch.config as functorch_config
from torch import nn

import tracedac

from .child import GOALS, Progress, goal_line, table, target, time_in_turns
from .llama import Llama, LlamaConfig, make_batch
from .llama_variants import BUDGET, VARIANTS

__all__ = ["CPU", "CUDA", "QUICK", "VARIANTS", "format_report", "run"]

CUDA = LlamaConfig(vocab=32000, layers=8, dim=2048, heads=16, mlp_hidden=5632, batch=4, seq=2048)
CPU = LlamaConfig(vocab=1024, layers=4, dim=256, heads=4, mlp_hidden=704, batch=4, seq=128)
QUICK = LlamaConfig(vocab=64, layers=2, dim=32, heads=2, mlp_hidden=64, batch=2, seq=16)
# A 7B-class layer shape (Llama 2 7B's width, heads and MLP), 4 layers, 8 x 2048 tokens: the
# forward's device time per op that a host-bound recorder must hide behind (``--llama-shape 7b``)
LAYER_7B = LlamaConfig(vocab=32000, layers=4, dim=4096, heads=32, mlp_hidden=11008, batch=8, seq=2048)
SHAPES = {"7b": LAYER_7B}
WARMUP = 3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(
    cfg: LlamaConfig | None = None,
    *,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    steps: int = 5,
    variants: tuple[str, ...] | None = None,
    progress: TextIO | None = sys.stderr,
) -> dict:
    """Time every variant (or those named in ``variants``); return every figure."""
    dev = torch.device(device)
    cfg = cfg or (CUDA if dev.type == "cuda" else CPU)
    dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    say = Progress(progress)
    rows = {}
    chosen = []
    for v in VARIANTS:
        if variants is not None and v.key not in variants:
            continue
        rows[v.key] = {"key": v.key, "label": v.label}
        why = v.unavailable()
        if why is None:
            chosen.append(v)
        else:
            rows[v.key]["unavailable"] = why
            say(f"llama: {v.key} left out: {why}")
    base = Llama.seeded(cfg).to(device=dev, dtype=dtype)
    batch = tuple(t.to(dev) for t in make_batch(cfg))
    models = {v.key: v.apply(copy.deepcopy(base)) for v in chosen}
    by_key = {v.key: v for v in chosen}
    reference = None

    def forward(key):
        with by_key[key].context():
            return models[key](*batch)

    def step(key):
        fusion = tracedac.replay.compiled.fusion()
        before = tracedac.compiled_replay(by_key[key].compiled_replay, fusion=by_key[key].fusion)
        try:
            for p in models[key].parameters():
                p.grad = None
            with by_key[key].context():
                models[key](*batch).backward()
        finally:
            tracedac.compiled_replay(before, fusion=fusion)

    for key in models:
        say(f"llama: warming up {key}")
        with functorch_config.patch(dict(by_key[key].functorch_config)):
            t = time.perf_counter()
            step(key)  # compiles, for the compiled variants
            _sync(dev)
            rows[key]["first_step_s"] = time.perf_counter() - t
            for _ in range(WARMUP - 1):
                step(key)
        grads = [p.grad.float() for p in models[key].parameters()]
        if key == "none":
            reference = grads
        if reference is not None:
            rows[key]["max_grad_diff"] = max(
                (a - b).abs().max().item() for a, b in zip(grads, reference, strict=True)
            )
        if dev.type == "cuda":
            rows[key].update(_cuda_memory(dev, models[key], lambda: step(key), lambda: forward(key)))
        else:
            rows[key].update(_cpu_memory(models[key], lambda: step(key), lambda: forward(key)))
        if key.startswith("tracedac") and "offload" in key:  # its copies, as tracedac counts them
            with tracedac.offload.host.tracked() as copies:
                step(key)
            _sync(dev)
            rows[key]["copies"] = {
                "out_bytes": copies.out_bytes,
                "back_bytes": copies.back_bytes,
                "stalled_s": copies.stalled_s,
            }

    def timed(key, rep):
        _sync(dev)
        t = time.perf_counter()
        step(key)
        _sync(dev)
        return time.perf_counter() - t

    times = time_in_turns(list(models), steps, timed, say, what="llama")
    for key, seconds in times.items():
        rows[key]["step_s"] = statistics.median(seconds)
        rows[key]["times_s"] = seconds
    link = None
    if dev.type == "cuda" and any("offload" in k for k in models):  # what the planners priced
        measured = tracedac.offload.link.measure(dev, dtype)
        link = {"bandwidth": measured.bandwidth, "flop_rate": measured.flop_rate}
    return {
        "link": link,
        "config": asdict(cfg),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev),
        "dtype": str(dtype),
        "steps": steps,
        "torch": torch.__version__,
        "triton": _triton_version(),
        "threads": torch.get_num_threads(),
        "variants": list(rows.values()),
        "targets": _targets(rows, dev.type == "cuda"),
    }


def _cuda_memory(dev: torch.device, model: nn.Module, step: Callable, forward: Callable) -> dict:
    """Through the caching allocator: the peak of one step over what was allocated before it
    (weights, batch), and what one forward leaves allocated while its loss is alive (what the
    backward will read: kept tensors; offloaded ones count 0 once their copy is done)."""
    for p in model.parameters():
        p.grad = None
    torch.cuda.synchronize(dev)
    start = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    step()
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - start
    for p in model.parameters():
        p.grad = None
    torch.cuda.synchronize(dev)
    start = torch.cuda.memory_allocated(dev)
    loss = forward()
    torch.cuda.synchronize(dev)
    held = torch.cuda.memory_allocated(dev) - start
    loss.backward()  # frees what the forward saved (and the host copies)
    del loss
    return {"peak_over_weights": peak, "held_after_forward": held}


def _cpu_memory(model: nn.Module, step: Callable, forward: Callable) -> dict:
    """On the CPU, tensors only, from the profiler's allocation events (``profile_memory=True``:
    torch's CPU allocator reports every allocation and free of a storage, with its size, in
    order): the peak of the running sum over one step, and its net over one forward whose loss
    is alive (what backward will read). Storages freed that were allocated before profiling
    began count as frees of nothing, so a figure can only err upwards; Python objects are not
    seen (glibc keeps no peak of them: the main benchmark's child reads its bytes held)."""
    from .planners import _allocation_events

    for p in model.parameters():
        p.grad = None
    gc.collect()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        step()
    level = peak = 0
    for size in _allocation_events(prof):
        level += size
        peak = max(peak, level)
    for p in model.parameters():
        p.grad = None
    gc.collect()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        loss = forward()
    held = sum(_allocation_events(prof))
    loss.backward()
    del loss
    return {"peak_over_weights": peak, "held_after_forward": held}


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def _targets(rows: dict, cuda: bool) -> list[dict]:
    """Issue 32's eager and compiled targets and issue 30's offload one, where both rows ran.
    tracedac's eager rows are its default: compiled replay on CUDA, op by op on the CPU."""

    def ratio(a, b):
        if "step_s" not in rows.get(a, {}) or "step_s" not in rows.get(b, {}):
            return None
        return rows[a]["step_s"] / rows[b]["step_s"]

    def peak_ratio(a, b):
        pa, pb = rows.get(a, {}).get("peak_over_weights"), rows.get(b, {}).get("peak_over_weights")
        return None if pa is None or pb is None else pa / pb

    recompute = "tracedac_compiled_replay" if cuda else "tracedac_recompute_all"
    matmuls = "tracedac_save_matmuls_cr" if cuda else "tracedac_save_matmuls"
    default = "compiled replay" if cuda else "op-by-op replay"
    # The offload rows replay op by op (each variant sets compiled replay for its steps), so
    # they are held against recompute_all op by op, and against the faster of it and full
    # offload: the largest of the ratios. (Until 2026-11-27 this took the smallest, against
    # the slower of the two, and printed 0.339x met on an H200 where the figure was 0.974x.)
    full = ("tracedac_offload_all", "tracedac_offload_everything")  # (whichever ran)
    against = [ratio("tracedac_budget_offload", k) for k in ("tracedac_recompute_all", *full)]
    best_other = None if against[0] is None else max(r for r in against if r is not None)
    return [
        target(
            f"tracedac recompute_all ({default}) step / torch checkpoint", ratio(recompute, "torch"), 0.95
        ),
        target(
            f"tracedac recompute_all ({default}) peak / torch checkpoint", peak_ratio(recompute, "torch"), 1.0
        ),
        target(f"tracedac save_matmuls step / recompute_all ({default})", ratio(matmuls, recompute), 1.0),
        target(f"tracedac save_matmuls ({default}) step / torch selective", ratio(matmuls, "torch_sac"), 1.0),
        target(
            "compiled tracedac recompute_all step / compiled torch checkpoint",
            ratio("c_tracedac_recompute_all", "c_torch"),
            1.02,
        ),
        target(
            "compiled tracedac recompute_all peak / compiled torch checkpoint",
            peak_ratio("c_tracedac_recompute_all", "c_torch"),
            1.0,
        ),
        target(
            f"memory_budget({BUDGET}, offload=True) step / memory_budget({BUDGET})",
            ratio("tracedac_budget_offload", "tracedac_budget"),
            1.0,
        ),
        target(
            f"memory_budget({BUDGET}, offload=True) step / best of recompute_all and offload all",
            best_other,
            1.0,
        ),
        target(
            "tracedac offload_inputs() step / torch checkpoint in save_on_cpu",
            ratio("tracedac_offload_inputs", "torch_ckpt_save_on_cpu"),
            1.0,
        ),
        target(
            "tracedac offload_inputs() peak / torch checkpoint in save_on_cpu",
            peak_ratio("tracedac_offload_inputs", "torch_ckpt_save_on_cpu"),
            1.0,
        ),
    ]


def _size(n: int) -> str:
    """Bytes in the unit that shows them: GiB for a GPU's, KiB for the CPU's tiny models."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 2**10:.1f} KiB"


def format_report(r: dict) -> str:
    rows = r["variants"]
    torch_s = next((x["step_s"] for x in rows if x["key"] == "torch" and "step_s" in x), None)
    cells = []
    for x in rows:
        if "unavailable" in x:
            cells.append([x["label"], "-", "-", "-", "-", "-", f"left out: {x['unavailable']}"])
            continue
        peak, held = x.get("peak_over_weights"), x.get("held_after_forward")
        cells.append(
            [
                x["label"],
                f"{x['step_s'] * 1e3:.1f}",
                f"{x['step_s'] / torch_s:.2f}x" if torch_s else "-",
                _size(peak) if peak is not None else "-",
                _size(held) if held is not None else "-",
                f"{x['max_grad_diff']:.2e}" if "max_grad_diff" in x else "-",
                f"{x['first_step_s']:.1f}",
            ]
        )
    head = (
        f"Llama-style decoder on {r['device']} ({r['dtype']}, {r['threads']} threads, torch {r['torch']}, "
        f"triton {r['triton']}), median of {r['steps']} steps after {WARMUP} warm-up; model {r['config']}"
    )
    if link := r.get("link"):
        head += (
            f"\nlink as tracedac measured it (what the offload planners price): {link['bandwidth'] / 1e9:.1f}"
            f" GB/s each way, matmuls at {link['flop_rate'] / 1e12:.0f} TFLOP/s"
        )
    header = ["variant", "step ms", "vs torch checkpoint", "peak over weights", "held after forward"]
    copies = [
        [
            x["label"],
            f"{c['out_bytes'] / 1e6:.2f}",
            f"{c['back_bytes'] / 1e6:.2f}",
            f"{c['stalled_s'] * 1e3:.2f}",
        ]
        for x in rows
        if (c := x.get("copies"))
    ]
    if copies:  # (on the CPU a copy is read in place: nothing comes back, nothing waits)
        copies = ["", COPIES, *table(["variant", "to host MB", "back MB", "compute waited ms"], copies)]
    return "\n".join(
        [head, ""]
        + table([*header, "max |grad diff|", "first step s"], cells)
        + copies
        + ["", GOALS, *(goal_line(t) for t in r["targets"])]
    )


COPIES = (
    "host copies of one step (tracedac.offload.host.tracked): bytes each way, and how long the compute "
    "stream waited for them (the part of the copies the compute did not hide)"
)
