"""The main benchmark: tracedac against torch's checkpointing on the default MoE model.

One run, one set of weights (each variant gets a deep copy of the same seeded model), one
batch, and for every step a seed shared by all variants, so dropout draws the same masks
everywhere and gradients are comparable element by element. Figures per variant:

- **step time**: median wall time (``time.perf_counter``) of forward + backward over the
  timed steps, after one untimed step per variant, and for tracedac's variants as many more
  as its warm path takes to settle (``child.settle``: on this MoE model each block logs a
  template and falls back from it for a few calls, its routing changing the structure, then
  records every call; a one-off cost, printed under the table). Variants take turns within each
  repetition, the first turn rotating, so drift of the machine (clock, other load) hits
  all of them alike instead of whichever ran last. The medians of the forward and of the
  backward alone are shown beside it: where a variant's extra time goes.
- **bytes held after forward**: ``probe.allocated_bytes()`` after the forward minus before
  it, with the loss (and so the autograd graph and everything it saved) alive, and
  ``gc.collect()`` run before each reading. Parameter gradients are cleared first, and the
  batch and weights exist before the first reading, so the difference is what the forward
  left behind for backward: saved activations, the logits the loss keeps, the variant's
  own bookkeeping. It is read at the allocator (glibc ``mallinfo2`` on CPU,
  ``torch.cuda.memory_allocated`` on CUDA), never from tracedac's accounting, and in a
  child interpreter run with ``PYTHONMALLOC=malloc`` so that Python objects (a recorded
  graph, a checkpoint's closures) are counted beside tensors; see ``_checks_in_child``. The
  least of three forwards of one batch and seed: a step's holding, not what a first call
  builds once and keeps (tracedac's templates for repeated regions, ~250 KiB for each MoE
  block while its routing keeps changing, made in the forwards that record them).
  The part of it that is Python objects is measured with ``tracemalloc`` in a forward of
  its own and shown beside it.
- **max |grad difference|**: the largest absolute difference, over every element of every
  parameter's gradient, from the no-checkpoint run of the same step (same seed).
- **MoE tokens counted**: the sum of every ``Router.tokens_per_expert`` after one forward
  + backward, beside the true count (tokens x top_k x layers). A checkpoint that re-runs
  the Python forward counts them twice.

A separate section times the forward alone, plain vs. recorded by tracedac
(``recompute_all``), on the same model at ``dim=512``: what tracing costs when no
backward follows. Beside them, the same blocks each run under ``floors.EmptyMode`` (an empty
``TorchDispatchMode``: what any recorder written in Python pays before it records anything)
and recorded by ``floors.LeastRecorder`` (the least a recorder must write down, and
nothing else): the floors under any recorder written in Python.
"""

from __future__ import annotations

import copy
import gc
import os
import statistics
import sys
import time
import tracemalloc
from dataclasses import asdict, replace
from typing import Callable, TextIO

import torch

import tracedac

from . import floors, probe
from .child import (
    Progress,
    clear_grads,
    mib,
    run_child,
    sanity,
    seeded_step,
    settle,
    table,
    target,
    target_lines,
    time_in_turns,
)
from .model import GPT, Block, Config, make_batch
from .variants import VARIANTS

__all__ = ["QUICK", "STEPS", "TRACE_DIM", "check_settings", "child_checks", "format_report", "run"]

# A model that finishes every section in seconds: for tests and for checking a set-up.
QUICK = Config(vocab=64, layers=2, dim=32, heads=2, experts=4, top_k=2, expert_hidden=64, batch=2, seq=16)
# Hidden size at which the cost of tracing a forward is judged.
TRACE_DIM = 512
STEPS = 8  # default timed steps per variant
UNTIMED_SEEDS = 2000  # untimed steps' seeds from cfg.seed + this (timed: cfg.seed + rep)
_GRAD_SEED = 1000  # the step whose gradients and token counts are compared


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, fn: Callable, *args) -> tuple[float, object]:
    """Seconds ``fn(*args)`` took, and what it returned."""
    _sync(device)
    start = time.perf_counter()
    result = fn(*args)
    _sync(device)
    return time.perf_counter() - start, result


