"""``python -m benchmarks --planners``: tracedac's ``memory_budget`` against torch.compile's
``activation_memory_budget``, budget by budget, on a small Llama (``llama.py``).

Every variant starts from a deep copy of one seeded model and runs on one batch; each
``DecoderLayer`` is the checkpointed region (tracedac) or the compiled graph (torch). The
figures, per budget b in 0.0, 0.1, ..., 1.0:

tracedac (``tracedac.wrap(model, DecoderLayer, policy=memory_budget(b))``)

- **alloc kept**: read at the allocator (``probe.allocated_bytes``), never from tracedac.
  In a child interpreter run with ``PYTHONMALLOC=malloc`` (so Python bookkeeping, such as
  a recorded graph, is counted beside tensors: see ``checkpointing._checks_in_child``),
  after one untimed step (plans are cached from the second step on), the layers run alone
  on a leaf input made before the first reading. Bytes kept = after - before - the bytes of
  each layer's output: the last is what the forward returns, the others are the next
  layer's input, alive in every variant and outside every budget (a budget counts what a
  region computes and autograd saves, not its inputs). ``of it Py`` is the part that is
  Python objects, by ``tracemalloc`` in a forward of its own.
- **tensors**: the same forward's tensor bytes alone: the net of the profiler's allocation
  events (``_tensor_held``), the layers' outputs excluded. This is the figure a budget
  prices; the allocator's figure adds the bookkeeping no budget counts.
- **budget**: b x full, where full is the tensors ``save_all()`` keeps as measured, what the
  regions keep without checkpointing (``alloc budget``: the same with the allocator's
  figure). ``lib kept`` is tracedac's own figure (``trade_off``, summed over the layers).
- Beside the fractions, one row per torch row: ``memory_budget(N)`` with N an int, the
  tensor bytes torch kept at that budget divided by the layers: tracedac at torch's bytes.
- **replay FLOPs**: counted from outside, ``FlopCounterMode`` around the backward, minus
  the backward FLOPs of the model without checkpointing; beside it ``lib FLOPs``, the
  library's ``trade_off(...).replay_flops`` summed over the layers. A mismatch is flagged.
  torch's counter has no formula for the CPU attention kernel; it gets the other SDPA
  kernels' (``_CPU_ATTENTION``), on both sides.
- **step**: median forward + backward time of the whole model (embedding, layers, head,
  loss), variants taking turns within each repetition as in ``checkpointing``.

torch.compile (each ``DecoderLayer`` compiled, fresh per budget after ``torch._dynamo.reset()``,
under ``torch._functorch.config.patch(activation_memory_budget=b)``)

- Backend: ``aot_autograd`` with inductor's decomposition table and the min-cut partitioner
  inductor uses (``min_cut_rematerialization_partition(compiler="inductor")``), the graphs
  run eagerly: the partitioner's decisions are inductor's (inductor also runs its joint-graph
  pattern passes first, which this backend does not), its kernels are not. Inductor works
  here (12-30 s a compile on this 2-core machine) and, checked at budgets 0.2 and 0.5, saves
  the same bytes (3.00 and 7.50 MiB); this backend leaves the backward graph in reach for
  counting what it recomputes, and runs in seconds.
- **held**: the same allocator measure as tracedac's, in the same child; **tensors**: the
  same profiler measure as tracedac's.
- **saved**: the storages the compiled function saves for backward (``saved_tensors_hooks``
  around the layers' forward), deduplicated by storage, without parameters, buffers, the
  layers' inputs and outputs: an independent check of **tensors**.
- **recomputed ops**: forward ops the partitioner placed in the backward graph, i.e. the
  backward graph's ops that depend on no tangent, views and ``getitem`` not counted (tracedac
  does not record views either); **recompute FLOPs**: those nodes' FLOPs by torch's FLOP
  formulas on their shapes (with ``_CPU_ATTENTION``). Both are per run of a backward graph,
  summed over the times it runs in one backward (once per layer).
- **step**: median of ``TORCH_STEPS`` steps right after compiling, in the child
  (``PYTHONMALLOC=malloc``), not interleaved with the rest: an indication only.

torch's budget is a fraction of the range between its own all-recompute and its default
(runtime-optimised, already recomputing cheap pointwise ops) solutions, not of bytes kept
without checkpointing; the same number means different bytes on the two sides, so they are
compared on absolute bytes.

Checks: (a) each tracedac row with a budget keeps no more tensor bytes than it plus
``TENSOR_SLACK_PER_REGION`` per region, and no more allocator bytes than its allocator
budget plus ``SLACK_PER_REGION`` per region (see there for why each). (b) For each torch
row, tracedac at torch's bytes (the int-budget row) keeps no more tensor bytes (within the
tensor slack) and replays no more FLOPs than torch recomputes. (Comparing every pair of
fraction rows instead would ask budget 0.0, which keeps nothing, to replay no more than
torch at 1.0, which keeps 15 MiB; and the fractions' rows fall at other bytes than torch's,
so the nearest one below torch's bytes would be compared with less memory.) A last section
runs 3 steps with no checkpoint and with ``memory_budget(PEAK_BUDGET)`` and reads the peak
of tensor bytes during each forward from the profiler's allocation events (``_forward_peak``).
"""

