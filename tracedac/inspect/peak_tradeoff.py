"""The frontier of a whole model: step time against the step's measured peak, for
``policies.peak(b)`` over whole-model budgets beside torch's own options: ``peak_trade_off``.

Where ``trade_off`` plans one recording (bytes kept against replay FLOPs, nothing run again),
this one trains: every variant is a copy of the model that takes real steps (forward, backward,
optimizer), its peak read by a ``Meter`` over a trained step (``policies.meter``: torch.cuda's
allocator statistics, or the CPU's live tensor storages; never tracedac's own figures) and its
step timed. The variants:

- ``no checkpoint``;
- ``torch checkpoint``: ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` around each
  matched module (full recompute);
- ``torch selective``: the same with torch's selective checkpointing saving the matmuls
  (``create_selective_checkpoint_contexts``, ``policies.MATMUL_OPS``);
- ``torch compiled (b)``: each matched module compiled (``compile_backend``) under
  ``activation_memory_budget = b`` for each ``b`` of ``torch_budgets``;
- ``peak(B)``: ``tracedac.wrap(model, match, policy=policies.peak(B))`` for each budget: by
  default eight, evenly spaced from full recompute's measured peak to no checkpointing's.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import statistics
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .._compat import activation_memory_budget
from ..checkpoint import unwrap, wrap
from ..errors import CheckpointError
from ..matching import module_matcher, no_match_error
from ..policies import MATMUL_OPS, peak, recompute_all
from ..policies.meter import Meter, meter_for
from ..record.graph import human_bytes

__all__ = ["PeakRow", "PeakTradeOff", "peak_trade_off"]


@dataclass(frozen=True)
class PeakRow:
    """One variant: its measured peak (bytes) and median step time (seconds)."""

    label: str
    kind: str  # "tracedac" (peak), "least" (tracedac recompute_all), "torch" (eager), "compiled", "none"
    budget: int | float | None  # peak's bytes, or torch's activation_memory_budget
    peak: int | None
    step_s: float | None
    error: str | None = None  # why the variant did not run (a budget below the least, say)


class PeakTradeOff(list):
    """Rows of ``peak_trade_off``, least peak first; ``print`` gives the table, ``plot`` the figure."""

    def __init__(self, rows, meter: str):
        super().__init__(sorted(rows, key=lambda r: (r.peak is None, r.peak or 0, r.step_s or 0)))
        self.meter = meter

    def within(self, nbytes: int, kinds=("tracedac", "least", "torch", "compiled", "none")) -> PeakRow | None:
        """The fastest row of ``kinds`` whose measured peak is at most ``nbytes``, or None."""
        fits = [r for r in self if r.kind in kinds and r.peak is not None and r.peak <= nbytes]
        return min(fits, key=lambda r: r.step_s) if fits else None

    def __str__(self) -> str:
        plain = next((r for r in self if r.kind == "none" and r.step_s), None)
        lines = [f"{'variant':<34} {'peak':>11} {'step ms':>9} {'x none':>7} {'x best torch within':>20}"]
        for r in self:
            if r.error is not None:
                lines.append(f"{r.label:<34} {'-':>11} {'-':>9} {'':>7} {'':>20}  ({r.error})")
                continue
            ratio = f"{r.step_s / plain.step_s:.2f}" if plain else ""
            versus = ""
            if r.kind in ("tracedac", "least"):
                best = self.within(r.peak, ("torch", "compiled", "none"))
                versus = f"{r.step_s / best.step_s:.2f} ({best.label})" if best else "none fits"
            lines.append(
                f"{r.label:<34} {human_bytes(r.peak):>11} {r.step_s * 1e3:>9.1f} {ratio:>7} {versus:>20}"
            )
        lines.append(f"(peak of a trained step: {self.meter})")
        return "\n".join(lines)

    def plot(self, ax=None):
        """Step time against measured peak: tracedac's budgets and torch's compiled budgets as
        lines, torch's eager options and no checkpoint as points; returns the axes."""
        try:
            import matplotlib.pyplot as plt
        except ImportError as e:
            raise ImportError(
                "PeakTradeOff.plot() draws with matplotlib, which is not installed here. Install it "
                "(pip install matplotlib, or tracedac's 'plot' extra), or print() the same rows as a table."
            ) from e
        if ax is None:
            _, ax = plt.subplots(figsize=(6, 4))
        done = [r for r in self if r.error is None]
        for kind, style, name in (
            ("tracedac", "o-", "tracedac peak(b)"),
            ("compiled", "s--", "torch compiled"),
        ):
            rows = [r for r in done if r.kind == kind]
            if rows:
                ax.plot([r.peak / 2**20 for r in rows], [r.step_s * 1e3 for r in rows], style, label=name)
        for r in done:
            if r.kind in ("torch", "none"):
                ax.scatter([r.peak / 2**20], [r.step_s * 1e3], marker="x", s=60, zorder=3)
                ax.annotate(
                    r.label, (r.peak / 2**20, r.step_s * 1e3), textcoords="offset points", xytext=(5, 5)
                )
        ax.set_xlabel("measured peak of a step (MiB)")
        ax.set_ylabel("step time (ms)")
        ax.set_title("step time vs. peak, whole model")
        ax.legend(loc="upper right")
        return ax


