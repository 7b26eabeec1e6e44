"""``python -m benchmarks --profile``: where a tracedac step's time goes, by torch.profiler.

The bench's MoE model (``model.GPT``; with ``--llama``, ``llama_steps``' Llama-style decoder)
with every block under tracedac ``recompute_all``
(or the plain model, for the baseline), one untimed step, then one profiled step split in
its two halves: the *recorded forward* and the *replaying backward*. For each half:

- wall time of the half (with the device synchronized on both sides);
- **op time**: the CPU time inside aten ops' dispatch (the profiler's self CPU time of
  every ``aten::`` event, summed): what the eager kernels and their dispatch cost on the
  host. On CPU that includes the kernels themselves; on CUDA it is launch cost, and
  ``device_s`` (the kernels' own time on the device) is listed beside it;
- **in the dispatch mode**: the self time of the ``PythonDispatchMode`` events, the
  recorder's Python around each op (its ``aten::`` events then appear twice: the call
  into the mode and the mode's own call of the kernel);
- **replay**: the total time of the ``tracedac::replay`` events (each replay pass, its
  ops included; ``replay.run_pass`` marks them while a profiler runs);
- **outside**: wall minus op time and mode time: Python (the model's, autograd's,
  replay's own bookkeeping) and gaps;
- the ops with most self CPU time, with their counts.

Then, unprofiled, **the floors under the recorded forward**: the forward alone, median of
``FLOOR_REPS`` taken in turns, with each block plain, under torch's checkpoint, under an empty
``TorchDispatchMode``, recorded by ``floors.LeastRecorder`` (the least any recorder written in
Python must do), run warm by tracedac (the block's template, made by the warm-up forwards:
docs/design.md, "The warm path") and recorded by tracedac in full (``tracedac.warm_path(False)``);
its host time (until the Python returns), its thread time (CPU time of this thread: what a
loaded machine disturbs least) and wall time (until the device is done), and the ratios the
issue's goals are about. On a GPU, where the forward is host-bound, what tracedac takes over
the least recorder is what a faster recorder in Python could still win, and the least
recorder's over torch's checkpoint is what only a recorder below Python could.

The same command runs on a GPU machine (``--device cuda``): docs/results.md has its figures on an
H100 and an H200.
"""

from __future__ import annotations

import copy
import functools
import os
import statistics
import time
from dataclasses import asdict

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import tracedac

from .child import time_in_turns
from .floors import under_empty_mode, under_least_recorder
from .llama import DecoderLayer, Llama, LlamaConfig
from .model import GPT, Block, make_batch

__all__ = ["run", "format_report"]

TOP = 12
FLOOR_REPS = 9


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _half(events, wall_s: float, cuda: bool) -> dict:
    ops = [e for e in events if e.key.startswith("aten::")]
    self_cpu = sum(e.self_cpu_time_total for e in ops) / 1e6
    # A Python dispatch mode's handler runs in an event of its own (the recorder's Python)
    mode = [e for e in events if e.key == "PythonDispatchMode"]
    mode_s = sum(e.self_cpu_time_total for e in mode) / 1e6
    replay = [e for e in events if e.key == "tracedac::replay"]
    top = sorted(ops, key=lambda e: e.self_cpu_time_total, reverse=True)[:TOP]
    half = {
        "wall_s": wall_s,
        "op_s": self_cpu,
        "mode_s": mode_s,
        "mode_calls": sum(e.count for e in mode),
        "replay_s": sum(e.cpu_time_total for e in replay) / 1e6,
        "replay_passes": sum(e.count for e in replay),
        "outside_ops_s": wall_s - self_cpu - mode_s,
        "op_calls": sum(e.count for e in ops),
        "top": [{"op": e.key, "calls": e.count, "self_cpu_s": e.self_cpu_time_total / 1e6} for e in top],
    }
    if cuda:
        half["device_s"] = sum(getattr(e, "self_device_time_total", 0) for e in ops) / 1e6
    return half


def _profiled(fn, device):
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        _sync(device)
        start = time.perf_counter()
        out = fn()
        _sync(device)
        wall = time.perf_counter() - start
    return out, _half(prof.key_averages(), wall, device.type == "cuda")