from __future__ import annotations

import copy
import functools
import gc
import os
import statistics
import sys
import time
import tracemalloc
from dataclasses import asdict
from typing import TextIO

import torch
from torch.utils.flop_counter import FlopCounterMode, flop_registry, sdpa_backward_flop_count, sdpa_flop_count

import tracedac
from tracedac import policies

from . import probe
from .child import (
    GOALS,
    Progress,
    clear_grads,
    conditions_line,
    mark,
    run_child,
    seeded_step,
    table,
    time_in_turns,
)
from .llama import DecoderLayer, Llama, LlamaConfig, make_batch

__all__ = [
    "BUDGETS",
    "PEAK_BUDGET",
    "QUICK",
    "QUICK_BUDGETS",
    "SLACK_PER_REGION",
    "STEPS",
    "TENSOR_SLACK_PER_REGION",
    "child_measure",
    "format_report",
    "run",
]

# A model that finishes every section in seconds: for tests and for checking a set-up.
QUICK = LlamaConfig(vocab=64, layers=2, dim=32, heads=2, mlp_hidden=96, batch=2, seq=16)
BUDGETS = tuple(i / 10 for i in range(11))
QUICK_BUDGETS = (0.0, 0.5, 1.0)
# Allowed above the budget per region, in tensor bytes: a region that will replay an op
# torch tags nondeterministic_seeded (here the CPU attention kernel, for its dropout
# argument) keeps its generator's state, a 5,056-byte uint8 tensor on CPU: a tensor, but no
# activation, and no budget prices it. recompute_all's row shows it.
TENSOR_SLACK_PER_REGION = 8 << 10
# Allowed above the budget per region, in allocator bytes: the recorded graph and the
# handles autograd holds are Python and C++ objects the allocator counts (PYTHONMALLOC=malloc)
# but no budget does, since a budget prices tensors. recompute_all's row, which keeps no
# tensor a region computed, shows what they weigh; no checkpoint's graph weighs about as much.
SLACK_PER_REGION = 128 << 10
PEAK_BUDGET = 0.3
STEPS = 3  # default timed steps per tracedac variant
TORCH_STEPS = 2  # timed steps per torch.compile budget: eager graphs, an indication only
PEAK_STEPS = 3
_SEED = 7  # torch.manual_seed before each step; nothing here is random, it is for good measure


def _cpu_attention_flops(query, key, value, *args, **kwargs) -> int:
    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _cpu_attention_backward_flops(grad_out, query, key, value, *args, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


_cpu_attention_flops._get_raw = _cpu_attention_backward_flops._get_raw = True  # they take tensors, not shapes
# torch's FLOP counter has no formula for the CPU flash-attention kernels (it counts 0); they
# do the work of the other SDPA kernels, so they get those kernels' formulas. tracedac's own
# accounting does the same (graph.op_flops).
_CPU_ATTENTION = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward_flops,
}


def _flop_counter() -> FlopCounterMode:
    return FlopCounterMode(display=False, custom_mapping=_CPU_ATTENTION)


# --- variants ------------------------------------------------------------------------------


def _variants(budgets, matched=()) -> list[dict]:
    """tracedac's rows: three references, one per budget, then one per torch row at the bytes
    it kept (``matched``: pairs of torch's budget and bytes per region)."""
    rows = [
        {"key": "none", "label": "no checkpoint", "spec": "none", "budget": None},
        {"key": "save_all", "label": "save_all()", "spec": "save_all", "budget": None},
        {"key": "recompute_all", "label": "recompute_all()", "spec": "recompute_all", "budget": None},
    ]
    rows += [
        {"key": f"budget_{b:.2f}", "label": f"memory_budget({b:.1f})", "spec": b, "budget": b}
        for b in budgets
    ]
    rows += [
        {
            "key": f"match_{b:.2f}",
            "label": f"memory_budget({n}) [torch {b:.1f}]",
            "spec": ("bytes", n),
            "budget": None,
            "region_bytes": n,
        }
        for b, n in matched
    ]
    return rows


