"""One rank of tests/test_refused_collectives_exit.py: a program that catches tracedac's refusal
of a policy that must replay a collective, and then exits as any program does.

Run as ``python -m tests.refused_collectives_rank RANK WORLD DIR DESTROY`` from the checkout's
root: a fresh interpreter whose exit is the interpreter's own (no ``os._exit``, as the suite's
spawned ranks and multiprocessing's children use), so an abort while it finalizes shows in its
exit status. ``DESTROY`` 1 calls ``dist.destroy_process_group()`` before the end, 0 does not.
Each refusal is checked here; the last one is the last thing the rank does before it ends.
"""

from __future__ import annotations

import datetime
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import _functional_collectives as fc
from torch.utils.checkpoint import CheckpointPolicy

import tracedac
from tracedac import CheckpointError, policies

D = 8


def replay_collectives_too(node):
    """A policy that must replay every collective (and would replay anything else)."""
    return CheckpointPolicy.MUST_RECOMPUTE if "c10d" in node.name else CheckpointPolicy.PREFER_RECOMPUTE


class Exchange(nn.Module):
    """Rows sent to the other ranks with uneven splits (an MoE's all-to-all), through a layer,
    and back."""

    def __init__(self, world: int):
        super().__init__()
        self.world = world
        self.lin = nn.Linear(D, D)

    def forward(self, x):  # [world * (world + 1) // 2 * ..., D]
        send = [r + 1 for r in range(self.world)]  # rank r gets r + 1 rows from every rank
        recv = [dist.get_rank() + 1] * self.world
        group = dist.group.WORLD
        rows = fc.all_to_all_single_autograd(x, recv, send, group)  # [world * (rank + 1), D]
        back = fc.all_to_all_single_autograd(F.gelu(self.lin(rows)), send, recv, group)
        return x + back


def all_reduced(x):
    return fc.all_reduce(x * 2, "sum", dist.group.WORLD).sigmoid()


SUMMED: list = []  # what all_reduced_in_place sums over the ranks, as its refusal leaves it


def all_reduced_in_place(x):
    total = x.detach().square().sum(0)  # [D]
    SUMMED.append(total)
    dist.all_reduce(total)  # c10d's in-place collective
    return x * total.rsqrt()


def refused(fn, *args) -> None:
    """``fn`` (a module: checkpointed in place, then unwrapped) checkpointed under a policy that
    must replay its collective: refused, and caught."""
    try:
        tracedac.checkpoint(fn, policy=replay_collectives_too)(*args)
    except CheckpointError as e:
        assert "MUST_RECOMPUTE" in str(e) and "a collective" in str(e), str(e)
    else:
        raise AssertionError(f"{fn} was not refused")
    finally:
        if isinstance(fn, nn.Module):
            tracedac.unwrap(fn)


def tokens(rank: int, world: int) -> torch.Tensor:
    torch.manual_seed(1 + rank)
    return torch.randn(world * (world + 1) // 2, D, requires_grad=True)


def main(rank: int, world: int, tmp: str, destroy: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp}/init",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    torch.manual_seed(0)
    block = Exchange(world)
    x = tokens(rank, world)
    refused(block, x)
    refused(all_reduced, x)
    # The ranks reach the refusal 0.1 s apart, as ranks do: the first one's error must not
    # come before the collective has finished (here, the sum of every rank's statistic).
    time.sleep(0.1 * rank)
    refused(all_reduced_in_place, x)
    want = sum(tokens(r, world).detach().square().sum(0) for r in range(world))
    assert torch.allclose(SUMMED[-1], want), f"rank {rank}: the refused all-reduce had not finished"
    # The regions left nothing half-open: the same block checkpointed under a policy it can
    # carry out gets the gradients of no checkpointing.
    block(x).square().sum().backward()
    want = [x.grad, *(p.grad for p in block.parameters())]
    x.grad = None
    block.zero_grad()
    tracedac.checkpoint(block, policy=policies.recompute_all())(x).square().sum().backward()
    got = [x.grad, *(p.grad for p in block.parameters())]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), "gradients differ"
    tracedac.unwrap(block)
    # The case that aborted at exit, with nothing after it; 0.1 s apart again: a collective
    # nothing waits for is then still running as the first rank ends.
    time.sleep(0.1 * rank)
    refused(block, x)
    print(f"rank {rank} refused 4 regions", flush=True)
    if destroy:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1")
