"""``python -m benchmarks --peak``: one budget for the whole model (``policies.peak``) on the
Llama-style decoder (``llama.py``) and the MoE GPT (``model.py``), beside torch's options.

Per model, every variant is a deep copy of one seeded model trained alone (nothing of another
variant alive: the budget is the whole device's), with AdamW:

- **no checkpoint**; **torch checkpoint** (``torch.utils.checkpoint``, non-reentrant, around each
  block: full recompute); **torch selective** (the same saving the matmuls,
  ``create_selective_checkpoint_contexts`` with ``policies.MATMUL_OPS``);
- **torch compiled (b)**: each block compiled (``--peak-backend``: ``aot_eager_decomp_partition``
  on the CPU, where inductor takes minutes a compile, inductor on CUDA) while
  ``activation_memory_budget = b``, for b in ``TORCH_BUDGETS``;
- **tracedac recompute_all()** (the least), and **peak(B)** for ``BUDGETS`` budgets evenly spaced
  from recompute_all's measured peak to no checkpointing's.

Each variant takes ``WARMUP`` steps (peak measures one, checks the next, may plan once more),
then one step whose peak the benchmark's own probe reads (``probe.StepPeak``: on the CPU the
tensors alive before it plus the CPU allocator's profiled allocation events, compiled code's
included; on CUDA ``torch.cuda.max_memory_allocated``), then ``steps`` timed steps (median).
The sweep runs ``rounds`` times, variants in the same order, and each step time is the median
over the rounds (a loaded machine drifts; each variant meets the drift in every round).

Targets, per model: every ``peak(B)`` measured within B (+1 %); the peaks monotone in B over
all the budgets; and at each budget, the step time at most the fastest torch option (eager or
compiled) whose measured peak is at most that budget's measured peak (the worst ratio).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import os
import statistics
import time
from dataclasses import replace

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.utils.checkpoint import CheckpointPolicy

import tracedac
from tracedac import policies

from . import probe
from .child import GOALS, Progress, goal_line, mib, table, target
from .llama import DecoderLayer, Llama, LlamaConfig
from .model import GPT, Block, Config, make_batch

__all__ = ["BUDGETS", "QUICK", "ROUNDS", "STEPS", "TORCH_BUDGETS", "format_report", "run"]

BUDGETS = 8
TORCH_BUDGETS = (0.0, 0.25, 0.5, 0.75, 1.0)
STEPS = 3
ROUNDS = 2
WARMUP = 4
SLACK = 1.01  # a measured peak within its budget and 1 %


def _models(quick: bool):
    """(name, model class, its block class, config) of the two models."""
    if quick:
        return [
            ("llama", Llama, DecoderLayer, LlamaConfig(layers=2, dim=64, heads=4, mlp_hidden=192, seq=32)),
            ("moe", GPT, Block, replace(Config(), layers=2, dim=64, experts=4, expert_hidden=128, seq=32)),
        ]
    return [("llama", Llama, DecoderLayer, LlamaConfig(layers=4)), ("moe", GPT, Block, Config())]


QUICK = _models(True)


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    # tracedac's save_matmuls() op list, so torch's selective checkpoint keeps the same results
    if op.overloadpacket in policies.MATMUL_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _blocks(model, block):
    return [m for m in model.modules() if isinstance(m, block)]


def _torch(model, block, selective: bool):
    extra = {}
    if selective:
        extra["context_fn"] = functools.partial(
            torch_checkpoint.create_selective_checkpoint_contexts, _save_matmuls
        )
    for m in _blocks(model, block):
        m.forward = functools.partial(torch_checkpoint.checkpoint, m.forward, use_reentrant=False, **extra)
    return model


def _compiled(model, block, backend: str):
    for m in _blocks(model, block):
        m.compile(backend=backend)
    return model


def _memory_budget(b: float):
    import torch._functorch.config as functorch_config

    return functorch_config.patch(activation_memory_budget=b)


def _variants(block, budgets, torch_budgets, backend):
    """(key, label, kind, budget, apply, context) per variant; ``budgets`` None: those of
    ``peak`` are added once the least and the most are known."""
    out = [
        ("none", "no checkpoint", "none", None, lambda m: m, None),
        ("torch", "torch checkpoint", "torch", None, lambda m: _torch(m, block, False), None),
        ("torch_sac", "torch selective (matmuls)", "torch", None, lambda m: _torch(m, block, True), None),
        (
            "least",
            "tracedac recompute_all()",
            "least",
            None,
            lambda m: tracedac.wrap(m, block, policies.recompute_all()),
            None,
        ),
    ]
    for b in torch_budgets:
        out.append(
            (
                f"compiled_{b}",
                f"torch compiled ({b})",
                "compiled",
                b,
                lambda m: _compiled(m, block, backend),
                functools.partial(_memory_budget, b),
            )
        )
    for b in budgets or ():
        out.append(
            (
                f"peak_{b}",
                f"peak({mib(b)})",
                "tracedac",
                b,
                lambda m, b=b: tracedac.wrap(m, block, policies.peak(b)),
                None,
            )
        )
    return out


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _trained(model, batch, steps: int, device) -> tuple[int, list[float]]:
    """``WARMUP`` steps, one whose peak the probe reads, ``steps`` timed: (peak, seconds)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        model(*batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(WARMUP):
        step()
    gc.collect()
    p = probe.StepPeak(device)
    p.start()
    step()
    peak = p.stop()
    times = []
    for _ in range(steps):
        _sync(device)
        t = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t)
    return peak, times


