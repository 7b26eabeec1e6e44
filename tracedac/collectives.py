"""Collectives replayed on request (``replay_collectives``), and the ranks' agreement on it.

A region keeps every collective's result under every policy (``decisions.effect``): replay
would send the data again, and every rank of the collective's group would have to replay the
same one at the same point of its backward. ``replay_collectives(policy)`` asks for the other
rule in so many words: ``policy`` may then replay the functional collectives the region
records (an all-gather of sequence parallelism, DTensor's redistributions, an all-to-all),
which backward issues again, as torch's checkpoint does, holding their results no longer.

Then every rank must replay the same ones. At the region's end, once its replay plan is
made, the ranks of each collective's group compare which of the region's collectives of that
group the plan replays (one ``all_gather_object`` per group and region call: the price of the
request), and all refuse together where they differ: a planner planning from each rank's own
bytes, an MoE's uneven splits. In-place ``torch.distributed`` collectives and ops registered
with an effect stay kept: replay cannot redo a write into the program's tensor, and a
registered effect says nothing of how to wait for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from ._compat import process_group_named
from .decisions import FUNCTIONAL_NAMESPACES, Held, decision, effect
from .errors import CheckpointError
from .planners import planner_of

__all__ = ["ReplayCollectives", "check_agreement", "replay_collectives", "replayable"]


def replayable(op) -> bool:
    """Whether ``replay_collectives`` lets a policy replay ``op``: a functional collective."""
    return getattr(op, "namespace", None) in FUNCTIONAL_NAMESPACES and effect(op) is not None


@dataclass(frozen=True)
class ReplayCollectives(Held):
    """``policy``, allowed to replay the functional collectives it records (module docstring)."""

    policy: object
    replays_collectives = True  # read by decisions.resolve and the region's end

    @property
    def constant(self):
        return getattr(self.policy, "constant", None)

    @property
    def planner(self):
        return planner_of(self.policy)

    @property
    def offloads_kept(self):
        return getattr(self.policy, "offloads_kept", False)

    def __call__(self, node):
        return decision(self.policy, node)

    def __repr__(self) -> str:
        return f"replay_collectives({self.policy!r})"


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


def check_agreement(graph, replayed: frozenset) -> None:
    """Refuse, on every rank of a group, a region whose replay plan (``replayed``: the node
    indices backward will run) replays other collectives of that group than another rank's."""
    mine: dict[str, list] = {}
    for node in graph.nodes:
        if effect(node.op) is not None and replayable(node.op):
            name = _group_name(node)
            if name is not None:
                mine.setdefault(name, []).append((node.name, node.index in replayed))
    for name, plan in sorted(mine.items()):
        group = process_group_named(name)
        plans = [None] * dist.get_world_size(group)
        dist.all_gather_object(plans, plan, group=group)
        if all(p == plan for p in plans):
            continue
        rank = dist.get_rank(group)
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
