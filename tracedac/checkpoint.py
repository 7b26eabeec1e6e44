"""The ways to make a checkpointed region: ``checkpoint``, ``checkpoint_call``, ``wrap``,
their inverse ``unwrap``, and ``name`` for labelling a tensor inside one.

What a region does when it runs is ``region.py``'s; here a module or function is set up so
that each call runs in one, with its policy checked once and held in one place (the hooks or
the wrapper), which every region it makes reads.
"""

from __future__ import annotations

import functools
import sys
import threading

import torch
from torch import nn

from ._compat import class_forward, place_inside_fsdp_hooks, prepend_forward_pre_hook
from .compile import traced_region
from .errors import CheckpointError
from .matching import module_matcher, no_match_error
from .ops.marks import name_op
from .policies.held import check_policy
from .policies.per_op import recompute_all
from .policies.selective import COMPILED_FOREIGN, is_noop_context_fn, policy_for_context_fn
from .policies.spec import PolicySpec, spec_of
from .region import Region, current_region, regions, run_region, tracing
from .wrapper_checks import warn_if_halved

__all__ = [
    "checkpoint",
    "checkpoint_call",
    "is_checkpointed",
    "name",
    "overridden",
    "overriding",
    "unwrap",
    "wrap",
]

_local = threading.local()


# --- modules -----------------------------------------------------------------------------


class _ModuleHooks:
    """Forward pre/post hooks that run a module's forward (and the hooks after ours) in a region."""

    def __init__(self, spec: PolicySpec, name: str, qualified: bool):
        self.spec = spec
        self.name = name  # the module's qualified name in its model, or its class name
        self.qualified = qualified
        self.names = None  # id(submodule) -> qualified name, built on first call
        self.handles = ()

    def pre(self, module, args):
        if not torch.is_grad_enabled() or tracing(args):
            return None  # traced: the module's forward marks its ops (_traced_forward)
        if self.names is None:
            prefix = f"{self.name}." if self.qualified else ""
            self.names = {id(m): (prefix + n) if n else self.name for n, m in module.named_modules()}
        region = Region(
            overridden(self) or self.spec,
            self.name,
            module=module,
            module_names=self.names,
            args=args,
            code=type(module),
            prefix=f"{self.name}." if self.qualified else "",
        )
        region.owner = module
        region.__enter__()
        return None

    def post(self, module, args, output):
        if torch.compiler.is_compiling():
            return None
        region = current_region()
        if region is None or getattr(region, "owner", None) is not module:
            return None
        exc = sys.exc_info()
        region.__exit__(*exc)
        return None

    @property
    def policy(self):
        return self.spec.policy

    def __repr__(self) -> str:
        return f"tracedac.checkpoint(policy={self.policy!r})"


class overriding:
    """While active, in this thread, the regions ``owner`` makes (a module's ``_ModuleHooks``, an
    integration's state) run under ``spec`` instead of its policy (``inspect``'s reports under
    another policy), without touching ``owner``: another thread running it, and the regions
    nested inside it, keep theirs."""

    def __init__(self, owner, spec: PolicySpec):
        self.owner, self.spec = owner, spec

    def __enter__(self):
        self.previous = getattr(_local, "override", None)
        _local.override = (self.owner, self.spec)
        return self

    def __exit__(self, *exc):
        _local.override = self.previous
        return False


def overridden(owner) -> PolicySpec | None:
    """The spec ``overriding`` set for ``owner`` in this thread, or None."""
    override = getattr(_local, "override", None)
    return override[1] if override is not None and override[0] is owner else None


def _checkpoint_module(module: nn.Module, spec: PolicySpec, name: str | None = None) -> nn.Module:
    existing = getattr(module, "_tracedac", None)
    if existing is not None:
        raise CheckpointError(
            f"{type(module).__name__} {existing.name!r} is already checkpointed by tracedac "
            f"with {existing.policy!r}; checkpointing it again would nest a region in itself. "
            "Wrap each module once (tracedac.wrap skips modules inside a matched one)."
        )
    hooks = _ModuleHooks(
        spec, name if name is not None else type(module).__name__, qualified=name is not None
    )
    hooks.handles = (
        prepend_forward_pre_hook(module, hooks.pre),
        module.register_forward_hook(hooks.post, always_call=True),
    )
    # fully_shard applied first: the region inside FSDP2's all-gather and free, as in the
    # order checkpoint-then-fully_shard, not around them (recording the all-gather, and the
    # first step holding each block's gathered buffer until backward: docs/guide/fsdp2.md)
    place_inside_fsdp_hooks(module, *hooks.handles)
    module._tracedac = hooks
    inner = module.__dict__.get("forward")
    if inner is None or getattr(inner, "tracedac_composes", False):  # (other instance forwards: eager only)
        module.forward = functools.partial(_traced_forward, module, inner)
        module.forward.tracedac_composes = True  # tracedac.zero's forward may wrap it
    return module


