"""What ``checkpoint_call`` checks about the wrapper calling it.

torch's ``checkpoint_wrapper(block, checkpoint_fn=tracedac.checkpoint_call)`` runs the block
under tracedac, but the wrapper's ``checkpoint_impl`` still says ``NO_REENTRANT`` (torch's
checkpoint, which runs the forward twice): torchtitan's MoE load-balancing hook reads that and
halves a block's ``tokens_per_expert_E``, which tracedac counted once, so the expert bias update
goes wrong. ``warn_if_halved`` warns once per such block and names the fix,
``tracedac.integrations.torchtitan.enable()``, which checkpoints the blocks without the wrapper.
"""

from __future__ import annotations

import sys
import warnings
import weakref

from torch import nn

from ._compat import checkpoint_wrapper_module

__all__ = ["warn_if_halved"]

_warned: weakref.WeakSet = weakref.WeakSet()
_SEARCH = 4  # frames above checkpoint_call in which to look for torch's wrapper's forward


def warn_if_halved(function) -> None:
    """Warn, once per block, when ``checkpoint_call`` runs a torchtitan MoE block inside torch's
    ``CheckpointWrapper`` reporting ``NO_REENTRANT``: torchtitan's load-balancing hook halves the
    block's ``tokens_per_expert_E``, counted once by tracedac, so the expert bias goes wrong.
    Called by ``checkpoint_call`` (eager) when torchtitan is imported. The wrapper is found among
    the caller's frames (its ``forward`` calls ``checkpoint_fn(self._checkpoint_wrapped_module,
    ...)``): ``checkpoint_call`` is given the block, never the wrapper."""
    if not isinstance(function, nn.Module) or not getattr(function, "moe_enabled", False):
        return
    wrapper_module = checkpoint_wrapper_module(load=False)
    if wrapper_module is None:  # (torchtitan imports it: nothing to look for without it)
        return
    forward = wrapper_module.CheckpointWrapper.forward.__code__
    frame = sys._getframe(2)  # (1: checkpoint_call)
    for _ in range(_SEARCH):
        if frame is None:
            return
        if frame.f_code is forward:
            break
        frame = frame.f_back
    else:
        return
    wrapper = frame.f_locals.get("self")
    if getattr(wrapper, "_checkpoint_wrapped_module", None) is not function or wrapper in _warned:
        return
    if getattr(wrapper, "checkpoint_impl", None) is not wrapper_module.CheckpointImpl.NO_REENTRANT:
        return
    if getattr(getattr(function, "moe", None), "load_balance_coeff", None) is None:
        return
    _warned.add(wrapper)
    warnings.warn(
        f"tracedac.checkpoint_call runs a torchtitan MoE block ({type(function).__name__}) inside "
        "torch's checkpoint_wrapper, whose checkpoint_impl says NO_REENTRANT whatever its "
        "checkpoint_fn. torchtitan's MoE load-balancing hook then halves the block's "
        "tokens_per_expert_E, assuming torch's checkpoint counted every token twice; tracedac "
        "counts once, so the expert bias update is wrong. Call "
        "tracedac.integrations.torchtitan.enable() before torchtitan applies activation "
        "checkpointing (instead of passing checkpoint_fn=tracedac.checkpoint_call): the counts and "
        "the expert bias then equal no checkpointing's.",
        stacklevel=3,
    )
