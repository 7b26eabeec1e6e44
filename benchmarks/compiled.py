"""``python -m benchmarks --compile``: checkpointing inside one ``torch.compile`` graph.

The default MoE model (``model.GPT``) with fixed-capacity routing (``Config.capacity``):
its data-dependent expert gather (``nonzero``) cannot be one graph, and ``fullgraph=True``
is the point here. Every variant is a deep copy of one seeded model, compiled with
inductor (``fullgraph=True``, caches on, no extra argument); each is compiled afresh
(dynamo reset before it) and measured on its own:

- **graph breaks**: dynamo's counter after the first step; **compile**: that step's seconds.
- **step**: median seconds of forward + backward over the timed steps (one seed per step);
  for the variants the step targets compare (``IN_TURNS``), all compiled again and alive at
  once, taking turns, so that the machine's drift falls on each alike.
- **held after fwd**: ``probe.allocated_bytes()`` after the forward minus before, loss alive
  (tensors at the allocator; in this process, so Python objects are not all counted).
- **replay GFLOP**: what the compiled backward recomputes of the forward, by torch's FLOP
  formulas, read off the partition AOTAutograd makes for the same code
  (``tracedac.inspect.compiled.partition``); for eager tracedac, ``saved_report``.
- **tokens counted**: the routers' counters after one forward + backward (true count:
  tokens x top_k x layers); **max |grad diff|**: against the compiled model without
  checkpointing, same seed.

Variants: no checkpoint; torch's checkpoint and selective checkpointing (matmuls) per
block; torch's ``activation_memory_budget=0.5`` (its config, patched while compiling);
tracedac ``recompute_all``, ``save_matmuls``, ``memory_budget(0.5)``, and a mix of
``memory_budget(0.25)`` and ``memory_budget(0.75)`` on alternate blocks; and eager tracedac
``recompute_all`` (the model not compiled) for the compiled-vs-eager target.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

import tracedac

from . import frontier, probe
from .checkpointing import QUICK as _QUICK
from .checkpointing import _held_after_forward
from .child import GOALS, Progress, clear_grads, goal_line, mib, seeded_step, table, target
from .model import GPT, Config, make_batch
from .variants import _no_checkpoint, _torch_checkpoint, _torch_selective

__all__ = ["CAPACITY", "QUICK", "STEPS", "VARIANTS", "format_report", "run"]

CAPACITY = 1.25  # expert slots per token routed to it, on average (static shapes)
QUICK = replace(_QUICK, capacity=CAPACITY)
STEPS = 5


@dataclass(frozen=True)
class CompiledVariant:
    key: str
    label: str
    apply: Callable[[GPT], GPT]
    compiled: bool = True
    functorch: dict = field(default_factory=dict)  # torch._functorch.config patched while compiling


def _tracedac(*policies) -> Callable[[GPT], GPT]:
    def apply(model: GPT) -> GPT:
        for i, block in enumerate(model.blocks):
            tracedac.checkpoint(block, policy=policies[i % len(policies)])
        return model

    return apply


P = tracedac.policies
VARIANTS: tuple[CompiledVariant, ...] = (
    CompiledVariant("none", "no checkpoint", _no_checkpoint),
    CompiledVariant("torch", "torch checkpoint", _torch_checkpoint),
    CompiledVariant("torch_sac", "torch selective (matmuls)", _torch_selective),
    CompiledVariant(
        "torch_budget",
        "torch activation_memory_budget=0.5",
        _no_checkpoint,
        functorch={"activation_memory_budget": 0.5},
    ),
    CompiledVariant("tracedac_recompute_all", "tracedac recompute_all", _tracedac(P.recompute_all())),
    CompiledVariant("tracedac_save_matmuls", "tracedac save_matmuls", _tracedac(P.save_matmuls())),
    CompiledVariant("tracedac_budget", "tracedac memory_budget(0.5)", _tracedac(P.memory_budget(0.5))),
    CompiledVariant(
        "tracedac_mix",
        "tracedac memory_budget 0.25/0.75",
        _tracedac(P.memory_budget(0.25), P.memory_budget(0.75)),
    ),
    CompiledVariant(
        "tracedac_eager", "tracedac recompute_all, eager", _tracedac(P.recompute_all()), compiled=False
    ),
)


def _tokens(model: GPT) -> int:
    return sum(int(r.tokens_per_expert.sum()) for r in model.routers())


def _measure(variant: CompiledVariant, base: GPT, batch, cfg: Config, steps: int, say) -> dict:
    import torch._dynamo
    import torch._functorch.config as functorch_config
    from torch._dynamo.utils import counters

    from tracedac.inspect.compiled import partition

    torch._dynamo.reset()
    counters.clear()
    original = variant.apply(copy.deepcopy(base))
    model = torch.compile(original, fullgraph=True) if variant.compiled else original
    row = {"key": variant.key, "label": variant.label}
    with functorch_config.patch(variant.functorch):
        for r in original.routers():
            r.tokens_per_expert.zero_()
        clear_grads(model)
        start = time.perf_counter()
        seeded_step(model, batch, cfg.seed)  # compiles
        row["compile_s"] = time.perf_counter() - start if variant.compiled else None
        row["tokens_counted"] = _tokens(original)
        row["graph_breaks"] = sum(counters["graph_break"].values()) if variant.compiled else None
        row["grads"] = {n: p.grad.detach().clone() for n, p in original.named_parameters()}
        row["step_s"] = statistics.median(_timed_step(model, batch, cfg, rep) for rep in range(steps))
        row["bytes_held"] = _held_after_forward(model, batch, cfg.seed, torch.device("cpu"))
        say(f"{variant.label}: compiled in {row['compile_s'] or 0:.1f}s, step {row['step_s']:.3f}s")
        if variant.compiled:
            parts = partition(original, *batch)
            row["replay_flops"] = sum(p.replay_flops for p in parts)
            row["saved_bytes"] = sum(p.saved_bytes for p in parts)
        else:
            report = tracedac.saved_report(original, *batch)
            row["replay_flops"] = report.replay_flops
            row["saved_bytes"] = report.kept_bytes
    clear_grads(model)
    torch._dynamo.reset()
    return row


def _timed_step(model, batch, cfg: Config, rep: int) -> float:
    """Seconds of timed step ``rep`` (its own seed) from cleared gradients."""
    clear_grads(model)
    start = time.perf_counter()
    seeded_step(model, batch, cfg.seed + 1 + rep)
    return time.perf_counter() - start


# The variants the step-time targets compare, timed again taking turns (``_in_turns``).
IN_TURNS = ("none", "torch", "torch_sac", "tracedac_recompute_all", "tracedac_save_matmuls", "tracedac_eager")


def _in_turns(base: GPT, batch, cfg: Config, steps: int, say) -> dict[str, list]:
    """Step times of the ``IN_TURNS`` variants, all compiled (again) and alive at once and
    stepped in turns (``child.time_in_turns``): measured one after the other, a drift of the
    machine between two variants' minutes showed as a ratio (1.12x for recompute_all against
    torch's checkpoint in one run, 1.01x in turns). Their guards tell them apart (a policy,
    ``checkpoint_fn``), so none runs another's code; torch's budget variant, whose difference
    is a compiler setting no guard sees, is not among them. A recompile while timing is an
    error: it would be timed."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from .child import time_in_turns

    torch._dynamo.reset()
    variants = {v.key: v for v in VARIANTS if v.key in IN_TURNS}
    say(f"step times in turns: {len(variants)} variants compiled again")
    models = {}
    with torch._dynamo.config.patch(recompile_limit=4 * len(variants)):
        for key, v in variants.items():
            original = v.apply(copy.deepcopy(base))
            models[key] = torch.compile(original, fullgraph=True) if v.compiled else original
            seeded_step(models[key], batch, cfg.seed)  # compiles: a recompile of the model's code
            clear_grads(models[key])
        frames = counters["frames"]["total"]

        times = time_in_turns(
            list(models),
            steps,
            lambda key, rep: _timed_step(models[key], batch, cfg, rep),
            say,
            "step times in turns",
        )
        if counters["frames"]["total"] != frames:
            raise RuntimeError(
                "a variant recompiled while the step times were taken in turns: its times include "
                "a compile. Report this with the bench's output."
            )
    for m in models.values():
        clear_grads(m)
    torch._dynamo.reset()
    return times