def _traced_forward(module: nn.Module, inner, *args, **kwargs):
    """A checkpointed module's forward, set on the instance as ``partial(_traced_forward,
    module, inner)``. Eager, the hooks record the call; traced, its ops are marked (a context
    manager cannot span two hooks under dynamo, so the mark is made here). A partial rather
    than a bound method: the module still pickles, and torch.export reads its code. ``inner``:
    an instance forward set before that composes (``tracedac.zero``'s), called in its place."""
    hooks = getattr(module, "_tracedac", None)
    forward = inner if inner is not None else class_forward(module)
    if hooks is not None and tracing(args, kwargs) and torch.is_grad_enabled():
        # Named by its class, not its qualified name ("layers.3"), which dynamo would guard
        # on: each layer of a model compiled layer by layer (torchtitan's way) compiled again.
        return traced_region(forward, args, kwargs, hooks.policy, type(module).__name__)
    return forward(*args, **kwargs)


def _is_traced_forward(f) -> bool:
    return isinstance(f, functools.partial) and f.func is _traced_forward


# --- public entry points -----------------------------------------------------------------


# The default policy, made once at import: a region under torch.compile names its policy by id,
# and one made inside the compiled code (``checkpoint_call(f, x)`` there) would have none
# tracedac holds (compile/registry.py).
DEFAULT_POLICY = recompute_all()


DEFAULT_SPEC = spec_of(DEFAULT_POLICY)


def _spec(policy) -> PolicySpec:
    """``policy`` (or the default) checked, held by id while it lives (a compiled region names
    it so: ``policies.held``), and described once for every region it runs (``spec_of``)."""
    return DEFAULT_SPEC if policy is None else spec_of(policy)


def checkpoint(fn=None, /, *, policy=None):
    """Checkpoint a function or module: its forward is recorded, and backward replays it.

    Usable as ``@checkpoint``, ``@checkpoint(policy=...)``, ``checkpoint(fn, policy=...)``
    (returns a wrapped callable) or ``checkpoint(module, policy=...)`` (returns the same
    module, its forward checkpointed; parameters, buffers and state_dict keys unchanged).
    ``policy`` defaults to ``policies.recompute_all()``.
    """
    if fn is None:
        return functools.partial(checkpoint, policy=policy)
    if isinstance(fn, type):
        raise TypeError(
            f"checkpoint() takes a module or function, got the class {fn.__qualname__}: checkpointing a "
            f"class would checkpoint nothing that runs. Checkpoint each instance (tracedac.checkpoint("
            f"model.block)), or every instance inside a model with tracedac.wrap(model, {fn.__name__})."
        )
    spec = _spec(policy)
    if isinstance(fn, nn.Module):
        return _checkpoint_module(fn, spec)
    if not callable(fn):
        raise TypeError(
            f"checkpoint() takes a function or an nn.Module, got {fn!r} of type {type(fn).__name__}"
        )
    region_name = getattr(fn, "__qualname__", type(fn).__name__)

    @functools.wraps(fn)
    def checkpointed(*args, **kwargs):
        return run_region(fn, args, kwargs, spec, region_name)

    checkpointed._tracedac = _FunctionRegion(fn, spec, region_name)
    return checkpointed


class _FunctionRegion:
    __slots__ = ("fn", "spec", "name")

    def __init__(self, fn, spec: PolicySpec, name):
        self.fn = fn
        self.spec = spec
        self.name = name

    @property
    def policy(self):
        return self.spec.policy


def checkpoint_call(
    function,
    *args,
    policy=None,
    use_reentrant=False,
    preserve_rng_state=True,
    determinism_check="default",
    debug=False,
    early_stop=True,
    context_fn=None,
    **kwargs,
):
    """``torch.utils.checkpoint.checkpoint``'s calling convention, run by tracedac.

    For libraries that take a checkpoint function (Hugging Face's
    ``gradient_checkpointing_func``, torch's ``checkpoint_wrapper(checkpoint_fn=...)``,
    torchtitan-style wrappers). ``preserve_rng_state``, ``determinism_check``, ``debug`` and
    ``early_stop`` are accepted and have nothing to do: random ops always replay the same
    numbers, and replay runs only what backward needs.

    ``context_fn`` is called once per call, as torch calls it. torch's selective checkpointing,
    ``functools.partial(create_selective_checkpoint_contexts, policy_fn_or_list)`` (or a
    lambda calling it), becomes the tracedac policy deciding the same for the same ops, a
    list of ops ``save_ops(*ops)``, a policy function ``tracedac.selective.torch_selective(
    policy_fn)`` (see ``tracedac.selective``); it replaces ``policy``, and passing both is an
    error. Any other ``context_fn`` returns a pair ``(forward_context, recompute_context)``:
    the first is entered around the forward (inside the region: a dispatch mode sees the
    program's ops, once), the second around each replay of the region in backward (it sees the
    ops replay runs, never the Python); ``policy`` still says what is kept. Eager only: under
    ``torch.compile`` such a ``context_fn`` is refused (``selective.Contexts``).
    """
    if use_reentrant:
        also = (
            ""
            if is_noop_context_fn(context_fn)
            else " (context_fn is only supported when use_reentrant=False)"
        )
        raise CheckpointError(
            "tracedac.checkpoint_call does not run reentrant checkpointing (use_reentrant=True): "
            f"it records the forward instead of re-running it. Pass use_reentrant=False{also}. With "
            "Hugging Face transformers, enable tracedac with tracedac.integrations.hf.enable(model, "
            "policy=...) and leave use_reentrant out of gradient_checkpointing_kwargs (or set it "
            "to False); see docs/guide/huggingface.md."
        )
    contexts = None
    if not is_noop_context_fn(context_fn):
        selective, contexts = policy_for_context_fn(context_fn, "checkpoint_call")
        if selective is not None and policy is not None:
            raise CheckpointError(
                f"checkpoint_call got both policy={policy!r} and a context_fn (torch's selective "
                f"checkpointing, read as {selective!r}); each says what to keep. Pass one of them."
            )
        if contexts is not None and tracing(args, kwargs):
            raise CheckpointError(
                "checkpoint_call got a context_fn that is not torch's selective checkpointing. "
                + COMPILED_FOREIGN
            )
        policy = selective if selective is not None else policy
    if tracing(args, kwargs):  # marked for the compiler, by the policy itself (compile/registry.py)
        if policy is not None:
            check_policy(policy)
        return run_region(function, args, kwargs, policy or DEFAULT_POLICY)
    if "torchtitan" in sys.modules:
        # torch's checkpoint_wrapper(checkpoint_fn=checkpoint_call) says NO_REENTRANT, and
        # torchtitan then halves a MoE block's token counts: warned, naming the fix
        warn_if_halved(function)
    return run_region(function, args, kwargs, _spec(policy), contexts=contexts)