def _policy(spec):
    if spec == "save_all":
        return policies.save_all()
    if spec == "recompute_all":
        return policies.recompute_all()
    if isinstance(spec, tuple):  # ("bytes", n): an int budget
        return policies.memory_budget(int(spec[1]))
    return policies.memory_budget(float(spec))


def _build(base: Llama, spec) -> Llama:
    model = copy.deepcopy(base)
    if spec != "none":
        tracedac.wrap(model, DecoderLayer, policy=_policy(spec))
    return model


def _layer_inputs(base: Llama, batch) -> list[torch.Tensor]:
    """What each layer of the plain model receives, as leaves that require grad."""
    with torch.no_grad():
        x = base.embed(batch[0])  # [B, T, D]
        inputs = []
        for layer in base.layers:
            inputs.append(x.detach().requires_grad_())
            x = layer(x)
    return inputs


def _first_input(cfg: LlamaConfig, device: torch.device) -> tuple[Llama, tuple, torch.Tensor]:
    """The seeded model and the batch on ``device``, and what the first layer receives from
    the embedding, as a leaf that requires grad."""
    base = Llama.seeded(cfg).to(device)
    batch = tuple(t.to(device) for t in make_batch(cfg))
    with torch.no_grad():
        x = base.embed(batch[0])  # [B, T, D]
    return base, batch, x.detach().requires_grad_()


# --- memory, in the child interpreter -----------------------------------------------------


def _run_layers(model: Llama, x: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's output; called one by one so no hook is needed to see them."""
    outs = []
    for layer in model.layers:
        x = layer(x)
        outs.append(x)
    return outs


def _finish(model: Llama, x: torch.Tensor, outs: list[torch.Tensor]) -> None:
    outs[-1].sum().backward()
    x.grad = None
    clear_grads(model)


def _held(model: Llama, x: torch.Tensor, device: torch.device) -> int:
    """Allocator bytes the layers' forward left behind, without the layers' outputs."""
    gc.collect()
    before = probe.allocated_bytes(device)
    outs = _run_layers(model, x)
    gc.collect()
    held = probe.allocated_bytes(device) - before
    held -= sum(o.untyped_storage().nbytes() for o in outs)
    _finish(model, x, outs)
    return held


def _allocation_events(prof) -> list[int]:
    """Sizes of the profiler's allocation events in time order (a free is negative)."""
    from torch._C._profiler import _EventType

    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == _EventType.Allocation:
            events.append((e.start_time_ns, e.extra_fields.alloc_size))
    return [size for _, size in sorted(events)]


def _tensor_held(model: Llama, x: torch.Tensor) -> int:
    """Tensor bytes the layers' forward left allocated, without the layers' outputs.

    The net of the profiler's allocation events over the forward: every storage torch's CPU
    allocator handed out and did not get back, and nothing else (no Python or C++ objects).
    """
    gc.collect()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        outs = _run_layers(model, x)
    held = sum(_allocation_events(prof)) - sum(o.untyped_storage().nbytes() for o in outs)
    _finish(model, x, outs)
    return held


def _python_held(model: Llama, x: torch.Tensor) -> int:
    """Bytes of Python objects the layers' forward left alive (a part of ``_held``'s figure)."""
    gc.collect()
    tracemalloc.start()
    try:
        outs = _run_layers(model, x)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    _finish(model, x, outs)
    return held


def _saved_bytes(model: Llama, x: torch.Tensor) -> int:
    """Bytes of the storages autograd saves in the layers' forward, parameters, buffers and
    the layers' inputs and outputs left out, each storage once."""
    saved: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        saved[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outs = _run_layers(model, x)
    outside = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers(), x, *outs)}
    _finish(model, x, outs)
    return sum(n for ptr, n in saved.items() if ptr not in outside)


class _Partitioned:
    """An ``aot_autograd`` backend that runs the min-cut partitioner at the current
    ``activation_memory_budget``, runs the graphs eagerly, and counts, per backward graph,
    the forward ops placed in it and their FLOPs, times the runs of that graph."""

    def __init__(self):
        self.recomputed_ops = 0
        self.recompute_flops = 0

    def backend(self):
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_func
        from torch._functorch.partitioners import min_cut_rematerialization_partition
        from torch._inductor.compile_fx import select_decomp_table

        def forward(gm, example_inputs):
            return make_boxed_func(gm.forward)

        def backward(gm, example_inputs):
            ops, flops = _recomputed(gm.graph)
            run = make_boxed_func(gm.forward)

            def counted(args):
                self.recomputed_ops += ops
                self.recompute_flops += flops
                return run(args)

            counted._boxed_call = True
            return counted

        return aot_autograd(
            fw_compiler=forward,
            bw_compiler=backward,
            decompositions=select_decomp_table(),
            partition_fn=functools.partial(min_cut_rematerialization_partition, compiler="inductor"),
        )

    def reset(self) -> None:
        self.recomputed_ops = self.recompute_flops = 0


