"""``python -m benchmarks --ep``: checkpointing an expert-parallel MoE, collectives counted.

Each rank holds ``experts / ranks`` of every block's experts; a token goes to the ranks of
its ``top_k`` experts and back with ``all_to_all_single_autograd`` (uneven splits, different
on every rank, as routing gives), after an all-to-all of the per-expert counts, as
torchtitan's MoE does. A block is that MoE and a dense MLP, pre-norm, with residuals (no
attention, no dropout: what is measured is the collectives). Every block is checkpointed,
by torch or by tracedac, on a copy of one seeded model, on the same rank-local batch:

- no checkpoint; ``torch.utils.checkpoint`` (``use_reentrant=False``), which runs the
  block's Python again in backward, all-to-alls included;
- torch's selective checkpointing with a torchtitan-style policy: save the results of the
  collectives whose replay would communicate again (``all_to_all_single``,
  ``reduce_scatter_tensor``), with nothing else (the counterpart of tracedac's
  ``recompute_all``, which keeps collectives whatever the policy says) or with the matmuls
  too (tracedac's ``save_matmuls`` list; torchtitan's ``_save_list`` has the matmuls and
  attention and, by default, recomputes every second ``mm``, left out here so that both
  libraries keep the same results);
- tracedac ``recompute_all``, ``save_matmuls`` and ``memory_budget(0.5)``.

Figures, each measured from outside the library:

- **collectives per step**: one forward and one backward per variant under
  ``collectives.CollectiveCounter`` (a dispatch mode counting the process group's ops as
  they run: a replayed collective counts, a saved one handed back does not), rank 0's
  (every rank issues the same collectives).
- **bytes held after forward**: ``probe.allocated_bytes()`` (glibc ``mallinfo2``) after the
  forward minus before it, the loss alive, ``gc.collect()`` first, the least of three
  forwards; in ranks started with ``PYTHONMALLOC=malloc`` and glibc's per-thread cache off
  (``child.run_child``'s set-up), so Python objects (a recorded graph, a checkpoint's
  closures) count beside tensors. The max over ranks.
- **step time**: forward + backward between two barriers (the slowest rank's step), the
  median over the timed steps after an untimed one; variants take turns. In ranks started
  again with CPython's own allocator, glibc keeping freed memory (``probe``); with
  ``--quick``, in the same ranks as the checks (one launch: a quick run checks the set-up).
- **max |grad difference|**: over every parameter's gradient and every rank, from the
  no-checkpoint run.

The ranks are processes this command starts (``--ranks``, 2 by default; one thread each),
joined by a file rendezvous in a temporary directory, each bounded by a timeout.
"""

from __future__ import annotations

import copy
import functools
import gc
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, TextIO

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import _functional_collectives as fc
from torch.utils import checkpoint as torch_checkpoint
from torch.utils.checkpoint import CheckpointPolicy

import tracedac
from tracedac.policies import MATMUL_OPS

from . import probe
from .child import (
    Progress,
    clear_grads,
    mib,
    table,
    target,
    target_lines,
    time_in_turns,
)
from .collectives import CollectiveCounter
from .model import Config
from .ranks import launch, serve

__all__ = ["QUICK", "RANKS", "STEPS", "VARIANTS", "EPModel", "check_settings", "format_report", "run"]

# A run in seconds, for tests and for checking a set-up: 128 tokens a rank on 2 ranks.
QUICK = Config(layers=2, dim=64, experts=4, top_k=2, expert_hidden=128, batch=8, seq=32)
RANKS = 2
STEPS = 6  # default timed steps per variant
TIMEOUT_S = 900.0  # one launch of the ranks, at most; also every collective's timeout
_SEED = 1000  # the step whose collectives, gradients and bytes are measured


# --- the model ------------------------------------------------------------------------------


class Expert(nn.Module):
    def __init__(self, w1: torch.Tensor, w2: torch.Tensor):
        super().__init__()
        self.w1 = nn.Parameter(w1)  # [D, F]
        self.w2 = nn.Parameter(w2)  # [F, D]


