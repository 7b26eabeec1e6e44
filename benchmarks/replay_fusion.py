"""``python -m benchmarks.replay_fusion``: what compiled replay's exact fusion costs (issue 46).

A tiny Llama (``llama.Llama``, each ``DecoderLayer`` under ``recompute_all``), one copy per way
of replaying: none (no checkpoint), op by op, compiled with exact fusion (the default: inductor
fuses only what gives eager's bits) and compiled fusing all (within rounding). The ways take
turns step by step (``child.time_in_turns``), so a loaded machine's drift falls on each alike,
and each step's **backward thread time** is measured (``time.thread_time``: the replays run
there, and a neighbour's load does not count in it as it does in wall time). Tiny layers make
the host's work per replayed op the cost, as on a GPU, where replay's host time is what
compiled replay saves. Also per way: the largest gradient difference from no checkpointing
(exact fusion and op by op: 0), and compiled replay's counts.

    python -m benchmarks.replay_fusion [--dim 32] [--layers 8] [--steps 40] [--dtype float32]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time

import torch

import tracedac
from tracedac import policies
from tracedac.replay import compiled

from .child import Progress, table, time_in_turns
from .llama import DecoderLayer, Llama, LlamaConfig

__all__ = ["WAYS", "format_report", "main", "run"]

# key -> (label, compiled replay on, fusion)
WAYS = {
    "none": ("no checkpoint", False, "exact"),
    "op_by_op": ("recompute_all, op by op", False, "exact"),
    "exact": ("recompute_all, compiled, exact fusion (the default)", True, "exact"),
    "all": ("recompute_all, compiled, fusing all (within rounding)", True, "all"),
}
WARMUP = 3  # a structure compiles on its second sight: the first two warm-up steps


def run(
    dim: int = 32,
    layers: int = 8,
    steps: int = 40,
    dtype: torch.dtype = torch.float32,
    progress=sys.stderr,
) -> dict:
    say = Progress(progress)
    cfg = LlamaConfig(vocab=64, layers=layers, dim=dim, heads=2, mlp_hidden=2 * dim, batch=2, seq=16)
    base = Llama.seeded(cfg).to(dtype)
    ids = torch.randint(cfg.vocab, (cfg.batch, cfg.seq + 1), generator=torch.Generator().manual_seed(1))
    batch = ids[:, :-1], ids[:, 1:]  # [B, T] tokens, their next tokens
    models = {k: copy.deepcopy(base) for k in WAYS}
    for k, model in models.items():
        if k != "none":
            tracedac.wrap(model, DecoderLayer, policies.recompute_all())
    fusion = compiled.fusion()
    compiled.clear()

    def step(key, rep=None):
        _, on, way_fusion = WAYS[key]
        before = tracedac.compiled_replay(on, fusion=way_fusion)
        try:
            models[key].zero_grad(set_to_none=True)
            loss = models[key](*batch)
            start = time.thread_time()
            loss.backward()
            return time.thread_time() - start
        finally:
            tracedac.compiled_replay(before, fusion=fusion)

    grads = {}
    for key in WAYS:
        say(f"replay_fusion: warming up {key}")
        for _ in range(WARMUP):
            step(key)
        grads[key] = [p.grad for p in models[key].parameters()]
    times = time_in_turns(list(WAYS), steps, step, say, "replay_fusion")
    rows = []
    for key, (label, _, _) in WAYS.items():
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(grads[key], grads["none"]))
        rows.append(
            {"key": key, "label": label, "backward_s": statistics.median(times[key]), "max_grad_diff": diff}
        )
    return {
        "config": {"dim": dim, "layers": layers, "steps": steps, "dtype": str(dtype)},
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "rows": rows,
        "compiled_replay": compiled.stats(),
    }


def format_report(r: dict) -> str:
    by = {x["key"]: x for x in r["rows"]}
    cells = [
        [
            x["label"],
            f"{1e3 * x['backward_s']:.2f}",
            f"{x['backward_s'] / by['op_by_op']['backward_s']:.2f}x",
            f"{x['max_grad_diff']:.2e}",
        ]
        for x in r["rows"]
    ]
    lines = [
        f"compiled replay's fusions on a tiny Llama ({r['config']}, torch {r['torch']}, "
        f"{r['threads']} threads): backward thread ms, median of {r['config']['steps']} steps in turns",
        "",
        *table(["way", "backward ms", "vs op by op", "max |grad diff|"], cells),
        "",
        f"exact / all: {by['exact']['backward_s'] / by['all']['backward_s']:.2f}x; "
        f"compiled replay: {r['compiled_replay']}",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.replay_fusion", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--dim", type=int, default=32, help="the layers' width (%(default)s)")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers (%(default)s)")
    ap.add_argument("--steps", type=int, default=40, help="timed steps per way, in turns (%(default)s)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="(%(default)s)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (%(default)s)")
    ap.add_argument("--json", metavar="PATH", help="also write every figure to PATH as JSON")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    r = run(args.dim, args.layers, args.steps, getattr(torch, args.dtype))
    print(format_report(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