def run(cfg, device: str = "cpu") -> dict:
    """Profile the MoE model (``cfg`` a ``model.Config``) or the Llama-style decoder (a
    ``llama.LlamaConfig``: bf16 on CUDA, as ``--llama`` runs it)."""
    dev = torch.device(device)
    if isinstance(cfg, LlamaConfig):
        base, unit = (
            Llama.seeded(cfg).to(dev, torch.bfloat16 if dev.type == "cuda" else torch.float32),
            DecoderLayer,
        )
    else:
        base, unit = GPT.seeded(cfg).to(dev), Block
    batch = tuple(t.to(dev) for t in make_batch(cfg))
    result = {
        "config": asdict(cfg),
        "device": str(dev),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "compiled_replay": tracedac.replay.compiled.is_enabled(dev),
    }
    for key, model in (
        ("plain", copy.deepcopy(base)),
        ("tracedac", tracedac.wrap(copy.deepcopy(base), unit)),
    ):
        for _ in range(2):  # warm-up (a second for compiled replay: it compiles on the second sight)
            torch.manual_seed(cfg.seed)
            model(*batch).backward()
        torch.manual_seed(cfg.seed)
        loss, forward = _profiled(lambda: model(*batch), dev)
        _, backward = _profiled(loss.backward, dev)
        result[key] = {"forward": forward, "backward": backward}
    result["floors"], result["floors_load"] = _floors(base, unit, batch, dev)
    return result


def _torch_checkpoint(block, x):
    return torch_checkpoint(block, x, use_reentrant=False)


def _each_block(way):
    """``apply(model, unit)``: every ``unit`` block of the model called as ``way(block, x)``."""

    def apply(model, unit):
        for m in model.modules():
            if isinstance(m, unit):
                m.forward = functools.partial(way, m.forward)

    return apply


FLOORS = (  # key, label, apply(model, unit): how the blocks run
    ("plain", "plain (autograd saves)", lambda model, unit: None),
    ("torch", "torch checkpoint", _each_block(_torch_checkpoint)),
    ("empty", "empty TorchDispatchMode", _each_block(under_empty_mode)),
    ("least", "LeastRecorder (least a recorder in Python does)", _each_block(under_least_recorder)),
    ("tracedac", "tracedac recompute_all, warm (its template runs)", tracedac.wrap),
    ("cold", "tracedac recompute_all, recorded (warm path off)", tracedac.wrap),
)
COLD = frozenset(["cold"])  # run with tracedac.warm_path(False)
# The goals of issue 46, on thread time: the warm forward against the floors.
GOALS = (("tracedac", "least", 1.0), ("tracedac", "empty", 1.3))


def _forward(model, batch, cold: bool):
    if not cold:
        return model(*batch)
    before = tracedac.warm_path(False)
    try:
        return model(*batch)
    finally:
        tracedac.warm_path(before)


def _floors(base, unit, batch, dev) -> dict:
    """The forward alone under each of ``FLOORS``, in turns (``child.time_in_turns``): host,
    thread and wall seconds, medians; and the load average before and after."""
    models = {}
    for key, _, apply in FLOORS:
        models[key] = copy.deepcopy(base)
        apply(models[key], unit)
        for _ in range(2):  # warm-up forwards (the first makes a region's template)
            _forward(models[key], batch, key in COLD)

    def timed_forward(key, rep):
        _sync(dev)
        start, cpu = time.perf_counter(), time.thread_time()
        loss = _forward(models[key], batch, key in COLD)
        returned, thread = time.perf_counter(), time.thread_time()
        _sync(dev)
        done = time.perf_counter()
        del loss  # (the least recorder's cannot run backward)
        return returned - start, done - start, thread - cpu

    load = os.getloadavg()[0]
    # one intra-op thread on the CPU: all of a forward's work in this thread, so that its CPU
    # time is the forward's (and no pool's threads wait on a loaded machine's other work)
    threads = torch.get_num_threads()
    if dev.type == "cpu":
        torch.set_num_threads(1)
    try:
        times = time_in_turns(models, FLOOR_REPS, timed_forward, lambda _: None)
    finally:
        torch.set_num_threads(threads)
    floors = {
        key: {
            "host_s": statistics.median(h for h, _, _ in t),
            "wall_s": statistics.median(w for _, w, _ in t),
            "thread_s": statistics.median(c for _, _, c in t),
        }
        for key, t in times.items()
    }
    return floors, (load, os.getloadavg()[0])  # (and the load average before and after)


