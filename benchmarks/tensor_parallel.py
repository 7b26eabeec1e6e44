"""Tensor and sequence parallel blocks in regions: collectives, bytes held, step time.

``torchrun --nproc-per-node 2 -m benchmarks.tensor_parallel [--quick]`` trains a stack of
MLP blocks (LayerNorm, up, GELU, down, residual) parallelized with torch's
``parallelize_module`` over every rank: ``tp`` splits the hidden layer (``ColwiseParallel``
then ``RowwiseParallel``: an all-reduce per block), ``sp`` adds sequence parallelism (the
LayerNorm on each rank's slice of the tokens; an all-gather before the hidden layer and a
reduce-scatter after). Each block is checkpointed by torch's checkpoint or by tracedac under
``recompute_all``, ``save_matmuls``, ``memory_budget(0.5)`` and
``replay_collectives(recompute_all())``, beside no checkpointing, on the same weights and
batch. Rank 0 prints, per variant: the collectives issued in forward and in backward (counted
at the dispatcher beneath DTensor, ``collectives.CollectiveCounter``), the bytes held after
the forward (glibc's allocator, ``probe.allocated_bytes``, median of the steps), the median
step time (garbage collected before each step) and the largest gradient difference from no
checkpointing.

What it measures is docs/design.md's rule for DTensor's redistributions ("Tensor subclasses"):
tracedac keeps a collective's result and never issues it again, unless the policy is wrapped
in ``replay_collectives``; torch's checkpoint re-runs the block and issues them again."""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .child import leave_ranks, mib, table
from .collectives import CollectiveCounter
from .probe import allocated_bytes

VARIANTS = (
    "none",
    "torch checkpoint",
    "recompute_all",
    "save_matmuls",
    "memory_budget(0.5)",
    "replay_collectives(recompute_all)",
)


class Block(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def plan(kind: str) -> dict:
    """torch's tensor-parallel plan of a ``Block``: ``"tp"`` (Colwise then Rowwise) or ``"sp"``
    (sequence parallel around them: the tokens sharded on dim 0 in and out)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if kind == "tp":
        return {"up": ColwiseParallel(), "down": RowwiseParallel()}
    return {
        "norm": SequenceParallel(),
        "up": ColwiseParallel(input_layouts=Shard(0)),
        "down": RowwiseParallel(output_layouts=Shard(0), use_local_output=False),
    }


def _parallelize(blocks: nn.ModuleList, mesh, kind: str) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    for b in blocks:
        parallelize_module(b, mesh, plan(kind))


def _checkpointed(blocks: nn.ModuleList, variant: str):
    """A function running ``blocks`` checkpointed as ``variant`` says."""
    import tracedac
    from tracedac import policies

    if variant == "torch checkpoint":
        from torch.utils.checkpoint import checkpoint

        def run(x):
            for b in blocks:
                x = checkpoint(b, x, use_reentrant=False)
            return x

        return run
    if variant != "none":
        policy = {
            "recompute_all": policies.recompute_all,
            "save_matmuls": policies.save_matmuls,
            "memory_budget(0.5)": lambda: policies.memory_budget(0.5),
            "replay_collectives(recompute_all)": lambda: policies.replay_collectives(
                policies.recompute_all()
            ),
        }[variant]()
        for b in blocks:
            tracedac.checkpoint(b, policy=policy)

    def run(x):
        for b in blocks:
            x = b(x)
        return x

    return run


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def rank_main(args) -> dict:
    from torch.distributed.tensor import DTensor, Shard, init_device_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    reference = nn.ModuleList(Block(args.dim, 4 * args.dim) for _ in range(args.layers))
    x = torch.randn(args.tokens, args.dim)
    out: dict = {}
    for kind in ("tp", "sp"):
        rows = {}
        for variant in VARIANTS:
            blocks = copy.deepcopy(reference)
            _parallelize(blocks, mesh, kind)
            run = _checkpointed(blocks, variant)

            def inputs(t):
                return DTensor.from_local(t.chunk(world)[rank], mesh, [Shard(0)]) if kind == "sp" else t

            def step(count=None):
                xg = x.clone().requires_grad_()
                blocks.zero_grad()
                gc.collect()  # the last variant's models and graphs gone before the count
                before = allocated_bytes()
                with count[0] if count else _null():
                    loss = _full(run(inputs(xg))).square().mean()
                held = allocated_bytes() - before
                with count[1] if count else _null():
                    loss.backward()
                return held, [xg.grad, *(_full(p.grad) for p in blocks.parameters())]

            counters = (CollectiveCounter(), CollectiveCounter())
            first, grads = step(counters)
            times, held = [], [first]
            for _ in range(args.steps):
                start = time.perf_counter()
                held.append(step()[0])
                times.append(time.perf_counter() - start)
            rows[variant] = {
                "forward": dict(counters[0].ops),
                "backward": dict(counters[1].ops),
                "held": statistics.median(held),
                "step_s": statistics.median(times),
                "grads": grads,
            }
        want = rows["none"].pop("grads")
        for r in rows.values():
            got = r.pop("grads", want)
            r["grad_diff"] = max(float((a - b).abs().max()) for a, b in zip(got, want))
        out[kind] = rows
    return out


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _count(ops: dict) -> str:
    return ", ".join(f"{n.split('.')[-1]} {c}" for n, c in sorted(ops.items())) or "-"


def report(result: dict, args, world: int) -> list[str]:
    lines = [
        f"tensor parallel on {world} gloo ranks: {args.layers} blocks, dim {args.dim}, hidden "
        f"{4 * args.dim}, {args.tokens} tokens; median of {args.steps} steps (rank 0's figures)"
    ]
    for kind, rows in result.items():
        lines += ["", f"{kind}:"]
        base = rows["none"]["step_s"]
        cells = [
            [
                v,
                _count(r["forward"]),
                _count(r["backward"]),
                mib(r["held"]),
                f"{r['step_s'] * 1e3:.1f} ms",
                f"{r['step_s'] / base:.2f}x",
                f"{r['grad_diff']:.1e}",
            ]
            for v, r in rows.items()
        ]
        header = [
            "variant",
            "collectives in forward",
            "in backward",
            "held after fwd",
            "step",
            "vs none",
            "grad diff",
        ]
        lines += table(header, cells)
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.tensor_parallel", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="dim 64, 128 tokens, 2 steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.dim, args.tokens, args.steps = 64, 128, 2
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    torch.set_num_threads(1)
    result = rank_main(args)
    if dist.get_rank() == 0:
        print("\n".join(report(result, args, dist.get_world_size())))
    leave_ranks()  # does not return
    return 0


if __name__ == "__main__":
    sys.exit(main())