class ExpertParallelMoE(nn.Module):
    """Top-k routing to ``experts`` experts; this rank holds ``experts / world`` of them, keyed
    by global index (``experts.2`` on rank 1 of 2, of 4): a checkpoint holds one value per
    key, so each rank's experts need names of their own (``tracedac.zero`` refuses the same
    name on two ranks' expert groups)."""

    def __init__(self, cfg: Config, rank: int, world: int):
        super().__init__()
        self.top_k, self.world = cfg.top_k, world
        self.per = cfg.experts // world
        self.router = nn.Linear(cfg.dim, cfg.experts, bias=False)
        w1 = torch.randn(cfg.experts, cfg.dim, cfg.expert_hidden) / math.sqrt(cfg.dim)  # [E, D, F]
        w2 = torch.randn(cfg.experts, cfg.expert_hidden, cfg.dim) / math.sqrt(cfg.expert_hidden)  # [E, F, D]
        mine = range(rank * self.per, (rank + 1) * self.per)  # drawn whole: the same on every rank
        self.experts = nn.ModuleDict({str(e): Expert(w1[e].clone(), w2[e].clone()) for e in mine})

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, D]
        group = dist.group.WORLD
        weights, experts = self.router(x).softmax(-1).topk(self.top_k, dim=-1)  # [N, K], [N, K]
        weights = weights / weights.sum(-1, keepdim=True)
        order = experts.flatten().argsort(stable=True)  # (token, choice) pairs by expert, so by rank
        token = order // self.top_k  # [N * K]: the token each pair carries
        counts = torch.bincount(experts.flatten(), minlength=self.world * self.per)  # [E]
        # from every rank, how many tokens it sends to each of this rank's experts
        received = fc.all_to_all_single(counts, None, None, group).view(self.world, self.per)
        send = counts.view(self.world, self.per).sum(1).tolist()  # uneven, not the same on every rank
        recv = received.sum(1).tolist()
        tokens = fc.all_to_all_single_autograd(x[token], recv, send, group)  # [M, D]
        # the local expert of each row received: ranks in order, each rank's rows by expert
        local = torch.repeat_interleave(torch.arange(self.per).repeat(self.world), received.flatten())  # [M]
        by_expert = local.argsort(stable=True)
        sizes = torch.bincount(local, minlength=self.per).tolist()
        outs = [
            F.gelu(chunk @ expert.w1) @ expert.w2  # [n_e, D]
            for expert, chunk in zip(self.experts.values(), tokens[by_expert].split(sizes))
        ]
        out = torch.zeros_like(tokens).index_copy(0, by_expert, torch.cat(outs))  # [M, D], as received
        back = fc.all_to_all_single_autograd(out, send, recv, group)  # [N * K, D], in ``order``
        y = back * weights.flatten()[order].unsqueeze(-1)
        return torch.zeros_like(x).index_add(0, token, y)  # [N, D]


