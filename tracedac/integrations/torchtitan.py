"""torchtitan's activation checkpointing, run by tracedac: one call before torchtitan applies it.

torchtitan (0.3) applies activation checkpointing with ``ActivationCheckpointing.apply(model)``
of the mode its config names, each transformer block of ``model.layers`` in turn:

- ``FullAC``: torch's ``checkpoint_wrapper`` around the block (torchtitan's module global
  ``ptd_checkpoint_wrapper``);
- ``SelectiveAC``: the same wrapper with a ``context_fn`` of torch's selective checkpointing
  (its save list of matmuls, attention and collectives; every second matmul recomputed;
  ``force_recompute_mm_shapes_by_fqns``);
- ``MemoryBudgetAC``: no wrapper; it sets ``torch._functorch.config.activation_memory_budget``,
  which only torch.compile's partitioner reads (torchtitan's Trainer requires the model compiled).

``enable()`` replaces two names in ``torchtitan.distributed.activation_checkpoint``: its
``ptd_checkpoint_wrapper`` (which FullAC, SelectiveAC and any subclass of theirs call), by one that
checkpoints the block itself with tracedac (``tracedac.checkpoint_call`` at each call, with the
block's ``context_fn`` as it is: tracedac reads torch's selective checkpointing as the policy
deciding the same), and ``MemoryBudgetAC.apply``, by one that checkpoints each block under
``tracedac.policies.memory_budget(config.memory_budget)`` (tracedac's planner, eager or compiled).
``disable()`` puts both back. Blocks checkpointed while enabled stay so (as torch's wrappers stay);
``tracedac.unwrap(model)`` makes them plain.

The block is not wrapped: it stays in ``model.layers`` under its own name (no
``_checkpoint_wrapped_module`` in parameter names), its forward runs in a tracedac region. So it
has no ``checkpoint_impl``, and torchtitan's MoE load-balancing hook
(``register_moe_load_balancing_hook``), which halves ``tokens_per_expert_E`` for a block whose
``checkpoint_impl`` is torch's ``NO_REENTRANT`` because torch's checkpoint runs the router twice,
takes tracedac's count, made once, as it is: the expert bias equals no checkpointing's.

The other way in, ``checkpoint_wrapper(block, checkpoint_fn=tracedac.checkpoint_call)``, counts
once too, but torch's wrapper says ``NO_REENTRANT`` whatever its ``checkpoint_fn``, so torchtitan
halves the right count. ``tracedac.wrapper_checks.warn_if_halved`` (called by ``checkpoint_call``
when torchtitan is imported) warns once per such MoE block and names the fix, ``enable()``.
"""

from __future__ import annotations

import functools
import sys
import warnings

from torch import nn

from .._compat import checkpoint_wrapper_module
from ..checkpoint import checkpoint_call
from ..errors import CheckpointError
from ..policies import memory_budget
from ..policies.held import check_policy
from ..record.naming import register_name, unregister_name

__all__ = ["disable", "enable", "is_enabled"]

# The torchtitan whose activation checkpointing enable() knows (its classes FullAC, SelectiveAC
# and MemoryBudgetAC came in 0.3; 0.2 had one apply_ac function).
TORCHTITAN_SUPPORTED = "0.3"

# torch.utils.checkpoint options a torchtitan mode passes that checkpoint_call takes
_OPTIONS = {"preserve_rng_state", "determinism_check", "debug", "early_stop", "context_fn"}

_ABSENT = object()
# (module, attribute name, what was there): what enable() replaced, in order; empty when disabled
_patched: list = []


def _ac_module():
    """torchtitan's activation checkpointing module, checked to be the one enable() knows."""
    try:
        import torchtitan.distributed.activation_checkpoint as ac
    except ImportError as e:  # a missing optional dependency: ModuleNotFoundError, as Python says it
        raise ModuleNotFoundError(
            f"tracedac.integrations.torchtitan.enable() needs torchtitan, which is not importable ({e}). "
            f"pip install 'torchtitan>={TORCHTITAN_SUPPORTED}' (or tracedac's 'titan' extra).",
            name="torchtitan",
        ) from None
    missing = [
        n for n in ("ptd_checkpoint_wrapper", "FullAC", "SelectiveAC", "MemoryBudgetAC") if not hasattr(ac, n)
    ]
    if missing:
        version = getattr(sys.modules.get("torchtitan"), "__version__", "of unknown version")
        raise CheckpointError(
            f"torchtitan {version}'s torchtitan.distributed.activation_checkpoint has no "
            f"{', '.join(missing)}: tracedac.integrations.torchtitan works through the activation "
            f"checkpointing classes of torchtitan {TORCHTITAN_SUPPORTED} (FullAC, SelectiveAC, "
            f"MemoryBudgetAC). Install torchtitan {TORCHTITAN_SUPPORTED}.x, or checkpoint the blocks "
            "yourself: tracedac.wrap(model, lambda name, m: name.count('.') == 1 and "
            "name.startswith('layers.'))."
        )
    return ac


def enable() -> None:
    """Make torchtitan's activation checkpointing tracedac's, for every model it is applied to
    from now on: full, selective (its own ``context_fn``) and memory-budget modes. Call it
    before torchtitan applies activation checkpointing (before ``Trainer`` is built, or before
    ``ActivationCheckpointing.apply``). Calling it again does nothing."""
    ac = _ac_module()
    if _patched:
        return
    original_apply = ac.MemoryBudgetAC.__dict__.get("apply", _ABSENT)
    _patched.append((ac, "ptd_checkpoint_wrapper", ac.ptd_checkpoint_wrapper))
    _patched.append((ac.MemoryBudgetAC, "apply", original_apply))
    ac.ptd_checkpoint_wrapper = _checkpoint_block
    ac.MemoryBudgetAC.apply = _memory_budget_apply


