"""ZeRO-3 sharding in tracedac's graph: gather, release and reduce-scatter as custom ops.

``shard(model)`` keeps 1/world of every parameter per rank; a unit's forward gathers its
parameters just in time and releases them after; what autograd saves on them is a handle
that backward turns into a second gather. See docs/design.md, "ZeRO-3".
"""

from . import ops as _ops  # registers tracedac::all_gather, reduce_scatter, release
from .errors import ZeroError
from .grad import clip_grad_norm_
from .shard import MixedPrecision, shard
from .state_dict import full_state_dict, load_full_state_dict, load_sharded_state_dict, sharded_state_dict

__all__ = [
    "MixedPrecision",
    "ZeroError",
    "clip_grad_norm_",
    "full_state_dict",
    "load_full_state_dict",
    "load_sharded_state_dict",
    "shard",
    "sharded_state_dict",
]