class Block(nn.Module):
    """Pre-norm: the expert-parallel MoE, then a dense MLP, each with a residual. The unit
    every variant checkpoints."""

    def __init__(self, cfg: Config, rank: int, world: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.moe = ExpertParallelMoE(cfg, rank, world)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.up = nn.Linear(cfg.dim, cfg.expert_hidden)
        self.down = nn.Linear(cfg.expert_hidden, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, D]
        x = x + self.moe(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class EPModel(nn.Module):
    """``layers`` blocks and a linear head; returns the mean squared error to the targets.
    ``checkpoint_fn``, when set, is called as ``checkpoint_fn(block, x)`` (as ``model.GPT``)."""

    def __init__(self, cfg: Config, rank: int, world: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(cfg, rank, world) for _ in range(cfg.layers))
        self.head = nn.Linear(cfg.dim, 1)
        self.checkpoint_fn = None

    @classmethod
    def seeded(cls, cfg: Config, rank: int, world: int) -> EPModel:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            return cls(cfg, rank, world)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # [N, D], [N]
        for block in self.blocks:
            x = block(x) if self.checkpoint_fn is None else self.checkpoint_fn(block, x)
        return F.mse_loss(self.head(x).squeeze(-1), y)


def make_batch(cfg: Config, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's tokens (``cfg.tokens / world`` of them) and targets."""
    g = torch.Generator().manual_seed(cfg.seed + 1 + rank)
    n = cfg.tokens // world
    return torch.randn(n, cfg.dim, generator=g), torch.randn(n, generator=g)


# --- the variants ---------------------------------------------------------------------------

# The collectives torchtitan's selective policy saves, each with why.
_COLLECTIVES = {
    torch.ops._c10d_functional.all_to_all_single: "replayed, an MoE's dispatch or combine sends again",
    torch.ops._c10d_functional.reduce_scatter_tensor: "replayed, a sequence-parallel reduction sends again",
}


def _save_ops(ops: frozenset):
    """A policy for torch's selective checkpointing: save what ``ops`` return, replay the rest."""

    def policy(ctx, func, *args, **kwargs):
        if func.overloadpacket in ops:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _torch(policy=None) -> Callable[[EPModel], EPModel]:
    def apply(model: EPModel) -> EPModel:
        kwargs = {}
        if policy is not None:
            kwargs["context_fn"] = functools.partial(
                torch_checkpoint.create_selective_checkpoint_contexts, policy
            )
        model.checkpoint_fn = functools.partial(torch_checkpoint.checkpoint, use_reentrant=False, **kwargs)
        return model

    return apply


def _tracedac(policy) -> Callable[[EPModel], EPModel]:
    def apply(model: EPModel) -> EPModel:
        return tracedac.wrap(model, Block, policy=policy)

    return apply


@dataclass(frozen=True)
class Variant:
    key: str
    label: str
    apply: Callable[[EPModel], EPModel]
    tracedac: bool = False


VARIANTS: tuple[Variant, ...] = (
    Variant("none", "no checkpoint", lambda m: m),
    Variant("torch", "torch.utils.checkpoint", _torch()),
    Variant("torch_sac_a2a", "torch selective (all-to-alls)", _torch(_save_ops(frozenset(_COLLECTIVES)))),
    Variant(
        "torch_sac",
        "torch selective (matmuls + all-to-alls)",
        _torch(_save_ops(frozenset(_COLLECTIVES) | frozenset(MATMUL_OPS))),
    ),
    Variant(
        "tracedac_recompute_all",
        "tracedac recompute_all",
        _tracedac(tracedac.policies.recompute_all()),
        True,
    ),
    Variant(
        "tracedac_save_matmuls", "tracedac save_matmuls", _tracedac(tracedac.policies.save_matmuls()), True
    ),
    Variant(
        "tracedac_budget",
        "tracedac memory_budget(0.5)",
        _tracedac(tracedac.policies.memory_budget(0.5)),
        True,
    ),
)


# --- in each rank ---------------------------------------------------------------------------


def _counted_step(model: EPModel, batch, seed: int):
    """(collectives in forward, in backward, gradients) of one step."""
    clear_grads(model)
    torch.manual_seed(seed)
    with CollectiveCounter() as forward:
        loss = model(*batch)
    with CollectiveCounter() as backward:
        loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    clear_grads(model)
    return dict(forward.ops), dict(backward.ops), grads


def _held_after_forward(model: EPModel, batch, seed: int, repeats: int = 3) -> int:
    """The least of ``repeats`` readings. A first-use allocation (a cache filled, a dict
    grown, a buffer gloo keeps) lands in one reading only: with one reading, the same variant
    read tens of KiB apart from rank to rank."""
    readings = []
    for _ in range(repeats):
        clear_grads(model)
        torch.manual_seed(seed)
        gc.collect()
        dist.barrier()
        before = probe.allocated_bytes()
        loss = model(*batch)
        gc.collect()
        readings.append(probe.allocated_bytes() - before)
        loss.backward()
        del loss
    clear_grads(model)
    return min(readings)


def _checks(cfg: Config, rank: int, world: int, say) -> dict[str, dict]:
    """Collectives, gradient difference and bytes held per variant, on this rank."""
    base = EPModel.seeded(cfg, rank, world)
    batch = make_batch(cfg, rank, world)
    found, reference = {}, None
    for i, v in enumerate(VARIANTS, 1):
        say(f"[{i}/{len(VARIANTS)}] {v.label}: collectives, gradients, bytes held")
        model = v.apply(copy.deepcopy(base))
        forward, backward, grads = _counted_step(model, batch, cfg.seed + _SEED)
        if reference is None:
            reference = grads  # no checkpoint: the first variant
        found[v.key] = {
            "forward_collectives": forward,
            "backward_collectives": backward,
            "max_grad_diff": max(float((grads[n] - reference[n]).abs().max()) for n in reference),
            "bytes_held": _held_after_forward(model, batch, cfg.seed + _SEED),
        }
    return found


def _timing(cfg: Config, rank: int, world: int, steps: int, say) -> dict[str, list[float]]:
    """This rank's seconds per timed step, per variant (one untimed step each first)."""
    base = EPModel.seeded(cfg, rank, world)
    batch = make_batch(cfg, rank, world)
    models = {v.key: v.apply(copy.deepcopy(base)) for v in VARIANTS}

    def step(key, seed):
        model = models[key]
        dist.barrier()
        start = time.perf_counter()
        torch.manual_seed(seed)
        model(*batch).backward()
        dist.barrier()  # the step ends when the slowest rank's does
        seconds = time.perf_counter() - start
        clear_grads(model)
        return seconds

    say(f"timing: one untimed step per variant, then {steps} timed")
    for key in models:
        step(key, cfg.seed)
    return time_in_turns(models, steps, lambda key, rep: step(key, cfg.seed + 1 + rep), say)


def rank_main(spec_json: str) -> None:
    """A rank's entry point (``ranks.launch`` starts it, ``ranks.serve`` runs the phases the
    spec names: "checks", "timing" or both; rank 0 prints every rank's figures as JSON)."""
    serve(spec_json, Config, _checks, _timing, TIMEOUT_S)


# --- the launcher ---------------------------------------------------------------------------


def _launch(spec: dict, world: int, say, *, count_python: bool, timeout: float = TIMEOUT_S) -> list:
    """Start ``world`` ranks running ``rank_main(spec)`` and return rank 0's JSON: each rank's
    figures (``ranks.launch``: a failing rank, or a launch past ``timeout``, stops them all)."""
    return launch("benchmarks.ep", spec, world, say, what="--ep", count_python=count_python, timeout=timeout)


def check_settings(cfg: Config, steps: int, world: int) -> None:
    """Raise a ValueError (or ProbeUnavailable) saying what cannot run, before any rank starts."""
    cfg.check()
    if steps < 1:
        raise ValueError(f"steps must be at least 1 to have a time to report, got {steps}")
    if world < 1:
        raise ValueError(f"--ranks must be at least 1, got {world}")
    if cfg.experts % world:
        raise ValueError(
            f"{cfg.experts} experts (--experts) do not spread evenly over {world} ranks; "
            f"use a multiple of {world}."
        )
    if cfg.tokens % world:
        raise ValueError(
            f"{cfg.tokens} tokens (--batch x --seq) do not split into {world} ranks' equal shares; "
            f"use a multiple of {world}."
        )
    probe.allocated_bytes("cpu")  # raises ProbeUnavailable where the allocator cannot be read


def _a2a(counts: dict) -> int:
    return sum(n for op, n in counts.items() if "all_to_all" in op)


def _rows(checks: list[dict], times: list[dict]) -> list[dict]:
    rows = []
    for v in VARIANTS:
        mine = [c[v.key] for c in checks]
        forward, backward = mine[0]["forward_collectives"], mine[0]["backward_collectives"]
        step_times = [max(ts) for ts in zip(*(t[v.key] for t in times))]
        rows.append(
            {
                "key": v.key,
                "label": v.label,
                "tracedac": v.tracedac,
                "forward_collectives": forward,
                "backward_collectives": backward,
                "all_to_alls": [_a2a(forward), _a2a(backward)],
                "other_collectives": sum(forward.values())
                + sum(backward.values())
                - _a2a(forward)
                - _a2a(backward),
                "same_collectives_on_every_rank": all(
                    (c["forward_collectives"], c["backward_collectives"]) == (forward, backward) for c in mine
                ),
                "bytes_held_per_rank": [c["bytes_held"] for c in mine],
                "bytes_held": max(c["bytes_held"] for c in mine),
                "max_grad_diff": max(c["max_grad_diff"] for c in mine),
                "step_times_s": step_times,
                "step_s": statistics.median(step_times),
            }
        )
    plain = rows[0]["step_s"]
    for row in rows:
        row["step_vs_none"] = row["step_s"] / plain
    return rows


def _targets(rows: list[dict]) -> list[dict]:
    by = {r["key"]: r for r in rows}

    def ratio(a: str, b: str, field: str) -> float | None:
        x, y = by[a][field], by[b][field]
        return None if not y else x / y

    plain = sum(by["none"]["all_to_alls"])
    most = max(sum(r["all_to_alls"]) for r in rows if r["tracedac"])
    return [
        target(
            "tracedac save_matmuls bytes held / torch selective (matmuls + all-to-alls)",
            ratio("tracedac_save_matmuls", "torch_sac", "bytes_held"),
            1.00,
        ),
        target(
            "tracedac recompute_all bytes held / torch selective (all-to-alls)",
            ratio("tracedac_recompute_all", "torch_sac_a2a", "bytes_held"),
            1.00,
        ),
        target("all-to-alls per step, tracedac (every policy) / no checkpoint", most / plain, 1.00),
        target(
            "tracedac save_matmuls step time / torch selective (matmuls + all-to-alls)",
            ratio("tracedac_save_matmuls", "torch_sac", "step_s"),
            1.00,
        ),
    ]


def run(
    cfg: Config = Config(),
    *,
    world: int = RANKS,
    steps: int = STEPS,
    quick: bool = False,
    progress: TextIO | None = sys.stderr,
) -> dict:
    """Start the ranks twice (checks with Python objects counted, then timing) and return
    every figure. ``quick``: ``QUICK``, at most two timed steps, and the ranks started once,
    timed where the checks ran (under ``PYTHONMALLOC=malloc``): starting a rank costs seconds
    of CPU (torch, dynamo), most of a quick run, and its times only check the set-up."""
    if quick:
        cfg, steps = QUICK, min(steps, 2)
    check_settings(cfg, steps, world)
    say = Progress(progress)
    start = time.perf_counter()
    load = os.getloadavg()[0]
    spec = {"config": asdict(cfg), "steps": steps}
    say(f"{world} ranks: collectives, gradients and bytes held (PYTHONMALLOC=malloc)")
    if quick:
        found = _launch(dict(spec, phases=["checks", "timing"]), world, say, count_python=True)
        checks, times = [f["checks"] for f in found], [f["timing"] for f in found]
    else:
        checks = [f["checks"] for f in _launch(dict(spec, phases=["checks"]), world, say, count_python=True)]
        say(f"{world} ranks: step times")
        times = [f["timing"] for f in _launch(dict(spec, phases=["timing"]), world, say, count_python=False)]
    rows = _rows(checks, times)
    wall = time.perf_counter() - start
    say(f"finished in {wall:.1f}s")
    return {
        "config": asdict(cfg),
        "tokens_per_rank": cfg.tokens // world,
        "world_size": world,
        "steps": steps,
        "threads_per_rank": 1,
        "torch": torch.__version__,
        "probe": f"{probe.describe('cpu')}, ranks run with PYTHONMALLOC=malloc, max over ranks",
        "timing_allocator": (
            "PYTHONMALLOC=malloc (--quick: timed in the checks' ranks)"
            if quick
            else "CPython's, glibc keeping freed memory (mallopt)"
        ),
        "variants": rows,
        "targets": _targets(rows),
        "wall_s": wall,
        "load_average_before": load,
        "cpus": os.cpu_count(),
    }


# --- text -----------------------------------------------------------------------------------


def _row_cells(row: dict) -> list[str]:
    forward, backward = row["all_to_alls"]
    return [
        row["label"],
        f"{forward} + {backward} = {forward + backward}",
        str(row["other_collectives"]),
        mib(row["bytes_held"]),
        f"{row['step_s'] * 1e3:.0f} ms",
        f"{row['step_vs_none']:.2f}x",
        f"{row['max_grad_diff']:.1e}",
    ]


def format_report(result: dict) -> str:
    """The figures of ``run`` as a table and the goals with marks."""
    cfg = result["config"]
    header = [
        "variant",
        "all-to-alls fwd + bwd",
        "other coll.",
        "held after fwd",
        "step (median)",
        "vs none",
        "max |grad diff|",
    ]
    out = [
        f"model: {cfg['layers']} blocks (expert-parallel MoE + dense MLP), dim {cfg['dim']}, "
        f"{cfg['experts']} experts (top {cfg['top_k']}, width {cfg['expert_hidden']}), "
        f"{cfg['experts'] // result['world_size']} per rank; {result['tokens_per_rank']} tokens a rank",
        f"{result['world_size']} ranks (gloo, CPU), {result['threads_per_rank']} thread each, torch "
        f"{result['torch']}; {result['steps']} timed steps per variant; collectives counted on rank 0 "
        f"at the dispatcher; memory: {result['probe']}; timing allocator: {result['timing_allocator']}",
        "",
        *table(header, [_row_cells(r) for r in result["variants"]]),
        "",
    ]
    if not all(r["same_collectives_on_every_rank"] for r in result["variants"]):
        out += ["note: some ranks issued other collectives than rank 0 (see the JSON)", ""]
    out += target_lines(result)
    return "\n".join(out)