def disable() -> None:
    """Put back what ``enable()`` replaced: torchtitan checkpoints with torch again from now on.
    Blocks checkpointed meanwhile stay tracedac's (``tracedac.unwrap(model)`` makes them plain).
    Calling it when not enabled does nothing."""
    while _patched:
        owner, name, value = _patched.pop()
        if value is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, value)


def is_enabled() -> bool:
    """Whether ``enable()`` is in effect."""
    return bool(_patched)


class _Block:
    """tracedac's state on one torchtitan block, at ``block._tracedac``: what its forward
    passes to ``checkpoint_call``, and what to put back (``tracedac.unwrap``)."""

    def __init__(self, module: nn.Module, name: str, policy, options: dict):
        self.module = module  # (strong: a deep copy of the model copies it with its block)
        self.name = name
        self.policy = policy  # None: torch's context_fn in options says, else recompute_all()
        self.options = options  # checkpoint_call's torch options (context_fn among them)
        self.inner_forward = module.__dict__.get("forward")  # an instance forward set before, or None

    def __repr__(self) -> str:
        if self.options.get("context_fn") is not None:
            what = "context_fn"  # (torch's selective checkpointing, read per call)
        else:
            what = f"policy={self.policy!r}" if self.policy is not None else "policy=recompute_all()"
        return f"tracedac.integrations.torchtitan({what})"

    def disable(self) -> None:
        module = self.module
        del module.__dict__["forward"]
        if self.inner_forward is not None:
            module.__dict__["forward"] = self.inner_forward
        module.__dict__.pop("_tracedac", None)
        unregister_name(module)


def _block_forward(module: nn.Module, *args, **kwargs):
    """A checkpointed block's forward, set on the instance as ``partial(_block_forward, block)``
    (a partial: the block still pickles and deep-copies). Each call is one tracedac region, its
    ``context_fn`` called once as torch calls it."""
    state = module._tracedac
    inner = state.inner_forward
    if inner is None:
        inner = functools.partial(type(module).forward, module)  # (the region is named for module)
    return checkpoint_call(inner, *args, policy=state.policy, **state.options, **kwargs)


def _checkpoint(module: nn.Module, name: str | None, policy, options: dict) -> nn.Module:
    existing = module.__dict__.get("_tracedac")
    if existing is not None:
        raise CheckpointError(
            f"{type(module).__name__} {name or ''} is already checkpointed by tracedac ({existing!r}); "
            "torchtitan's activation checkpointing would nest a region in it. Apply one of them: "
            "tracedac.unwrap(model) first, or leave activation_checkpoint unset in torchtitan's config."
        )
    if policy is not None:
        check_policy(policy)
    state = _Block(module, name or type(module).__name__, policy, options)
    module.__dict__["_tracedac"] = state
    module.__dict__["forward"] = functools.partial(_block_forward, module)
    if name is not None:
        register_name(module, name)
    return module


def _checkpoint_block(module: nn.Module, checkpoint_impl=None, checkpoint_fn=None, **options) -> nn.Module:
    """What torchtitan calls as ``ptd_checkpoint_wrapper`` while enabled: ``module`` itself,
    its forward run by ``tracedac.checkpoint_call`` with the options torch's wrapper would pass."""
    no_reentrant = checkpoint_wrapper_module().CheckpointImpl.NO_REENTRANT
    if checkpoint_impl is not None and checkpoint_impl is not no_reentrant:
        raise CheckpointError(
            f"torchtitan asked for {checkpoint_impl} (reentrant) checkpointing of {type(module).__name__}, "
            "which re-runs the forward in backward; tracedac records it instead. Leave checkpoint_impl "
            "out, or call tracedac.integrations.torchtitan.disable() to have torch's checkpoint."
        )
    if checkpoint_fn is not None:
        raise CheckpointError(
            f"ptd_checkpoint_wrapper got checkpoint_fn={checkpoint_fn!r} while tracedac.integrations."
            "torchtitan is enabled, which checkpoints each block with tracedac itself. Leave checkpoint_fn "
            "out, or call tracedac.integrations.torchtitan.disable() first."
        )
    unknown = sorted(set(options) - _OPTIONS)
    if unknown:
        raise CheckpointError(
            f"ptd_checkpoint_wrapper got {unknown}, which are not torch.utils.checkpoint options "
            f"tracedac.checkpoint_call takes ({sorted(_OPTIONS)})."
        )
    return _checkpoint(module, _name_of(), None, options)


def _name_of() -> str | None:
    """The block's qualified name (``layers.3``), the ``base_fqn`` torchtitan's ``_wrap_block``
    was given, read from its frame: ``ptd_checkpoint_wrapper`` is called without it."""
    frame = sys._getframe(2)
    return frame.f_locals.get("base_fqn") if frame.f_code.co_name == "_wrap_block" else None


def _memory_budget_apply(self, model: nn.Module) -> None:
    """``MemoryBudgetAC.apply`` while enabled: every block of ``model.layers`` checkpointed
    under ``tracedac.policies.memory_budget(config.memory_budget)``, eager or compiled."""
    config = self.config
    if getattr(config, "visualize_memory_budget_pareto", False):
        warnings.warn(
            "MemoryBudgetAC's visualize_memory_budget_pareto draws torch.compile's partitioner's "
            "frontier, and tracedac plans each block itself: nothing is drawn. "
            "tracedac.trade_off(block, *inputs) gives tracedac's frontier (and .plot()).",
            stacklevel=2,
        )
    policy = memory_budget(float(config.memory_budget))  # (an int would be read as bytes)
    layers = model.get_submodule("layers")
    for layer_id, block in layers.named_children():
        _checkpoint(block, f"layers.{layer_id}", policy, {})
