"""ZeRO-3 sharding in tracedac's graph: gather, release and reduce-scatter as custom ops.

``shard(model)`` keeps 1/world of every parameter per rank, as a ``Shard(0)`` DTensor under
its own name; a unit's forward gathers its parameters just in time and releases them after;
what autograd saves on them is a handle that backward turns into a second gather. See
docs/design.md, "ZeRO-3".
"""

from ..errors import ZeroError
from .checkpoint import load_checkpoint, save_checkpoint
from .full import full_parameters
from .grad import clip_grad_norm_
from .module import ZeroModule
from .shard import MixedPrecision, shard
from .state_dict import full_state_dict, load_full_state_dict

__all__ = [
    "MixedPrecision",
    "ZeroError",
    "ZeroModule",
    "clip_grad_norm_",
    "full_parameters",
    "full_state_dict",
    "load_checkpoint",
    "load_full_state_dict",
    "save_checkpoint",
    "shard",
]
