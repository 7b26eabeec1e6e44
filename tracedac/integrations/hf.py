"""Hugging Face transformers under tracedac, through transformers' own checkpointing switch.

transformers checkpoints a model's repeated layers (each a ``GradientCheckpointingLayer``):
``activation_checkpointing_enable`` sets each layer's ``gradient_checkpointing`` flag and its
``_gradient_checkpointing_func``, which the layer calls as
``func(partial(forward, layer, **kwargs), *args)`` (the contract the class's docstring
states). ``enable(model, policy=...)`` lets transformers do all of that (which layers,
``every_n_layers``, the input-embedding hook PEFT needs), then gives each layer tracedac's
function in place of torch's, and stays the answer: the model's own
``activation_checkpointing_enable`` (which ``Trainer`` calls for
``TrainingArguments(gradient_checkpointing=True)``, and the deprecated
``gradient_checkpointing_enable`` forwards to) is replaced on the instance by one that does
the same and puts tracedac back. ``use_reentrant=True``, which would change what is run, is
refused with a ``CheckpointError`` saying what to do; the other options of torch's checkpoint
have nothing to do under tracedac, except ``context_fn``. ``offload=True`` (transformers'
``save_on_cpu`` around torch's checkpoint) lets the policy use host memory (``_offloading``):
a planner (``memory_budget``, ``min_cut``, alone or in ``either``) is made with
``offload=True`` and itself chooses what to keep, offload or replay, by the link's measured
speed; any other policy becomes ``policies.offload_kept(policy)``: what it keeps goes to host
memory instead of staying on the device. Either way each layer's input goes to host memory too
(``policies.offload_inputs``), which is what transformers offloads under torch's checkpoint: the
``layers x tokens x hidden`` bytes its docstring promises to free.
A ``context_fn`` made by torch's ``create_selective_checkpoint_contexts`` is read as the
tracedac policy deciding the same (``tracedac.selective``), and checkpoints the layers for
that call of ``activation_checkpointing_enable`` in place of ``enable``'s default policy. Any
other ``context_fn`` is passed on to every layer's call, as transformers passes it to torch's
checkpoint: called once per call, its forward context entered around the layer's forward and
its recompute context around each replay (``checkpoint_call``); the policy is ``enable``'s.

Regions are named by the layer's qualified name (``model.layers.3``), relative to the model
given to ``enable``. ``disable(model)`` (or ``tracedac.unwrap(model)``) puts back every flag,
function, hook and attribute as it was before ``enable``.
"""

from __future__ import annotations

import sys
import types

from torch import nn

from ..checkpoint import checkpoint_call, overridden
from ..errors import CheckpointError
from ..policies import either, memory_budget, min_cut, offload_inputs, offload_kept, recompute_all
from ..policies.held import check_policy, hold
from ..policies.per_op import Either
from ..policies.planners import MemoryBudget, MinCut
from ..policies.selective import is_noop_context_fn, read_context_fn
from ..record.naming import register_name, unregister_name

__all__ = ["disable", "enable"]

# The first transformers whose PreTrainedModel has activation_checkpointing_enable (5.22.2 has
# only gradient_checkpointing_enable): enable() works through it.
TRANSFORMERS_MIN = "5.23"

# torch.utils.checkpoint options that have nothing to do under tracedac (see checkpoint_call)
_NO_OPS = {"use_reentrant", "preserve_rng_state", "determinism_check", "debug", "early_stop", "context_fn"}
_ABSENT = object()