def _measure(base, batch, variant, steps: int, device, say) -> dict:
    """Train a copy of ``base`` under ``variant``: its measured peak and median step time."""
    key, label, kind, budget, apply, context = variant
    if kind == "compiled":
        from torch import _dynamo

        _dynamo.reset()  # a graph compiled under another budget must not be reused
    result = {"key": key, "label": label, "kind": kind, "budget": budget}
    try:
        with context() if context is not None else contextlib.nullcontext():
            peak, times = _trained(apply(copy.deepcopy(base)), batch, steps, device)
        result["peak"], result["step_s"] = peak, statistics.median(times)
    except tracedac.CheckpointError as e:
        result["error"] = str(e).split(". ")[0]
    gc.collect()
    say(f"{label}: {mib(result['peak']) if 'peak' in result else result.get('error')}")
    return result


def _sweep(name, cls, block, cfg, *, steps, rounds, budgets, torch_budgets, backend, device, say) -> dict:
    base = cls.seeded(cfg).to(device)
    batch = tuple(t.to(device) for t in make_batch(cfg))
    rows: dict[str, dict] = {}
    chosen = None
    for r in range(rounds):
        say(f"{name}: round {r + 1} of {rounds}")
        variants = _variants(block, chosen, torch_budgets, backend)
        for v in variants:
            got = _measure(base, batch, v, steps, device, say)
            row = rows.setdefault(v[0], {**got, "step_runs": []})
            if "step_s" in got:
                row["step_runs"].append(got["step_s"])
        if chosen is None:  # the budgets: from the least's peak to no checkpointing's
            least, most = rows["least"]["peak"], rows["none"]["peak"]
            chosen = [least + (most - least) * i // max(1, budgets - 1) for i in range(budgets)]
            for v in _variants(block, chosen, (), backend)[4:]:
                got = _measure(base, batch, v, steps, device, say)
                rows[v[0]] = {**got, "step_runs": [got["step_s"]] if "step_s" in got else []}
    for row in rows.values():
        row["step_s"] = statistics.median(row["step_runs"]) if row["step_runs"] else None
    return {"model": name, "config": repr(cfg), "rows": list(rows.values())}


def _targets(result: dict) -> list[dict]:
    rows = result["rows"]
    budgets = sorted((r for r in rows if r["kind"] == "tracedac"), key=lambda r: r["budget"])
    ran = [r for r in budgets if "peak" in r]
    over = max((r["peak"] / r["budget"] for r in ran), default=None)
    peaks = [r["peak"] for r in ran]
    falls = sum(1 for a, b in zip(peaks, peaks[1:]) if b < a)
    options = [r for r in rows if r["kind"] in ("torch", "compiled", "none") and r.get("step_s")]
    ratios = []
    for r in ran:
        fits = [o for o in options if o["peak"] <= r["peak"]]
        if fits and r.get("step_s"):
            best = min(fits, key=lambda o: o["step_s"])
            r["versus"] = (r["step_s"] / best["step_s"], best["label"])
            ratios.append(r["versus"][0])
    m = result["model"]
    return [
        target(f"{m}: the largest measured peak / its budget, over {len(ran)} budgets", over, SLACK),
        target(f"{m}: budgets whose measured peak is below a smaller budget's", falls, 0, ""),
        target(
            f"{m}: the worst step time / the fastest torch option within the budget's peak",
            max(ratios, default=None),
            1.0,
        ),
    ]


def run(
    *,
    steps: int = STEPS,
    rounds: int = ROUNDS,
    budgets: int = BUDGETS,
    quick: bool = False,
    device: str = "cpu",
    backend: str | None = None,
    progress=None,
) -> dict:
    say = Progress(progress)
    device = torch.device(device)
    backend = backend or ("inductor" if device.type == "cuda" else "aot_eager_decomp_partition")
    torch_budgets = (0.0, 1.0) if quick else TORCH_BUDGETS
    start = time.perf_counter()
    load = os.getloadavg()[0]
    results = []
    for name, cls, block, cfg in _models(quick):
        r = _sweep(
            name,
            cls,
            block,
            cfg,
            steps=steps,
            rounds=rounds,
            budgets=budgets,
            torch_budgets=torch_budgets,
            backend=backend,
            device=device,
            say=say,
        )
        r["targets"] = _targets(r)
        results.append(r)
    return {
        "models": results,
        "probe": probe.StepPeak(device).describe(),
        "backend": backend,
        "steps": steps,
        "rounds": rounds,
        "device": str(device),
        "targets": [t for r in results for t in r["targets"]],
        "wall_s": time.perf_counter() - start,
        "load_average_before": load,
        "cpus": os.cpu_count(),
    }


def format_report(result: dict) -> str:
    lines = [
        f"peak(budget): one budget for the whole model, on {result['device']}; peaks by {result['probe']}; "
        f"torch compiled with {result['backend']}; step: median of {result['steps']} steps, median over "
        f"{result['rounds']} rounds",
    ]
    for m in result["models"]:
        rows = sorted(m["rows"], key=lambda r: (r.get("peak") is None, r.get("peak") or 0))
        plain = next(r for r in rows if r["kind"] == "none")
        cells = []
        for r in rows:
            if "peak" not in r:
                cells.append([r["label"], "-", "-", "-", "-", "-", r.get("error", "")[:60]])
                continue
            within = "" if r["kind"] != "tracedac" else ("yes" if r["peak"] <= r["budget"] * SLACK else "NO")
            versus = r.get("versus")
            cells.append(
                [
                    r["label"],
                    mib(r["peak"]),
                    within,
                    f"{r['step_s'] * 1e3:.1f}" if r.get("step_s") else "-",
                    f"{r['step_s'] / plain['step_s']:.2f}" if r.get("step_s") else "-",
                    "" if versus is None else f"{versus[0]:.2f}",
                    "" if versus is None else versus[1],
                ]
            )
        lines += ["", f"{m['model']}: {m['config']}"]
        lines += table(
            ["variant", "peak", "within", "step ms", "x none", "x best torch", "(that option)"], cells
        )
    lines += ["", GOALS, *(goal_line(t) for t in result["targets"])]
    lines.append(
        f"\nwall time {result['wall_s']:.1f}s; load average {result['load_average_before']:.1f} on "
        f"{result['cpus']} CPUs before the run (other processes skew timings)"
    )
    return "\n".join(lines)