def _matched(model: nn.Module, match) -> list[nn.Module]:
    pred, out = module_matcher(match, "peak_trade_off(match=...)"), []

    def visit(prefix: str, module: nn.Module):
        if pred(prefix, module):
            out.append(module)
            return
        for name, child in module.named_children():
            visit(f"{prefix}.{name}" if prefix else name, child)

    visit("", model)
    if not out:
        raise no_match_error(model, f"peak_trade_off() matched no module of {type(model).__name__}")
    return out


def _save_matmuls(ctx, op, *args, **kwargs):
    keep = op.overloadpacket in MATMUL_OPS
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def _torch_checkpointed(model: nn.Module, match, selective: bool) -> nn.Module:
    """Each matched module's forward run through torch's checkpoint (selective: saving matmuls)."""
    context = functools.partial(create_selective_checkpoint_contexts, _save_matmuls) if selective else None
    for module in _matched(model, match):
        forward = module.forward
        extra = {"context_fn": context} if context is not None else {}

        def run(*args, forward=forward, extra=extra, **kwargs):
            return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)

        module.forward = run
    return model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run(model, loss, optimizer, warmup: int, steps: int, meter_of, device, around=contextlib.nullcontext):
    """Train ``model``: ``warmup`` steps, one measured by the meter, ``steps`` timed; (peak, median s)."""
    opt = optimizer(model.parameters())

    def step():
        loss(model).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    with around():
        for _ in range(warmup):
            step()
        gc.collect()
        meter = meter_of(device)
        meter.start()
        try:
            step()
        finally:
            _, most = meter.stop()
        times = []
        for _ in range(steps):
            _sync(device)
            t = time.perf_counter()
            step()
            _sync(device)
            times.append(time.perf_counter() - t)
    return most, statistics.median(times)


def peak_trade_off(
    model: nn.Module,
    match,
    loss,
    *,
    budgets=8,
    steps: int = 3,
    optimizer=None,
    torch_budgets=(0.0, 0.25, 0.5, 0.75, 1.0),
    compile_backend: str | None = "inductor",
    meter=None,
) -> PeakTradeOff:
    """Step time against measured peak for ``model`` under ``policies.peak`` at whole-model
    budgets, beside torch's options (module docstring). ``match`` chooses the regions (as
    ``wrap``: a class, classes, or a predicate), ``loss(model) -> Tensor`` runs a forward.

    ``budgets``: a number of budgets evenly spaced from full recompute's measured peak to no
    checkpointing's (default 8), or the budgets themselves (bytes, or strings with a unit).
    ``steps``: timed steps per variant (the median is reported), after warm-up steps (four:
    ``peak`` measures a step, checks the next, may plan again once) and one measured step.
    ``optimizer``: made from the parameters (default ``torch.optim.AdamW``), so a step's peak
    includes its state. ``torch_budgets``: ``activation_memory_budget`` values for torch's
    compiled variants, each module matched compiled with ``compile_backend`` (None: no compiled
    variants). ``meter``: a ``Meter`` factory ``device -> Meter`` (default
    ``meter_for(device, compiled=True)``: torch.cuda's statistics, or the CPU allocator's profiled
    events, which see compiled code).
    Every variant runs on a deep copy of ``model``, made plain first where tracedac wraps it;
    ``model`` itself is not trained and stays as it is.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"peak_trade_off() takes an nn.Module, got {type(model).__name__}")
    _matched(model, match)  # (refused before anything runs)
    optimizer = optimizer or torch.optim.AdamW
    meter_of = meter or functools.partial(meter_for, compiled=True)
    if isinstance(meter_of, Meter):
        raise TypeError(
            "peak_trade_off(meter=...) takes a factory device -> Meter (each variant gets a fresh one), "
            f"got the meter {meter_of!r}; pass lambda device: your_meter."
        )
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    warmup = 4

    def measure(label, kind, budget, prepare, around=contextlib.nullcontext) -> PeakRow:
        copy_ = prepare(unwrap(copy.deepcopy(model)))  # (a model tracedac wraps: each copy made plain)
        try:
            most, median = _run(copy_, loss, optimizer, warmup, steps, meter_of, device, around)
        except CheckpointError as e:
            return PeakRow(label, kind, budget, None, None, str(e).split(". ")[0])
        finally:
            del copy_
            gc.collect()
        return PeakRow(label, kind, budget, most, median)

    rows = [
        measure("no checkpoint", "none", None, lambda m: m),
        measure("torch checkpoint", "torch", None, lambda m: _torch_checkpointed(m, match, False)),
        measure("torch selective (matmuls)", "torch", None, lambda m: _torch_checkpointed(m, match, True)),
    ]
    least = measure("tracedac recompute_all()", "least", None, lambda m: wrap(m, match, recompute_all()))
    rows.append(least)
    if isinstance(budgets, int):
        low, high = least.peak, rows[0].peak
        budgets = [low + (high - low) * i // max(1, budgets - 1) for i in range(budgets)]
    for b in budgets:
        policy = peak(b)  # (checks the budget)
        label = f"peak({human_bytes(policy.budget)})"
        rows.append(measure(label, "tracedac", policy.budget, lambda m, b=b: wrap(m, match, peak(b))))
    if compile_backend is not None:
        from torch import _dynamo

        for r in torch_budgets:

            def compiled(m, r=r):
                for module in _matched(m, match):
                    module.compile(backend=compile_backend)
                return m

            _dynamo.reset()  # (a graph compiled under another budget must not be reused)
            rows.append(
                measure(
                    f"torch compiled ({r})", "compiled", r, compiled, lambda r=r: activation_memory_budget(r)
                )
            )
        _dynamo.reset()
    return PeakTradeOff(rows, meter_of(device).describe())