def _pretrained(model: nn.Module):
    """The outermost transformers model in ``model`` (itself, or the one a PEFT model wraps),
    and its qualified name in ``model``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"enable() takes a transformers model (an nn.Module), got {type(model).__name__}")
    for name, m in model.named_modules():
        if callable(getattr(type(m), "activation_checkpointing_enable", None)):
            return m, name
    transformers = sys.modules.get("transformers")
    pretrained = getattr(transformers, "PreTrainedModel", None) if transformers is not None else None
    if isinstance(pretrained, type) and any(isinstance(m, pretrained) for m in model.modules()):
        raise CheckpointError(
            f"{type(model).__name__} is a transformers model, and transformers "
            f"{transformers.__version__} has no activation_checkpointing_enable: it came in transformers "
            f"{TRANSFORMERS_MIN}. tracedac.integrations.hf.enable works through that switch; upgrade "
            f"(pip install 'transformers>={TRANSFORMERS_MIN}'), or checkpoint the decoder layers with "
            "tracedac.wrap(model, LayerClass, policy=...)."
        )
    raise CheckpointError(
        f"{type(model).__name__} holds no transformers model with activation_checkpointing_enable "
        f"(a PreTrainedModel of transformers >= {TRANSFORMERS_MIN}). tracedac.integrations.hf.enable "
        "works through transformers' own checkpointing switch; for any other model use "
        "tracedac.wrap(model, LayerClass, policy=...)."
    )


def _check_options(kwargs: dict | None):
    """Refuse what tracedac would not do as asked; say what to pass instead. Returns the
    policy a ``context_fn`` of torch's selective checkpointing asks for (or None), and any other
    ``context_fn`` (or None), for each layer's call."""
    documented = (
        "Enable tracedac with tracedac.integrations.hf.enable(model, policy=...) and "
        "leave the option out of gradient_checkpointing_kwargs (TrainingArguments) or "
        "activation_checkpointing_kwargs; to train with torch's checkpoint instead, call "
        "tracedac.integrations.hf.disable(model) first."
    )
    kwargs = dict(kwargs or {})
    if kwargs.get("use_reentrant"):
        raise CheckpointError(
            "use_reentrant=True asks for torch's reentrant checkpoint, which runs each layer's "
            "forward again in backward; tracedac, enabled on this model, records the forward "
            f"instead. {documented}"
        )
    context_fn = kwargs.get("context_fn")
    selective = foreign = None
    if not is_noop_context_fn(context_fn):
        try:
            selective, contexts = read_context_fn(context_fn, "gradient_checkpointing_kwargs")
        except CheckpointError as e:
            raise CheckpointError(f"{e} {documented}") from None
        foreign = context_fn if contexts is not None else None  # (called again at each layer's call)
    unknown = sorted(set(kwargs) - _NO_OPS)
    if unknown:
        raise CheckpointError(
            f"activation checkpointing options {unknown} are not torch.utils.checkpoint options "
            f"tracedac knows (it accepts {sorted(_NO_OPS)}). {documented}"
        )
    return selective, foreign


class _Checkpointing:
    """tracedac's state on one transformers model: the policy, the checkpoint function every
    layer calls, and what ``enable`` changed (to put back)."""

    def __init__(self, model, root_prefix: str, policy, explicit: bool = False):
        self.model = model
        self.prefix = root_prefix  # the transformers model's name in what enable() was given
        self.name = root_prefix or type(model).__name__
        self.policy = policy  # what the layers run under now
        self.base = policy  # enable()'s: what a switch-on without a selective context_fn runs under
        self.explicit = explicit  # enable() was given a policy (a context_fn too is then ambiguous)
        self.context_fn = None  # a context_fn not torch's selective checkpointing, for every call
        self.layers = []  # modules with a gradient_checkpointing flag: (module, flag, function)
        for m in model.modules():
            if hasattr(m, "gradient_checkpointing"):
                self.layers.append(
                    (
                        m,
                        m.__dict__.get("gradient_checkpointing", _ABSENT),
                        m.__dict__.get("_gradient_checkpointing_func", _ABSENT),
                    )
                )
        self.hooks_before = {
            k: model.__dict__.get(k, _ABSENT) for k in ("_require_grads_hooks", "_require_grads_hook")
        }
        self.hooks_added = []  # input-embedding hooks transformers added on our calls

    tracedac_regions = True  # what tracedac.is_checkpointed looks for in a layer

    def __call__(self, function, *args, **kwargs):
        """What each layer calls in place of ``torch.utils.checkpoint.checkpoint``."""
        spec = overridden(self)  # saved_report(model, policy=...): that policy, in this thread
        policy = self.policy if spec is None else spec.policy
        return checkpoint_call(function, *args, policy=policy, context_fn=self.context_fn, **kwargs)

    def __repr__(self) -> str:
        return f"tracedac.integrations.hf(policy={self.policy!r})"

    def switch_on(self, kwargs=None, every_n_layers: int = 1, offload: bool = False) -> None:
        """transformers' own activation_checkpointing_enable, then tracedac's function in each
        layer; with ``offload``, the policy may use host memory (``_offloading``)."""
        selective, self.context_fn = _check_options(kwargs)
        if selective is not None and self.explicit:
            raise CheckpointError(
                f"tracedac.integrations.hf.enable(model, policy={self.base!r}) was given a policy, and "
                f"gradient_checkpointing_kwargs a context_fn (torch's selective checkpointing, read as "
                f"{selective!r}); each says what to keep. Leave context_fn out, or call "
                "tracedac.integrations.hf.enable(model) without a policy."
            )
        self.policy = self.base if selective is None else selective
        if offload:
            self.policy = _offloading(self.policy)  # (held by id from birth: a Held policy)
        model = self.model
        before = list(model.__dict__.get("_require_grads_hooks", ()))
        type(model).activation_checkpointing_enable(model, None, every_n_layers=every_n_layers)
        self.hooks_added += [h for h in model.__dict__.get("_require_grads_hooks", ()) if h not in before]
        prefix = f"{self.prefix}." if self.prefix else ""
        for name, m in model.named_modules():
            if hasattr(m, "gradient_checkpointing"):
                m._gradient_checkpointing_func = self
                register_name(m, prefix + name if name else self.prefix or type(m).__name__)

    def disable(self) -> None:
        """Put back every flag, function, hook and attribute as before ``enable``."""
        model = self.model
        for h in self.hooks_added:
            h.remove()
        for key, value in self.hooks_before.items():
            if value is _ABSENT:
                model.__dict__.pop(key, None)
            else:
                model.__dict__[key] = value
        for m, flag, function in self.layers:
            for key, value in (("gradient_checkpointing", flag), ("_gradient_checkpointing_func", function)):
                if value is _ABSENT:
                    m.__dict__.pop(key, None)
                else:
                    m.__dict__[key] = value
        for m in model.modules():
            unregister_name(m)
        model.__dict__.pop("activation_checkpointing_enable", None)
        model.__dict__.pop("_tracedac", None)