def _recomputed(graph) -> tuple[int, int]:
    """Non-view ops of a backward graph that depend on no tangent, and their FLOPs."""
    from torch.fx.node import map_arg

    from_tangents = {n for n in graph.nodes if n.op == "placeholder" and n.name.startswith("tangents")}
    ops = flops = 0
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if any(a in from_tangents for a in node.all_input_nodes):
            from_tangents.add(node)
            continue
        target = node.target
        if not isinstance(target, torch._ops.OpOverload) or target.is_view:
            continue  # getitem, views: no compute
        ops += 1
        if target.overloadpacket in flop_registry or target.overloadpacket in _CPU_ATTENTION:
            args, kwargs = map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
            with _flop_counter() as counter:
                target(*args, **kwargs)  # on the graph's fake tensors: shapes only
            flops += counter.get_total_flops()
    return ops, flops


def _compiled(base: Llama, partitioned: _Partitioned) -> Llama:
    """A copy of ``base`` whose layers torch.compile partitions on first call, at the
    ``activation_memory_budget`` in force then."""
    torch._dynamo.reset()  # forget the previous budget's graphs
    model = copy.deepcopy(base)
    for layer in model.layers:
        layer.compile(backend=partitioned.backend())
    return model


def _measure_tracedac(cfg: LlamaConfig, budgets, matched, device: torch.device, say) -> dict[str, dict]:
    base, batch, x = _first_input(cfg, device)
    found = {}
    variants = _variants(budgets, matched)
    for i, v in enumerate(variants, 1):
        say(f"[{i}/{len(variants)}] tracedac {v['label']}: bytes kept")
        model = _build(base, v["spec"])
        seeded_step(model, batch, _SEED)  # the first step plans; the measured one uses the cached plan
        clear_grads(model)
        found[v["key"]] = {
            "status": "ok",
            "bytes_kept": _held(model, x, device),
            "python_bytes": _python_held(model, x),
            "tensor_bytes": _tensor_held(model, x),
        }
    return found


def _measure_torch(cfg: LlamaConfig, budgets, steps: int, device: torch.device, say) -> dict[str, dict]:
    """Bytes held and saved, recomputed ops and FLOPs, and step times, per budget.

    Timed here, in the child, right after each compile, at most ``TORCH_STEPS`` steps:
    timing in the parent would compile every budget a second time. The graphs run eagerly,
    so the figure is what the partitioner's choice costs, not what inductor's kernels would.
    """
    steps = min(steps, TORCH_STEPS)
    base, batch, x = _first_input(cfg, device)
    partitioned = _Partitioned()
    found = {}
    for i, b in enumerate(budgets, 1):
        say(
            f"[{i}/{len(budgets)}] torch.compile activation_memory_budget={b:.1f}: "
            f"compile, bytes, {steps} steps"
        )
        model = _compiled(base, partitioned)
        # Everything under the budget: were dynamo to recompile here, it would use it.
        with torch._functorch.config.patch(activation_memory_budget=b):
            seeded_step(model, batch, _SEED)  # compiles; later calls run the cached graphs
            clear_grads(model)
            held = _held(model, x, device)
            tensors = _tensor_held(model, x)
            partitioned.reset()
            saved = _saved_bytes(model, x)  # one forward and one backward
            found[f"{b:.2f}"] = {
                "bytes_held": held,
                "tensor_bytes": tensors,
                "bytes_saved": saved,
                "recomputed_ops": partitioned.recomputed_ops,
                "recompute_flops": partitioned.recompute_flops,
                "step_times_s": [],
            }
            for _ in range(steps):
                gc.collect()
                start = time.perf_counter()
                seeded_step(model, batch, _SEED)
                found[f"{b:.2f}"]["step_times_s"].append(time.perf_counter() - start)
                clear_grads(model)
    torch._dynamo.reset()
    return found


