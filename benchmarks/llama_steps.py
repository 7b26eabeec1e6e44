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
  what was allocated before it (weights and batch); not measured on CPU (the main
  benchmark's probe reads CPU memory).
- **max |grad difference|** from the no-checkpoint run of the first step.

The variants: no checkpoint; ``torch.utils.checkpoint``; torch's selective checkpoint
keeping matmuls and attention; tracedac ``recompute_all`` and ``save_matmuls``;
``recompute_all`` with compiled replay (``tracedac.compiled_replay``: on during that
variant's steps only); and ``torch.compile`` over the model with torch's checkpoint.
"""

from __future__ import annotations

import copy
import functools
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, TextIO

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

import tracedac
from tracedac.policies import MATMUL_OPS

from .child import Progress, table, time_in_turns
from .llama import DecoderLayer, Llama, LlamaConfig, make_batch

__all__ = ["CPU", "CUDA", "QUICK", "VARIANTS", "format_report", "run"]

CUDA = LlamaConfig(vocab=32000, layers=8, dim=2048, heads=16, mlp_hidden=5632, batch=4, seq=2048)
CPU = LlamaConfig(vocab=1024, layers=4, dim=256, heads=4, mlp_hidden=704, batch=4, seq=128)
QUICK = LlamaConfig(vocab=64, layers=2, dim=32, heads=2, mlp_hidden=64, batch=2, seq=16)
WARMUP = 3
_SAC_OPS = set(MATMUL_OPS) | {
    torch.ops.aten._scaled_dot_product_flash_attention,
    torch.ops.aten._scaled_dot_product_efficient_attention,
    torch.ops.aten._scaled_dot_product_cudnn_attention,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
}


class _Checkpointed(nn.Module):
    """A layer called through ``fn(layer, x)``: torch's checkpoint functions."""

    def __init__(self, layer: nn.Module, fn: Callable):
        super().__init__()
        self.layer = layer
        self.fn = fn

    def forward(self, x):
        return self.fn(self.layer, x)


def _sac_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    return (
        CheckpointPolicy.MUST_SAVE if func.overloadpacket in _SAC_OPS else CheckpointPolicy.PREFER_RECOMPUTE
    )


def _torch(context_fn=None) -> Callable[[Llama], nn.Module]:
    kwargs = (
        {"use_reentrant": False} if context_fn is None else {"use_reentrant": False, "context_fn": context_fn}
    )
    fn = functools.partial(torch_checkpoint.checkpoint, **kwargs)

    def apply(model: Llama) -> nn.Module:
        model.layers = nn.Sequential(*(_Checkpointed(layer, fn) for layer in model.layers))
        return model

    return apply


def _tracedac(policy) -> Callable[[Llama], nn.Module]:
    return lambda model: tracedac.wrap(model, DecoderLayer, policy=policy)


def _compiled(model: Llama) -> nn.Module:
    return torch.compile(_torch()(model))


@dataclass(frozen=True)
class Variant:
    key: str
    label: str
    apply: Callable[[Llama], nn.Module]
    compiled_replay: bool = False


VARIANTS = (
    Variant("none", "no checkpoint", lambda m: m),
    Variant("torch", "torch checkpoint", _torch()),
    Variant(
        "torch_sac",
        "torch selective (matmuls + attention)",
        _torch(functools.partial(torch_checkpoint.create_selective_checkpoint_contexts, _sac_policy)),
    ),
    Variant("tracedac_recompute_all", "tracedac recompute_all", _tracedac(tracedac.policies.recompute_all())),
    Variant("tracedac_save_matmuls", "tracedac save_matmuls", _tracedac(tracedac.policies.save_matmuls())),
    Variant(
        "tracedac_compiled_replay",
        "tracedac recompute_all, compiled replay",
        _tracedac(tracedac.policies.recompute_all()),
        compiled_replay=True,
    ),
    Variant("torch_compile", "torch.compile, torch checkpoint", _compiled),
)


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
    chosen = [v for v in VARIANTS if variants is None or v.key in variants]
    say = Progress(progress)
    base = Llama.seeded(cfg).to(device=dev, dtype=dtype)
    batch = tuple(t.to(dev) for t in make_batch(cfg))
    models = {v.key: v.apply(copy.deepcopy(base)) for v in chosen}
    by_key = {v.key: v for v in chosen}
    reference = None
    rows = {v.key: {"key": v.key, "label": v.label} for v in chosen}

    def step(key):
        model = models[key]
        before = tracedac.compiled_replay(by_key[key].compiled_replay)
        try:
            for p in model.parameters():
                p.grad = None
            model(*batch).backward()
        finally:
            tracedac.compiled_replay(before)

    for key in models:
        say(f"llama: warming up {key}")
        for _ in range(WARMUP):
            step(key)
        grads = [p.grad.float() for p in models[key].parameters()]
        if key == "none":
            reference = grads
        if reference is not None:
            rows[key]["max_grad_diff"] = max(
                (a - b).abs().max().item() for a, b in zip(grads, reference, strict=True)
            )
        if dev.type == "cuda":
            for p in models[key].parameters():
                p.grad = None
            torch.cuda.synchronize(dev)
            start = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            step(key)
            torch.cuda.synchronize(dev)
            rows[key]["peak_over_weights"] = torch.cuda.max_memory_allocated(dev) - start

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
    return {
        "config": asdict(cfg),
        "device": str(dev),
        "dtype": str(dtype),
        "steps": steps,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "variants": list(rows.values()),
    }


def format_report(r: dict) -> str:
    rows = r["variants"]
    torch_s = next((x["step_s"] for x in rows if x["key"] == "torch"), None)
    cells = []
    for x in rows:
        peak = x.get("peak_over_weights")
        cells.append(
            [
                x["label"],
                f"{x['step_s'] * 1e3:.1f}",
                f"{x['step_s'] / torch_s:.2f}x" if torch_s else "-",
                f"{peak / 2**30:.2f} GiB" if peak is not None else "-",
                f"{x['max_grad_diff']:.2e}" if "max_grad_diff" in x else "-",
            ]
        )
    head = (
        f"Llama-style decoder on {r['device']} ({r['dtype']}, {r['threads']} threads, torch {r['torch']}), "
        f"median of {r['steps']} steps after {WARMUP} warm-up; model {r['config']}"
    )
    return "\n".join(
        [head, ""]
        + table(["variant", "step ms", "vs torch checkpoint", "peak over weights", "max |grad diff|"], cells)
    )