def format_report(r: dict) -> str:
    lines = [
        f"profile on {r['device']} ({r['threads']} threads, torch {r['torch']}), "
        f"compiled replay {'on' if r['compiled_replay'] else 'off'}; model {r['config']}",
        "",
    ]
    lines.append(
        "| run | half | wall ms | in aten ops ms | in dispatch mode ms (calls) | replay passes ms (n) "
        "| outside ms | aten events |" + (" device ms |" if "device_s" in r["plain"]["forward"] else "")
    )
    lines.append(
        "|---|---|---|---|---|---|---|---|" + ("---|" if "device_s" in r["plain"]["forward"] else "")
    )
    for key in ("plain", "tracedac"):
        for half in ("forward", "backward"):
            h = r[key][half]
            row = (
                f"| {key} | {half} | {h['wall_s'] * 1e3:.1f} | {h['op_s'] * 1e3:.1f} | "
                f"{h['mode_s'] * 1e3:.1f} ({h['mode_calls']}) | "
                f"{h['replay_s'] * 1e3:.1f} ({h['replay_passes']}) | "
                f"{h['outside_ops_s'] * 1e3:.1f} | {h['op_calls']} |"
            )
            if "device_s" in h:
                row += f" {h['device_s'] * 1e3:.1f} |"
            lines.append(row)
    for half in ("forward", "backward"):
        lines += [
            "",
            f"tracedac {half}: ops with most self CPU time",
            "| op | calls | self CPU ms |",
            "|---|---|---|",
        ]
        lines += [
            f"| {t['op']} | {t['calls']} | {t['self_cpu_s'] * 1e3:.2f} |" for t in r["tracedac"][half]["top"]
        ]
    f, ops = r["floors"], r["tracedac"]["forward"]["mode_calls"]
    before, after = r.get("floors_load", (float("nan"), float("nan")))
    lines += [
        "",
        f"the forward alone, each block under each floor (median of {FLOOR_REPS}, in turns; on the CPU "
        "one intra-op thread; host: until the Python returns, thread: this thread's CPU time, wall: "
        f"until the device is done; load average {before:.1f} before, {after:.1f} after, on "
        f"{os.cpu_count()} CPUs)",
        "| forward | host ms | thread ms | wall ms | thread / plain | thread / empty mode |",
        "|---|---|---|---|---|---|",
    ]
    for k, label, _ in FLOORS:
        t = f[k]
        lines.append(
            f"| {label} | {t['host_s'] * 1e3:.1f} | {t['thread_s'] * 1e3:.1f} | {t['wall_s'] * 1e3:.1f} | "
            f"{t['thread_s'] / f['plain']['thread_s']:.2f}x | {t['thread_s'] / f['empty']['thread_s']:.2f}x |"
        )
    names = {k: label.split(" (")[0] for k, label, _ in FLOORS}
    lines.append("ratios (thread time):")
    for a, b, goal in GOALS:
        ratio = f[a]["thread_s"] / f[b]["thread_s"]
        verdict = "met" if ratio <= goal else "missed"
        lines.append(f"  {names[a]} / {names[b]}: {ratio:.2f}x (goal <= {goal:.2f}x: {verdict})")
    for a, b in (("cold", "least"), ("cold", "empty"), ("tracedac", "cold"), ("tracedac", "torch")):
        lines.append(f"  {names[a]} / {names[b]}: {f[a]['thread_s'] / f[b]['thread_s']:.2f}x")
    for key in ("tracedac", "cold"):
        over = f[key]["host_s"] - f["least"]["host_s"]
        lines.append(
            f"{names[key]}'s host time over the least recorder's: {over * 1e3:+.1f} ms, "
            f"{over / max(ops, 1) * 1e6:+.1f} us for each of its {ops} recorded ops"
        )
    return "\n".join(lines)