def _equal_bytes(curve: dict, who: str = "tracedac, one region") -> float | None:
    """tracedac memory_budget(0.5)'s replay FLOPs over torch's at the same bytes saved (``who``:
    the one-region point, the same scope as torch's budget, or the per-block one)."""
    ((_, nbytes, flops),) = [p for p in curve[who] if p[0] == 0.5]
    theirs = frontier.at_bytes(curve["torch"], nbytes)
    if theirs is None:
        return None
    return flops / theirs if theirs else (1.0 if flops == 0 else float("inf"))


def _targets(rows: dict, curve: dict) -> list[dict]:
    def ratio(a, b, f):
        x, y = rows.get(a, {}).get(f), rows.get(b, {}).get(f)
        return None if x is None or not y else x / y

    breaks = [
        r.get("graph_breaks") for k, r in rows.items() if k.startswith("tracedac_") and k != "tracedac_eager"
    ]
    out = [
        target(
            "graph breaks, tracedac variants",
            float(max(breaks)) if breaks and None not in breaks else None,
            0,
            "",
        ),
        target(
            "tracedac recompute_all held / torch checkpoint",
            ratio("tracedac_recompute_all", "torch", "bytes_held"),
            1.00,
        ),
        target(
            "tracedac recompute_all step / torch checkpoint",
            ratio("tracedac_recompute_all", "torch", "step_s"),
            1.02,
        ),
        target(
            "tracedac save_matmuls held / torch selective",
            ratio("tracedac_save_matmuls", "torch_sac", "bytes_held"),
            1.00,
        ),
        target(
            "tracedac save_matmuls step / torch selective",
            ratio("tracedac_save_matmuls", "torch_sac", "step_s"),
            1.02,
        ),
        target(
            "tracedac memory_budget(0.5) saved / no checkpoint saved",
            ratio("tracedac_budget", "none", "saved_bytes"),
            0.5,
        ),
        target(
            "tracedac memory_budget(0.5) replay FLOPs / torch activation_memory_budget=0.5",
            ratio("tracedac_budget", "torch_budget", "replay_flops"),
            1.0,
        ),
        target(
            "tracedac memory_budget(0.5), one region, replay FLOPs / torch's budget curve at the same bytes",
            _equal_bytes(curve),
            1.0,
        ),
        target(
            "tracedac recompute_all compiled step / eager",
            ratio("tracedac_recompute_all", "tracedac_eager", "step_s"),
            0.85,
        ),
    ]
    return out