def child_measure(spec: dict) -> dict:
    """Entry point of the child interpreter: ``spec`` holds the config, budgets, device, threads."""
    torch.set_num_threads(spec["threads"])
    say = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    cfg, device = LlamaConfig(**spec["config"]), torch.device(spec["device"])
    found = {"torch": {"status": "not asked for (compare_torch=False)"}, "matched": []}
    if spec["compare_torch"]:
        try:
            found["torch"] = _measure_torch(cfg, spec["budgets"], spec["steps"], device, say)
        except Exception as e:  # noqa: BLE001 - a torch.compile failure must not hide tracedac's figures
            found["torch"] = {
                "status": f"torch.compile failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            }
    if "status" not in found["torch"]:
        # tracedac at the bytes each torch row kept, per region: the comparison the target asks
        # for. An int budget of 1 is refused as ambiguous; 0 bytes asks the same.
        per_region = [
            max(0, found["torch"][f"{b:.2f}"]["tensor_bytes"] // cfg.layers) for b in spec["budgets"]
        ]
        found["matched"] = [[b, 0 if n == 1 else n] for b, n in zip(spec["budgets"], per_region)]
    found["tracedac"] = _measure_tracedac(cfg, spec["budgets"], found["matched"], device, say)
    return found


_CHILD = (
    "import json, sys\n"
    "from benchmarks.planners import child_measure\n"
    "json.dump(child_measure(json.loads(sys.argv[1])), sys.stdout)\n"
)


def _measure_in_child(
    cfg: LlamaConfig, budgets, steps: int, device: torch.device, say, compare_torch: bool
) -> dict:
    """``child_measure`` in a fresh interpreter where every allocation goes through glibc."""
    spec = {
        "config": asdict(cfg),
        "budgets": list(budgets),
        "steps": steps,
        "device": str(device),
        "compare_torch": compare_torch,
        "threads": torch.get_num_threads(),
    }
    return run_child(_CHILD, spec, say, "measures bytes kept", "python -m benchmarks --planners --quick")


# --- FLOPs, the library's accounting and time, in this process ----------------------------


def _backward_flops(model: Llama, batch) -> int:
    clear_grads(model)
    torch.manual_seed(_SEED)
    loss = model(*batch)
    with _flop_counter() as counter:
        loss.backward()
    clear_grads(model)
    return counter.get_total_flops()


def _library_rows(base: Llama, batch, variants) -> dict:
    """``trade_off`` per layer on that layer's input, summed over the layers, per variant key
    of each budget row; ``"full"``: the library's bytes kept without checkpointing."""
    planned = [v for v in variants if v["budget"] is not None or "region_bytes" in v]
    budgets = [v["budget"] if v["budget"] is not None else v["region_bytes"] for v in planned]
    total = {v["key"]: {"bytes_kept": 0, "replay_flops": 0, "ops_replayed": 0} for v in planned}
    total["full"] = 0
    for layer, x in zip(base.layers, _layer_inputs(base, batch)):
        rows = tracedac.trade_off(layer, x, budgets=budgets)  # in the order asked, when budgets are given
        total["full"] += rows.full
        for v, row in zip(planned, rows):
            for field in ("bytes_kept", "replay_flops", "ops_replayed"):
                total[v["key"]][field] += int(getattr(row, field))
    return total


def _time_tracedac(models: dict[str, Llama], batch, steps: int, say) -> dict[str, list[float]]:
    """Times of ``steps`` steps per variant, taking turns; each model has run a step already."""
    say(f"timing tracedac: {steps} timed steps per variant, taking turns")

    def timed_step(key, rep):
        start = time.perf_counter()
        seeded_step(models[key], batch, _SEED)
        seconds = time.perf_counter() - start
        clear_grads(models[key])
        return seconds

    return time_in_turns(models, steps, timed_step, say, "timing tracedac")


# --- peak during forward ------------------------------------------------------------------


def _forward_peak(model: Llama, batch) -> int:
    """Peak of tensor bytes allocated during one forward, above where it started.

    Read from the profiler's allocation events (``profile_memory=True``): torch's CPU
    allocator reports every allocation and free of a storage, with its size, in order; the
    running sum's maximum is the peak. Frees of storages made before profiling began are not
    reported, so the figure can only err upwards. Python objects are not seen; glibc keeps no
    peak to read them from.
    """
    clear_grads(model)
    gc.collect()
    torch.manual_seed(_SEED)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        loss = model(*batch)
    level = peak = 0
    for size in _allocation_events(prof):
        level += size
        peak = max(peak, level)
    loss.backward()
    clear_grads(model)
    return peak


def _peaks(base: Llama, batch, steps: int, say) -> dict:
    found = {}
    for key, name, s in (
        ("none", "no checkpoint", "none"),
        ("budget", f"memory_budget({PEAK_BUDGET})", PEAK_BUDGET),
    ):
        say(f"peak during forward: {name}, {steps} steps")
        model = _build(base, s)
        found[key] = {"label": name, "peaks": [_forward_peak(model, batch) for _ in range(steps)]}
    reference = min(found["none"]["peaks"])
    later = found["budget"]["peaks"][1:]
    found["check"] = {
        "name": f"{found['budget']['label']}: forward peak from step 2 on < no-checkpoint forward peak",
        "value": max(later) if later else None,
        "limit": reference,
        "passed": None if not later else max(later) < reference,
    }
    return found


# --- the run ------------------------------------------------------------------------------


def _tracedac_rows(cfg, variants, measured, library, flops, times) -> list[dict]:
    # Full: what the regions keep without checkpointing, the denominator of a fraction budget.
    full, full_tensors = measured["save_all"]["bytes_kept"], measured["save_all"]["tensor_bytes"]
    plain = statistics.median(times["none"])
    rows = []
    for v in variants:
        row = {k: v[k] for k in ("key", "label", "budget", "region_bytes") if k in v}
        row.update(measured[v["key"]])
        row["replay_flops"] = flops[v["key"]]
        row["step_times_s"] = times[v["key"]]
        row["step_s"] = statistics.median(times[v["key"]])
        row["step_vs_none"] = row["step_s"] / plain
        if v["budget"] is None and "region_bytes" not in v:
            rows.append(row)  # a reference: no budget to check
            continue
        row["full_bytes"], row["full_tensor_bytes"] = full, full_tensors
        if v["budget"] is not None:
            row["budget_bytes"] = v["budget"] * full
            row["budget_tensor_bytes"] = v["budget"] * full_tensors
        else:  # an int budget: bytes, the same at the allocator
            row["budget_bytes"] = row["budget_tensor_bytes"] = v["region_bytes"] * cfg.layers
        row["within_budget"] = row["bytes_kept"] <= row["budget_bytes"] + SLACK_PER_REGION * cfg.layers
        row["tensors_within_budget"] = (
            row["tensor_bytes"] <= row["budget_tensor_bytes"] + TENSOR_SLACK_PER_REGION * cfg.layers
        )
        lib = library[v["key"]]
        row.update(
            lib_full_bytes=library["full"],
            lib_bytes_kept=lib["bytes_kept"],
            lib_replay_flops=lib["replay_flops"],
            lib_ops_replayed=lib["ops_replayed"],
            flops_match=lib["replay_flops"] == row["replay_flops"],
        )
        rows.append(row)
    return rows


def _torch_rows(budgets, measured) -> list[dict] | str:
    if "status" in measured:
        return measured["status"]
    rows = []
    for b in budgets:
        row = {"budget": b, **measured[f"{b:.2f}"]}
        row["step_s"] = statistics.median(row["step_times_s"])
        rows.append(row)
    return rows


def _checks(cfg, tracedac_rows, torch_rows) -> list[dict]:
    """(a) per tracedac row with a budget, tensors and allocator bytes within it; (b) per torch
    row, tracedac at the bytes torch kept replays no more FLOPs than torch recomputes."""
    checks = []
    slack, tensor_slack = SLACK_PER_REGION * cfg.layers, TENSOR_SLACK_PER_REGION * cfg.layers
    for row in tracedac_rows:
        if "budget_bytes" not in row:
            continue
        checks.append(
            {
                "name": f"{row['label']}: tensors kept {_mib(row['tensor_bytes'])} <= budget "
                f"{_mib(row['budget_tensor_bytes'])} MiB + {tensor_slack >> 10} KiB",
                "value": row["tensor_bytes"],
                "limit": row["budget_tensor_bytes"] + tensor_slack,
                "passed": row["tensors_within_budget"],
            }
        )
        checks.append(
            {
                "name": f"{row['label']}: allocator bytes kept {_mib(row['bytes_kept'])} <= budget "
                f"{_mib(row['budget_bytes'])} MiB + {slack >> 10} KiB",
                "value": row["bytes_kept"],
                "limit": row["budget_bytes"] + slack,
                "passed": row["within_budget"],
            }
        )
    if not isinstance(torch_rows, list):
        return checks
    by_key = {r["key"]: r for r in tracedac_rows}
    for t in torch_rows:
        row = by_key[f"match_{t['budget']:.2f}"]  # child_measure matches every torch row
        # Tensor bytes on both sides (profiler events): the allocator's figure also counts
        # bookkeeping, which on a small model would outweigh what is being compared.
        fewer = row["tensor_bytes"] <= t["tensor_bytes"] + tensor_slack
        checks.append(
            {
                "name": f"torch budget {t['budget']:.1f}: {_mib(t['tensor_bytes'])} MiB, recompute "
                f"{_gflop(t['recompute_flops'])} GFLOP; tracedac {row['label']}: "
                f"{_mib(row['tensor_bytes'])} MiB, replay {_gflop(row['replay_flops'])} GFLOP",
                "value": row["replay_flops"],
                "limit": t["recompute_flops"],
                "tracedac": row["key"],
                "passed": fewer and row["replay_flops"] <= t["recompute_flops"],
            }
        )
    return checks


def check_settings(cfg: LlamaConfig, steps: int, device: str) -> torch.device:
    """The device, or a ValueError/ProbeUnavailable saying what cannot run, before any work."""
    cfg.check()
    if steps < 1:
        raise ValueError(f"steps must be at least 1 to have a time to report, got {steps}")
    dev = torch.device(device)
    if dev.type != "cpu":
        raise ValueError(
            f"the planner benchmark runs on CPU only (its peak reads CPU allocator events), "
            f"got {device!r}; run it without --device."
        )
    probe.allocated_bytes(dev)  # raises ProbeUnavailable where the allocator cannot be read
    return dev


def run(
    cfg: LlamaConfig = LlamaConfig(),
    *,
    steps: int = STEPS,
    budgets=BUDGETS,
    quick: bool = False,
    progress: TextIO | None = sys.stderr,
    system_malloc: bool = False,
    compare_torch: bool = True,
) -> dict:
    """Run every section and return every figure.

    ``compare_torch=False`` leaves out torch.compile (its compiles take most of a quick run).
    ``quick`` swaps in ``QUICK``, budgets 0, 0.5 and 1, and at most two timed steps: for
    tests and for checking a set-up. Unless ``system_malloc``, timings run with glibc keeping
    freed memory (``probe.keep_freed_memory``); bytes kept come from a child either way.
    """
    if quick:
        cfg, budgets, steps = QUICK, QUICK_BUDGETS, min(steps, 2)
    budgets = tuple(float(b) for b in budgets)
    dev = check_settings(cfg, steps, "cpu")
    say = Progress(progress)
    start = time.perf_counter()
    load = os.getloadavg()[0]
    steady = not system_malloc and probe.keep_freed_memory()
    measured = _measure_in_child(cfg, budgets, steps, dev, say, compare_torch)

    base = Llama.seeded(cfg)
    batch = make_batch(cfg)
    variants = _variants(budgets, measured["matched"])
    say("library accounting: trade_off per layer")
    library = _library_rows(base, batch, variants)
    models = {v["key"]: _build(base, v["spec"]) for v in variants}
    say("replay FLOPs: FlopCounterMode around backward, per variant")
    for model in models.values():
        seeded_step(model, batch, _SEED)  # plan first, as in the measured steps
        clear_grads(model)
    flops = {k: _backward_flops(m, batch) for k, m in models.items()}
    plain = flops["none"]
    flops = {k: f - plain for k, f in flops.items()}
    times = _time_tracedac(models, batch, steps, say)
    del models
    peaks = _peaks(base, batch, 2 if quick else PEAK_STEPS, say)

    tracedac_rows = _tracedac_rows(cfg, variants, measured["tracedac"], library, flops, times)
    torch_rows = _torch_rows(budgets, measured["torch"])
    wall = time.perf_counter() - start
    say(f"finished in {wall:.1f}s")
    return {
        "config": asdict(cfg),
        "budgets": list(budgets),
        "steps": steps,
        "device": str(dev),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "planner": "memory_budget",
        "library": "trade_off",
        "probe": f"{probe.describe(dev)}, child interpreter with PYTHONMALLOC=malloc",
        "torch_backend": "aot_autograd + inductor decompositions + min_cut_rematerialization_partition, "
        "graphs run eagerly (no inductor kernels)",
        "timing_allocator": "glibc keeping freed memory (mallopt)" if steady else "default",
        "slack_per_region": SLACK_PER_REGION,
        "tensor_slack_per_region": TENSOR_SLACK_PER_REGION,
        "plain_backward_flops": plain,
        "tracedac_rows": tracedac_rows,
        "torch_rows": torch_rows,
        "peaks": peaks,
        "checks": _checks(cfg, tracedac_rows, torch_rows) + [peaks["check"]],
        "wall_s": wall,
        "load_average_before": load,
        "cpus": os.cpu_count(),
    }


# --- text ---------------------------------------------------------------------------------


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def _gflop(n) -> str:
    return "-" if n is None else f"{n / 1e9:.3f}"


def _tracedac_cells(row: dict) -> list[str]:
    within = (
        "-"
        if "within_budget" not in row
        else "/".join("yes" if row[k] else "NO" for k in ("tensors_within_budget", "within_budget"))
    )
    lib = row.get("lib_replay_flops")
    lib_cell = "-" if lib is None else _gflop(lib) + ("" if row["flops_match"] else " (!)")
    return [
        row["label"],
        _mib(row.get("budget_tensor_bytes")),
        _mib(row["tensor_bytes"]),
        _mib(row.get("lib_bytes_kept")),
        _mib(row["bytes_kept"]),
        _mib(row["python_bytes"]),
        within,
        _gflop(row["replay_flops"]),
        lib_cell,
        str(row.get("lib_ops_replayed", "-")),
        f"{row['step_s'] * 1e3:.0f} ms",
        f"{row['step_vs_none']:.2f}x",
    ]


def _torch_cells(row: dict) -> list[str]:
    return [
        f"{row['budget']:.1f}",
        _mib(row["bytes_held"]),
        _mib(row["tensor_bytes"]),
        _mib(row["bytes_saved"]),
        str(row["recomputed_ops"]),
        _gflop(row["recompute_flops"]),
        f"{row['step_s'] * 1e3:.0f} ms",
    ]


def format_report(result: dict) -> str:
    """The figures of ``run`` as two tables, the peaks, and the checks with marks."""
    cfg = result["config"]
    out = [
        f"model: Llama-style, {cfg['layers']} layers, dim {cfg['dim']}, {cfg['heads']} heads, "
        f"SwiGLU {cfg['mlp_hidden']}, "
        f"vocab {cfg['vocab']}, batch {cfg['batch']}x{cfg['seq']} tokens; each DecoderLayer is a region",
        f"device {result['device']}, {result['threads']} threads, torch {result['torch']}; "
        f"{result['steps']} timed steps; "
        f"timing allocator: {result['timing_allocator']}; memory: {result['probe']}",
        f"planner: {result['planner']}; library accounting: {result['library']}",
        "",
        "tracedac (MiB; GFLOP; per step, both layers; the layers' outputs excluded)",
    ]
    header = [
        "variant",
        "budget",
        "tensors",
        "lib kept",
        "alloc kept",
        "of it Py",
        "<= budget?",
        "replay FLOPs",
        "lib FLOPs",
        "lib ops",
        "step",
        "vs none",
    ]
    out += table(header, [_tracedac_cells(r) for r in result["tracedac_rows"]])
    row = next((r for r in result["tracedac_rows"] if r.get("full_bytes")), {})
    layers = cfg["layers"]
    out += [
        f"budget = b x {_mib(row.get('full_tensor_bytes'))} MiB, the tensors save_all() keeps "
        f"(library's own full: {_mib(row.get('lib_full_bytes'))}); "
        f"alloc budget = b x {_mib(row.get('full_bytes'))} MiB at the allocator",
        "memory_budget(N) [torch b]: N bytes per region, torch's tensors at its budget b over the layers",
        f"<= budget? tensors <= budget + {result['tensor_slack_per_region'] * layers >> 10} KiB / "
        f"allocator <= alloc budget + {result['slack_per_region'] * layers >> 10} KiB; "
        "(!) FLOPs from outside differ from the library's",
    ]
    odd = [r for r in result["tracedac_rows"] if r.get("flops_match") is False]
    if odd:
        out.append(
            "replay FLOPs from outside != library's at "
            + ", ".join(
                f"{r['label']} ({_gflop(r['replay_flops'])} vs {_gflop(r['lib_replay_flops'])})" for r in odd
            )
        )
    out += ["", f"torch.compile activation_memory_budget ({result['torch_backend']})"]
    if isinstance(result["torch_rows"], str):
        out.append(f"  not run: {result['torch_rows']}")
    else:
        out += table(
            ["budget", "held", "tensors", "saved", "recomputed ops", "recompute FLOPs", "step (child)"],
            [_torch_cells(r) for r in result["torch_rows"]],
        )
    p = result["peaks"]
    out += ["", "peak tensor bytes during forward (profiler allocation events), per step:"]
    for key in ("none", "budget"):
        steps = ", ".join(f"step {i} {_mib(v)} MiB" for i, v in enumerate(p[key]["peaks"], 1))
        out.append(f"  {p[key]['label']}: {steps}")
    out += ["", GOALS]
    for c in result["checks"]:
        out.append(f"  {mark(c['passed'])}  {c['name']}")
    decided = [c["passed"] for c in result["checks"] if c["passed"] is not None]
    out.append(f"overall: {sum(decided)} of {len(decided)} goals met")
    out.append(conditions_line(result))
    return "\n".join(out)
