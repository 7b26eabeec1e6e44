"""Policies: what a region keeps for backward, offloads to host memory, or replays.

A policy is any callable ``policy(node) -> CheckpointPolicy`` (torch's own enum). The ones
here are frozen, hashable objects made by these factories; they print as the call that made
them and key the plan cache. Per op: ``recompute_all`` (the default), ``save_all``,
``save_ops``, ``save_matmuls``, ``save_names``, ``offload_ops``, ``offload_names``. For the
whole recorded graph (planners): ``memory_budget``, ``min_cut``. For the whole model, one
budget for the step's peak on the device: ``peak``. Combined and wrapped:
``either``, ``offload_kept``, ``offload_inputs``, ``replay_collectives``. See
docs/guide/checkpointing.md and docs/guide/planners.md.

The modules, bottom first: ``held`` (what every policy is), ``min_cut``, ``placement`` (keep,
offload or replay: the cost model), ``planners``, ``plan_cache``, ``per_op``, ``wrappers``,
``collectives``, ``selective`` (torch's ``context_fn`` as a policy), ``spec`` (a policy's
contract with its regions), ``meter`` (device memory, read from outside tracedac) and ``peak``
(one budget for a whole model).
"""

from torch.utils.checkpoint import CheckpointPolicy

from ..offload.link import Link
from ..record.decisions import (
    MUST_CPU_OFFLOAD,
    MUST_RECOMPUTE,
    MUST_SAVE,
    PREFER_CPU_OFFLOAD,
    PREFER_RECOMPUTE,
    PREFER_SAVE,
    RECOMPUTE_OPS,
    recompute_by_default,
)
from ..record.op_info import MATMUL_OPS
from .collectives import replay_collectives
from .peak import peak
from .per_op import (
    either,
    offload_names,
    offload_ops,
    recompute_all,
    save_all,
    save_matmuls,
    save_names,
    save_ops,
)
from .planners import memory_budget, min_cut
from .wrappers import offload_inputs, offload_kept

__all__ = [
    "MATMUL_OPS",
    "MUST_CPU_OFFLOAD",
    "MUST_RECOMPUTE",
    "MUST_SAVE",
    "PREFER_CPU_OFFLOAD",
    "PREFER_RECOMPUTE",
    "PREFER_SAVE",
    "RECOMPUTE_OPS",
    "CheckpointPolicy",
    "Link",
    "either",
    "memory_budget",
    "min_cut",
    "offload_inputs",
    "offload_kept",
    "offload_names",
    "offload_ops",
    "peak",
    "recompute_all",
    "recompute_by_default",
    "replay_collectives",
    "save_all",
    "save_matmuls",
    "save_names",
    "save_ops",
]