def wrap(model: nn.Module, match, policy=None) -> nn.Module:
    """Checkpoint every submodule of ``model`` that ``match`` selects; returns ``model``.

    ``match`` is a class, a tuple of classes, or a predicate on ``(qualified_name, module)``.
    Modules inside a matched module are not checkpointed again.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"wrap() takes an nn.Module, got {type(model).__name__}")
    spec = _spec(policy)
    pred = module_matcher(match)
    matched = []

    def visit(prefix: str, module: nn.Module):
        if pred(prefix, module):
            _checkpoint_module(module, spec, prefix or None)
            matched.append(prefix)
            return
        for child_name, child in module.named_children():
            visit(f"{prefix}.{child_name}" if prefix else child_name, child)

    visit("", model)
    if not matched:
        raise no_match_error(
            model, f"wrap() matched no module of {type(model).__name__}: nothing would be checkpointed"
        )
    return model


def is_checkpointed(obj) -> bool:
    """Whether calling ``obj`` runs tracedac regions: a module ``checkpoint``/``wrap`` set up
    (itself, or any submodule) or ``integrations.hf.enable`` switched on, or a function
    ``checkpoint`` made."""
    if isinstance(obj, nn.Module):
        for m in obj.modules():
            if isinstance(m.__dict__.get("_tracedac"), _ModuleHooks):
                return True
            # a transformers layer whose checkpoint function is tracedac's, switched on
            function = getattr(m, "_gradient_checkpointing_func", None)
            if getattr(function, "tracedac_regions", False) and getattr(m, "gradient_checkpointing", False):
                return True
        return False
    return isinstance(getattr(obj, "_tracedac", None), _FunctionRegion)


def unwrap(obj):
    """Undo tracedac on ``obj``; returns the plain module or function.

    A model: every ``wrap``/``checkpoint(module)`` hook is removed and
    ``tracedac.integrations.hf.enable`` is undone, so forward is plain again; parameters,
    buffers and ``state_dict`` keys never changed. A function made by ``checkpoint(fn)``:
    ``fn``. Anything tracedac did not touch comes back as it is.
    """
    if isinstance(obj, nn.Module):
        for m in list(obj.modules()):
            spec = m.__dict__.get("_tracedac")
            if isinstance(spec, _ModuleHooks):
                for h in spec.handles:
                    h.remove()
                del m.__dict__["_tracedac"]
                forward = m.__dict__.get("forward")
                if _is_traced_forward(forward):
                    if forward.args[1] is not None:
                        m.__dict__["forward"] = forward.args[1]  # the forward it wrapped
                    else:
                        del m.__dict__["forward"]
            elif spec is not None:
                spec.disable()  # an integration's state (tracedac.integrations.hf)
        return obj
    spec = getattr(obj, "_tracedac", None)
    if isinstance(spec, _FunctionRegion):
        return spec.fn
    return obj


def name(tensor: torch.Tensor, label: str) -> torch.Tensor:
    """Label ``tensor`` for policies (``save_names``) and reports; returns ``tensor``.

    Inside a region it labels the op that produced the tensor's current value; outside any
    region it does nothing. Under ``torch.compile`` (or another tracer) it is an identity op
    (``tracedac::label``) that carries the label into the graph.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"name() labels a tensor, got {type(tensor).__name__}")
    if not isinstance(label, str) or not label:
        raise TypeError(f"name() takes a non-empty string label, got {label!r}")
    if tracing((tensor,)):
        return name_op(tensor, label)  # an op, so the label reaches the compiled graph
    for region in regions():
        if region.tracer is not None:
            region.label(tensor, label)
    return tensor