def _offloading(policy):
    """What transformers' ``offload=True`` makes of ``policy``: each layer's input goes to host
    memory (``offload_inputs``, what ``save_on_cpu`` moves of torch's checkpoint), and so does
    what the policy would keep. A planner that can weigh an offload against keeping and
    replaying is made to (``memory_budget(b, offload=True)``, ``min_cut(offload=True)``, also
    inside ``either``): the user's budget stays the device's, and the link's measured speed
    decides what goes to the host. Any other policy has what it keeps offloaded
    (``offload_kept``), as ``save_on_cpu`` moves what torch's checkpoint saves."""
    return offload_inputs(_offloading_kept(policy))


def _offloading_kept(policy):
    planners = [p for p in getattr(policy, "policies", (policy,)) if isinstance(p, (MemoryBudget, MinCut))]
    if not planners or not isinstance(policy, (MemoryBudget, MinCut, Either)):
        return offload_kept(policy)
    (planner,) = planners
    if planner.offload is not False:
        return policy
    if isinstance(planner, MemoryBudget):
        moved = memory_budget(planner.budget, cost=planner.cost, offload=True)
    else:
        moved = min_cut(replay_matmuls=planner.replay_matmuls, offload=True)
    if policy is planner:
        return moved
    return either(*(moved if p is planner else p for p in policy.policies))


def _activation_checkpointing_enable(
    self, activation_checkpointing_kwargs=None, every_n_layers: int = 1, offload: bool = False
):
    """transformers' activation_checkpointing_enable, with tracedac's checkpoint in every layer
    (set on this model by tracedac.integrations.hf.enable; undone by its disable)."""
    self._tracedac.switch_on(activation_checkpointing_kwargs, every_n_layers, offload)


def enable(model: nn.Module, policy=None, *, every_n_layers: int = 1) -> nn.Module:
    """Checkpoint ``model``'s layers with tracedac under ``policy`` (default ``recompute_all()``).

    ``model`` is a transformers ``PreTrainedModel`` or holds one (a PEFT model). Works through
    transformers' ``activation_checkpointing_enable``, which keeps working afterwards (and
    ``Trainer`` with ``gradient_checkpointing=True`` keeps tracedac). Calling ``enable`` again
    changes the policy. Returns ``model``.
    """
    explicit = policy is not None
    policy = recompute_all() if policy is None else policy
    check_policy(policy)
    hold(policy)  # found by id when a compiled layer's region names it
    target, prefix = _pretrained(model)
    state = target.__dict__.get("_tracedac")
    if state is None:
        state = _Checkpointing(target, prefix, policy, explicit)
        target.__dict__["_tracedac"] = state
        target.__dict__["activation_checkpointing_enable"] = types.MethodType(
            _activation_checkpointing_enable, target
        )
    elif not isinstance(state, _Checkpointing):
        raise CheckpointError(
            f"{type(target).__name__} is already checkpointed by tracedac as a whole ({state!r}); "
            "checkpointing its layers as well would nest regions. tracedac.unwrap(model) first."
        )
    state.policy = state.base = policy
    state.explicit = explicit
    state.switch_on(every_n_layers=every_n_layers)
    return model


def disable(model: nn.Module) -> nn.Module:
    """Undo ``enable``: every flag, checkpoint function, hook and attribute as before. Returns ``model``."""
    target, _ = _pretrained(model)
    state = target.__dict__.get("_tracedac")
    if not isinstance(state, _Checkpointing):
        raise CheckpointError(
            f"{type(target).__name__} is not checkpointed by tracedac.integrations.hf.enable; "
            "nothing to disable."
        )
    state.disable()
    return model