def run(cfg: Config, *, steps: int = STEPS, quick: bool = False, progress=None) -> dict:
    cfg = QUICK if quick else replace(cfg, capacity=cfg.capacity or CAPACITY)
    say = Progress(progress)
    base = GPT.seeded(cfg)
    batch = make_batch(cfg)
    probe.keep_freed_memory()
    rows = {}
    for i, v in enumerate(VARIANTS, 1):
        say(f"[{i}/{len(VARIANTS)}] {v.label}")
        # (the step targets' variants are timed in turns below: one step here, for the progress line)
        rows[v.key] = _measure(v, base, batch, cfg, 1 if v.key in IN_TURNS else steps, say)
    for key, times in _in_turns(base, batch, cfg, steps, say).items():
        rows[key]["step_s"] = statistics.median(times)
    say("equal bytes: memory_budget against activation_memory_budget, partitions only")
    curve = frontier.sweep(base, batch, tracedac_budgets=(0.5,))
    reference = rows["none"]["grads"]
    for row in rows.values():
        grads = row.pop("grads")
        row["max_grad_diff"] = max(float((grads[n] - reference[n]).abs().max()) for n in reference)
    true_count = cfg.tokens * cfg.top_k * cfg.layers
    return {
        "config": cfg.__dict__,
        "steps": steps,
        "true_tokens": true_count,
        "rows": list(rows.values()),
        "frontier": curve,
        "targets": _targets(rows, curve),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def format_report(result: dict) -> str:
    header = [
        "variant",
        "graph breaks",
        "compile",
        "step (median)",
        "held after fwd",
        "saved (graph)",
        "replay GFLOP",
        "tokens counted",
        "max |grad diff|",
    ]
    cells = []
    for r in result["rows"]:
        cells.append(
            [
                r["label"],
                "-" if r["graph_breaks"] is None else str(r["graph_breaks"]),
                "-" if r["compile_s"] is None else f"{r['compile_s']:.1f} s",
                f"{r['step_s'] * 1e3:.1f} ms",
                mib(r["bytes_held"]),
                mib(r["saved_bytes"]),
                f"{r['replay_flops'] / 1e9:.3f}",
                f"{r['tokens_counted']} / {result['true_tokens']}",
                f"{r['max_grad_diff']:.2e}",
            ]
        )
    lines = [
        f"torch.compile (inductor, fullgraph=True), fixed-capacity MoE; {result['steps']} timed steps, "
        f"torch {result['torch']}, {result['threads']} threads",
        *table(header, cells),
        "",
        "equal bytes (partitions only): budget, saved, replay GFLOP",
    ]
    curve = result["frontier"]
    for who in ("torch", "tracedac", "tracedac, one region"):
        name = "tracedac, per block" if who == "tracedac" else who
        lines.append(
            f"  {name:20s} " + "  ".join(f"{b:.1f}: {mib(n)} {f / 1e9:.3f}" for b, n, f in curve[who])
        )
    per_block = _equal_bytes(curve, "tracedac")
    lines.append(
        "  per block / torch's curve at the same bytes: "
        + ("-" if per_block is None else f"{per_block:.3f}x")
        + " (each block's input saved at its boundary; outside the blocks, the partitioner's default)"
    )
    for b, planned, least in curve["floor"]:
        lines.append(
            f"  per-block plans at {b:.1f}: {planned / 1e9:.3f} GFLOP by their price; the floor of any "
            f"plan within the same bytes: {least / 1e9:.3f} "
            f"({planned / least if least else float('nan'):.3f}x)"
        )
    lines += ["", GOALS, *(goal_line(t) for t in result["targets"])]
    return "\n".join(lines)