def _check_step(model: GPT, batch, cfg: Config) -> tuple[dict[str, torch.Tensor], int]:
    """Gradients of one forward + backward, and the tokens its routers counted during it."""
    routers = model.routers()
    for r in routers:
        r.tokens_per_expert.zero_()
    clear_grads(model)
    seeded_step(model, batch, cfg.seed + _GRAD_SEED)
    counted = sum(int(r.tokens_per_expert.sum()) for r in routers)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    clear_grads(model)
    return grads, counted


def _max_grad_difference(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    if grads.keys() != reference.keys():
        raise RuntimeError(
            "a checkpointed copy of the model has different parameters from the original "
            f"({sorted(grads.keys() ^ reference.keys())[:4]}...); the variant changed the "
            "model's structure, which checkpointing must not do."
        )
    return max(float((grads[n] - reference[n]).abs().max()) for n in reference)


def _held_after_forward(model: GPT, batch, seed: int, device: torch.device, repeats: int = 3) -> int:
    """Allocator bytes the forward left allocated while its loss is alive, the least of
    ``repeats`` forwards (see module doc)."""
    readings = []
    for _ in range(repeats):
        clear_grads(model)
        torch.manual_seed(seed)
        gc.collect()
        before = probe.allocated_bytes(device)
        loss = model(*batch)
        gc.collect()
        readings.append(probe.allocated_bytes(device) - before)
        loss.backward()
        del loss
    clear_grads(model)
    return min(readings)


def _python_held_after_forward(model: GPT, batch, seed: int) -> int:
    """Bytes of Python objects the forward left alive (tracemalloc), the loss alive.

    A part of ``_held_after_forward``'s figure, measured in a forward of its own because
    tracemalloc keeps its records in malloc'd memory the probe would count.
    """
    clear_grads(model)
    torch.manual_seed(seed)
    gc.collect()
    tracemalloc.start()
    try:
        loss = model(*batch)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    loss.backward()
    del loss
    clear_grads(model)
    return held


def _check_variants(cfg: Config, device: torch.device, say) -> dict[str, dict]:
    """Gradient difference, tokens counted and bytes held, per variant (run in the child)."""
    base = GPT.seeded(cfg).to(device)
    batch = tuple(t.to(device) for t in make_batch(cfg))
    reference = None
    found: dict[str, dict] = {}
    for i, variant in enumerate(VARIANTS, 1):
        missing = variant.unavailable()
        if missing is not None:
            say(f"[{i}/{len(VARIANTS)}] {variant.label}: skipped ({missing})")
            found[variant.key] = {"status": missing}
            continue
        say(f"[{i}/{len(VARIANTS)}] {variant.label}: gradients, tokens counted, bytes held")
        model = variant.build(base)
        grads, tokens = _check_step(model, batch, cfg)
        if variant.key == "none":
            reference = grads  # the first variant: what every other is compared with
        found[variant.key] = {
            "status": "ok",
            "tokens_counted": tokens,
            "max_grad_diff": _max_grad_difference(grads, reference),
            "bytes_held": _held_after_forward(model, batch, cfg.seed + _GRAD_SEED, device),
            "python_bytes_held": _python_held_after_forward(model, batch, cfg.seed + _GRAD_SEED),
        }
    return found


def child_checks(spec: dict) -> dict[str, dict]:
    """Entry point of the child interpreter: ``spec`` holds the config, device and thread count."""
    torch.set_num_threads(spec["threads"])
    return _check_variants(
        Config(**spec["config"]),
        torch.device(spec["device"]),
        lambda message: print(message, file=sys.stderr, flush=True),
    )


_CHILD = (
    "import json, sys\n"
    "from benchmarks.checkpointing import child_checks\n"
    "json.dump(child_checks(json.loads(sys.argv[1])), sys.stdout)\n"
)


def _checks_in_child(cfg: Config, device: torch.device, say) -> dict[str, dict]:
    """``_check_variants`` in a fresh interpreter where every allocation goes through glibc.

    CPython serves objects of 512 bytes or less from arenas it maps itself, out of glibc's
    sight, so in this process the probe would miss most of a recorded graph. Under
    ``PYTHONMALLOC=malloc`` they are malloc'd like everything else and the bytes held count
    Python bookkeeping (tracedac's graphs, torch checkpoint's closures) beside tensors.
    Timing stays in this process, with CPython's usual allocator.
    """
    spec = {"config": asdict(cfg), "device": str(device), "threads": torch.get_num_threads()}
    return run_child(
        _CHILD, spec, say, "checks gradients and measures memory", "python -m benchmarks --quick"
    )


def _time_variants(
    cfg: Config, steps: int, device: torch.device, say
) -> dict[str, list[tuple[float, float]]]:
    """(forward, backward) wall times of each step per variant, taking turns (see module doc)."""
    base = GPT.seeded(cfg).to(device)
    batch = tuple(t.to(device) for t in make_batch(cfg))
    models = {v.key: v.build(base) for v in VARIANTS if v.unavailable() is None}
    say(f"timing: one untimed step per variant, then {steps} timed")
    for model in models.values():
        seeded_step(model, batch, cfg.seed)
        clear_grads(model)

    def untimed(key, i):  # seeds of their own, so routing changes as in the timed steps
        seeded_step(models[key], batch, cfg.seed + UNTIMED_SEEDS + i)
        clear_grads(models[key])

    settled = settle(untimed, [v.key for v in VARIANTS if v.tracedac and v.key in models])
    say(f"timing: tracedac's warm path settled after {settled} more untimed steps")

    def timed_step(key, rep):
        model = models[key]
        torch.manual_seed(cfg.seed + rep)
        forward, loss = _timed(device, model, *batch)
        backward = _timed(device, loss.backward)[0]
        del loss
        clear_grads(model)
        return forward, backward

    return time_in_turns(models, steps, timed_step, say), settled


def _compare(cfg: Config, steps: int, device: torch.device, say) -> list[dict]:
    checked = _checks_in_child(cfg, device, say)
    split, settled = _time_variants(cfg, steps, device, say)
    plain = statistics.median(f + b for f, b in split["none"])
    rows = []
    for variant in VARIANTS:
        row = {
            "key": variant.key,
            "label": variant.label,
            "tracedac": variant.tracedac,
            "true_tokens": cfg.tokens * cfg.top_k * cfg.layers,
            "untimed_steps": 1 + (settled if variant.tracedac else 0),
            **checked[variant.key],
        }
        if variant.key in split:
            row["step_times_s"] = [f + b for f, b in split[variant.key]]
            row["step_s"] = statistics.median(row["step_times_s"])
            row["step_vs_none"] = row["step_s"] / plain
            row["forward_s"] = statistics.median(f for f, _ in split[variant.key])
            row["backward_s"] = statistics.median(b for _, b in split[variant.key])
        rows.append(row)
    return rows


def _ratio_key(key: str) -> str:
    """Where ``_tracing`` stores a mode's forward time over the plain one: tracedac's is ``ratio``."""
    return "ratio" if key == "traced" else f"{key}_ratio"


def _tracing(cfg: Config, forwards: int, device: torch.device, say) -> dict:
    """Median of ``forwards`` forward times, plain, with each block under each of
    ``floors``' modes, and recorded by tracedac, with gradients enabled in all four."""
    say(f"tracing overhead: forward only at dim={cfg.dim}")
    plain = GPT.seeded(cfg).to(device)
    models = {"plain": plain}
    for key, fn in (("empty_mode", floors.under_empty_mode), ("least_recorder", floors.under_least_recorder)):
        models[key] = copy.deepcopy(plain)
        models[key].checkpoint_fn = fn
    models["traced"] = tracedac.wrap(copy.deepcopy(plain), Block)
    batch = tuple(t.to(device) for t in make_batch(cfg))

    def forward(model, seed):
        torch.manual_seed(seed)
        return model(*batch)

    for model in models.values():
        forward(model, cfg.seed)
    settled = settle(lambda key, i: forward(models[key], cfg.seed + UNTIMED_SEEDS + i), ["traced"])

    def timed_forward(key, rep):
        # the loss outlives the timer: freeing its graph is not part of a forward
        seconds, loss = _timed(device, forward, models[key], cfg.seed + rep)
        del loss
        return seconds

    times = time_in_turns(models, forwards, timed_forward, say, what="tracing overhead")
    result = {"dim": cfg.dim, "forwards": forwards, "untimed_traced": 1 + settled}
    plain_s = result["plain_forward_s"] = statistics.median(times["plain"])
    for key in ("empty_mode", "least_recorder", "traced"):
        seconds = result[f"{key}_forward_s"] = statistics.median(times[key])
        result[_ratio_key(key)] = seconds / plain_s
    for key, seconds in times.items():
        result[f"{key}_times_s"] = seconds
    return result


def _targets(rows: list[dict], tracing: dict) -> list[dict]:
    by = {r["key"]: r for r in rows}

    def ratio(a: str, b: str, field: str):
        x, y = by[a].get(field), by[b].get(field)
        return None if x is None or y is None else x / y

    return [
        target(
            "tracedac recompute_all step time / torch.utils.checkpoint",
            ratio("tracedac_recompute_all", "torch", "step_s"),
            1.00,
        ),
        target(
            "tracedac recompute_all step time / no checkpoint",
            ratio("tracedac_recompute_all", "none", "step_s"),
            1.40,
        ),
        target(
            "tracedac save_matmuls bytes held / torch selective",
            ratio("tracedac_save_matmuls", "torch_sac", "bytes_held"),
            1.00,
        ),
        target(
            "tracedac save_matmuls step time / torch selective",
            ratio("tracedac_save_matmuls", "torch_sac", "step_s"),
            1.00,
        ),
        target(f"traced forward / plain forward at dim {tracing['dim']}", tracing["ratio"], 1.10),
    ]


def _sanity(rows: list[dict], tracing: dict) -> list[dict]:
    """Figures no quiet run gives: what does more work than its baseline, measured faster."""
    by = {r["key"]: r for r in rows}

    def step(key):
        return by.get(key, {}).get("step_s")

    return [
        sanity("torch.utils.checkpoint step / no checkpoint", step("torch"), step("none")),
        sanity("torch selective step / no checkpoint", step("torch_sac"), step("none")),
        sanity(
            "an empty dispatch mode's forward / plain",
            tracing.get("empty_mode_forward_s"),
            tracing.get("plain_forward_s"),
        ),
    ]


def check_settings(cfg: Config, steps: int, device: str) -> tuple[Config, torch.device]:
    """The tracing section's config and the device, or a ValueError/ProbeUnavailable saying
    what cannot run, before any work is done."""
    cfg.check()
    if steps < 1:
        raise ValueError(f"steps must be at least 1 to have a time to report, got {steps}")
    trace_cfg = replace(cfg, dim=TRACE_DIM, expert_hidden=max(1, cfg.expert_hidden * TRACE_DIM // cfg.dim))
    try:
        trace_cfg.check()
    except ValueError as e:
        raise ValueError(f"the tracing-overhead section runs the model at dim {TRACE_DIM}: {e}") from None
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"{device!r} is not a device torch knows ({e}); use cpu or cuda[:N]") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device {device!r} was asked for, but torch {torch.__version__} sees no CUDA device; use cpu"
        )
    probe.allocated_bytes(dev)  # raises ProbeUnavailable where the allocator cannot be read
    return trace_cfg, dev


def run(
    cfg: Config = Config(),
    *,
    steps: int = STEPS,
    device: str = "cpu",
    quick: bool = False,
    progress: TextIO | None = sys.stderr,
    system_malloc: bool = False,
) -> dict:
    """Run the comparison and the tracing-overhead section; return every figure.

    ``quick`` swaps in ``QUICK`` (a tiny model) for ``cfg``, at most two timed steps, and a
    tracing section at that model's own size: for tests and for checking a set-up. Progress
    lines go to ``progress`` (None: silent). Unless ``system_malloc``, timings run with glibc
    keeping freed memory (``probe.keep_freed_memory``); the memory figures come from a
    child interpreter either way.
    """
    if quick:
        cfg, steps = QUICK, min(steps, 2)
    trace_cfg, dev = check_settings(cfg, steps, device)
    if quick:
        trace_cfg = cfg
    say = Progress(progress)
    start = time.perf_counter()
    load = os.getloadavg()[0]  # before any work of ours: what else runs on the machine
    if dev.type == "cpu" and load >= 1.0 and "OMP_WAIT_POLICY" not in os.environ:
        say(
            f"warning: load average {load:.1f} before the run: other processes use the CPUs. Idle "
            "OpenMP workers spin by default, so on a busy machine torch's threads stall each other "
            "and step times can come out several times too slow and far apart. Run on an idle "
            "machine, or with OMP_WAIT_POLICY=passive in the environment."
        )
    steady = dev.type == "cpu" and not system_malloc and probe.keep_freed_memory()
    rows = _compare(cfg, steps, dev, say)
    tracing = _tracing(trace_cfg, steps, dev, say)
    wall = time.perf_counter() - start
    say(f"finished in {wall:.1f}s")
    return {
        "config": asdict(cfg),
        "steps": steps,
        "device": str(dev),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "probe": f"{probe.describe(dev)}, child interpreter with PYTHONMALLOC=malloc",
        "timing_allocator": "glibc keeping freed memory (mallopt)" if steady else "default",
        "variants": rows,
        "tracing": tracing,
        "targets": _targets(rows, tracing),
        "sanity": _sanity(rows, tracing),
        "wall_s": wall,
        # Other processes competing for the cores skew every timing; this says whether any did.
        "load_average_before": load,
        "cpus": os.cpu_count(),
    }


# --- text ----------------------------------------------------------------------------------


def _row_cells(row: dict) -> list[str]:
    if row["status"] != "ok":
        return [row["label"], row["status"], "", "", "", "", "", "", ""]
    tokens = f"{row['tokens_counted']}"
    if row["tokens_counted"] != row["true_tokens"]:
        tokens += f" ({row['tokens_counted'] / row['true_tokens']:.0f}x)"
    return [
        row["label"],
        f"{row['step_s'] * 1e3:.0f} ms",
        f"{row['step_vs_none']:.2f}x",
        f"{row['forward_s'] * 1e3:.0f} ms",
        f"{row['backward_s'] * 1e3:.0f} ms",
        mib(row["bytes_held"]),
        mib(row["python_bytes_held"]),
        f"{row['max_grad_diff']:.1e}",
        tokens,
    ]


def format_report(result: dict) -> str:
    """The figures of ``run`` as a table, the tracing section, and the targets with marks."""
    cfg = result["config"]
    true_tokens = result["variants"][0]["true_tokens"]
    header = [
        "variant",
        "step (median)",
        "vs none",
        "forward",
        "backward",
        "held after fwd",
        "of it Python",
        "max |grad diff|",
        f"MoE tokens (true {true_tokens})",
    ]
    out = [
        f"model: {cfg['layers']} blocks, dim {cfg['dim']}, {cfg['heads']} heads, {cfg['experts']} experts "
        f"(top {cfg['top_k']}, width {cfg['expert_hidden']}), batch {cfg['batch']}x{cfg['seq']} tokens, "
        f"vocab {cfg['vocab']}, dropout {cfg['dropout']}",
        f"device {result['device']}, {result['threads']} threads, torch {result['torch']}; "
        f"{result['steps']} timed steps per variant; "
        f"timing allocator: {result.get('timing_allocator', 'default')}; "
        f"memory: {result['probe']}",
        "",
        *table(header, [_row_cells(r) for r in result["variants"]]),
    ]
    learned = max(r["untimed_steps"] for r in result["variants"] if r["tracedac"])  # 1 + settle's
    if learned > 1:
        out.append(
            f"untimed steps before the timed ones: 1 per variant, tracedac's {learned} (until its warm path "
            "settled: a block whose structure follows its routing logs a template and falls back from it "
            "for a few calls, then records every call; a one-off cost)"
        )
    out.append("")
    t = result["tracing"]
    after = f"; tracedac's after {t['untimed_traced']} untimed" if t["untimed_traced"] > 1 else ""
    out.append(f"forward only at dim {t['dim']} (median of {t['forwards']} each{after}):")
    for label, key, note in (
        ("plain", "plain", ""),
        (
            "under an empty TorchDispatchMode",
            "empty_mode",
            "what any recorder in Python pays before recording",
        ),
        (
            "recorded by the least recorder",
            "least_recorder",
            "the least any recorder in Python must do (benchmarks/floors.py)",
        ),
        ("recorded by tracedac", "traced", ""),
    ):
        ratio = 1.0 if key == "plain" else t[_ratio_key(key)]
        out.append(f"  {label:<33} {t[f'{key}_forward_s'] * 1e3:6.0f} ms  {ratio:5.2f}x  {note}".rstrip())
    out += [""]
    out += target_lines(result)
    return "\n".join(out)
