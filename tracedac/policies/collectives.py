"""Collectives replayed on request (``replay_collectives``), and the ranks' agreement on it.

A region keeps every collective's result under every policy (``decisions.effect``): replay
would send the data again, and every rank of the collective's group would have to replay the
same one at the same point of its backward. ``replay_collectives(policy)`` asks for the other
rule in so many words: ``policy`` may then replay the functional collectives the region
records (an all-gather of sequence parallelism, DTensor's redistributions, an all-to-all),
which backward issues again, as torch's checkpoint does, holding their results no longer.

Then every rank must replay the same ones. At the region's end, once its replay plan is
made, the ranks of each collective's group compare which of the region's collectives of that
group the plan replays (one all-reduce of two integers per group and region call: the price
of the request; the lists themselves are gathered only when they differ), and all refuse
together where they differ (a planner planning from each rank's own bytes, an MoE's uneven
splits), or where a rank could not plan its replay at all. In-place ``torch.distributed``
collectives and ops registered with an effect stay kept: replay cannot redo a write into the
program's tensor, and a registered effect says nothing of how to wait for it.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .._compat import process_group_named
from ..agreements import host_group
from ..errors import CheckpointError
from ..record.decisions import FUNCTIONAL_NAMESPACES, effect
from ..record.tracer import unrecorded
from .held import interning
from .wrappers import Wrapper

__all__ = ["ReplayCollectives", "check_agreement", "replay_collectives", "replayable"]


def replayable(op) -> bool:
    """Whether ``replay_collectives`` lets a policy replay ``op``: a functional collective."""
    return getattr(op, "namespace", None) in FUNCTIONAL_NAMESPACES and effect(op) is not None


@dataclass(frozen=True)
class ReplayCollectives(Wrapper):
    """``policy``, allowed to replay the functional collectives it records (module docstring)."""

    policy: object
    replays_collectives = True  # read by decisions.resolve and the region's end

    def __repr__(self) -> str:
        return f"replay_collectives({self.policy!r})"


@interning
def replay_collectives(policy) -> ReplayCollectives:
    """Let ``policy`` replay the functional collectives a region records: backward issues them
    again and their results are not held (``replay_collectives(recompute_all())`` holds what
    torch's checkpoint holds). Every rank must replay the same ones: checked at each region's
    end, one small collective per group, with an error on every rank where they differ. Eager
    only: under ``torch.compile`` a region keeps its collectives, and this is refused."""
    if isinstance(policy, ReplayCollectives):
        return policy
    if not callable(policy):
        raise TypeError(
            f"replay_collectives() takes a policy (a callable node -> CheckpointPolicy), got {policy!r}"
        )
    return ReplayCollectives(policy)


def _group_name(node) -> str | None:
    for i, a in enumerate(node.op._schema.arguments):
        if a.name == "group_name":
            return node.args[i] if i < len(node.args) else node.kwargs.get("group_name")
    return None


def _signature(plan) -> int:
    """A number every rank computes alike for the same plan (Python's ``hash`` of a string is
    salted per process); -1 for a rank whose plan failed."""
    return -1 if plan is None else zlib.crc32(repr(plan).encode())


def _agree(group, plan) -> list | None:
    """None when every rank of ``group`` has the same ``plan`` (one all-reduce of two
    integers); else every rank's plan (gathered only then, for the message)."""
    on, device = host_group(group, torch.device("cpu"))  # NCCL: its gloo twin (no wait for the GPU)
    sig = _signature(plan)
    both = torch.tensor([sig, -sig], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=on)
    if int(both[0]) == sig and -int(both[1]) == sig:
        return None
    plans = [None] * dist.get_world_size(group)
    dist.all_gather_object(plans, plan, group=on)
    return plans


def check_agreement(graph, replayed: frozenset | None, error: Exception | None = None) -> None:
    """Refuse, on every rank of a group, a region whose replay plan (``replayed``: the node
    indices backward will run) replays other collectives of that group than another rank's;
    ``error``: this rank could not plan its replay at all (every rank then refuses with it)."""
    mine: dict[str, list] = {}
    for node in graph.nodes:
        if effect(node.op) is not None and replayable(node.op):
            name = _group_name(node)
            if name is not None:
                mine.setdefault(name, []).append((node.name, replayed is not None and node.index in replayed))
    for name, plan in sorted(mine.items()):
        group = process_group_named(name)
        with unrecorded():  # the check is not the program's: a region around this one skips it
            plans = _agree(group, None if error is not None else plan)
        if plans is None:
            continue
        rank = dist.get_rank(group)
        failed = next((r for r, p in enumerate(plans) if p is None), None)
        if failed is not None:
            if error is not None:
                return  # this rank's own error is raised by the caller
            raise CheckpointError(
                f"region {graph.name!r}: rank {failed} of group {name!r} could not plan its replay "
                "(its error says why), so this rank stops too rather than wait for it in backward."
            )
        other = next(r for r, p in enumerate(plans) if p != plan)

        def listed(p):
            return [f"{op} #{i}" for i, (op, again) in enumerate(p) if again] or "none"

        raise CheckpointError(
            f"region {graph.name!r} would replay different collectives on different ranks of group "
            f"{name!r}: rank {rank} replays {listed(plan)}, rank {other} {listed(plans[other])} (of "
            f"{len(plan)} and {len(plans[other])} collectives in the region). A replayed collective "
            "must be issued by every rank of its group at the same point of backward, or backward "
            "hangs. The plans differ because the policy decided from what differs between ranks (a "
            "planner plans from each rank's own bytes; an MoE routes different tokens): use a "
            "per-op policy inside replay_collectives (recompute_all(), save_matmuls()), or drop "
            "replay_collectives so that every collective is kept."
        )
