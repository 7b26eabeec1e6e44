"""Checkpointed regions and the ways to make one.

A region is one call of a checkpointed function or module. Entering it pushes a
``TracerMode`` and a ``saved_tensors_hooks`` pair; autograd's saved tensors become handles
(``replay.Slot``) on the recorded graph. Leaving it plans what backward will replay and
drops every reference the plan does not use, so the region holds no more than it keeps.
"""

from __future__ import annotations

import functools
import sys
import threading
import types
import weakref

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor as _FakeTensor

from ._compat import class_forward
from .compile import name_op, traced_region
from .errors import CheckpointError
from .decisions import is_save, resolve
from .graph import RegionGraph
from .planners import Planning, input_signature, planner_of
from .policies import check_policy, recompute_all
from .replay import Slot, plan
from .trace import TracerMode, track_modules

__all__ = ["checkpoint", "checkpoint_call", "name", "unwrap", "wrap"]

_local = threading.local()
# Modes under which a region is being traced, not run: its ops are marked, not recorded.
_TRACING_MODES = (torch._C._TorchDispatchModeKey.FAKE, torch._C._TorchDispatchModeKey.PROXY,
                  torch._C._TorchDispatchModeKey.FUNCTIONAL)


def _stack() -> list:
    stack = getattr(_local, "regions", None)
    if stack is None:
        stack = _local.regions = []
    return stack


_UNUSED = (None,)


def _unpack(handle):
    return handle.unpack()


# Owners of tensors from outside any region that they can rebuild on request: each has
# ``owns(t) -> bool`` and ``handle(t)`` (whose ``unpack()`` returns a tensor on an equal
# storage). A region holds such a handle instead of the tensor, so reading it does not pin
# it. tracedac.zero adds one: a gathered parameter is gathered again in backward.
REBUILDERS: list = []


def _owner(t: torch.Tensor):
    for r in REBUILDERS:
        if r.owns(t):
            return r
    return None


class Region:
    """One call of a checkpointed callable: records it, packs what autograd saves, plans replay."""

    def __init__(self, policy, name: str, *, module=None, module_names=None, report=False, args=(), kwargs=None,
                 code=None):
        self.policy = policy
        self.constant = getattr(policy, "constant", None)  # a policy that never looks at the node
        self.graph = RegionGraph(name, policy)
        self.module = module
        reporting = getattr(_local, "reporting", None)
        self.report = report or reporting is not None
        # module paths cost two hooks per module call: only for policies and reports that read them
        self.tracks_modules = self.report or self.constant is None
        if callable(module_names):  # a table built on demand
            module_names = module_names() if self.tracks_modules else None
        self.module_names = module_names if module_names is not None else {}
        self.handles = [] if self.report else None  # every handle packed, for saved_report
        self.kept: list = []  # handles holding their tensor, until the region ends
        self.raw_held: list = []  # (group, the program's tensor) held until the region ends
        if reporting is not None:
            reporting.append(self)
        self.parent: Region | None = None
        self.owner = None  # the module whose forward this region is, if any
        # weak references to the call's tensor arguments, to name them in messages
        self.arg_refs = _arg_refs(enumerate(args), "argument {}")
        if kwargs:
            self.arg_refs += _arg_refs(kwargs.items(), "argument {!r}")
        # A whole-graph planner decides from a plan cached for this code and these inputs
        # (checked against the structure as it records), or plans when the region ends.
        planner = planner_of(policy)
        self.planning = None
        self.timing = False
        if planner is not None:
            self.planning = Planning(planner, None if self.report else _plan_key(policy, code, module, args, kwargs))
            self.timing = getattr(planner, "cost", None) == "time"
        self.tracer = TracerMode(self.graph, self)
        # Autograd keeps the pack hook in every saved variable: let it hold the region weakly,
        # so nothing but the handles keeps the graph alive.
        region = weakref.ref(self)
        if self.report:
            pack = lambda t: region().pack(t)  # noqa: E731
        else:
            pack = lambda t: region()._pack(t)  # noqa: E731
        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, _unpack)

    # -- recording --
    def decide(self, node) -> bool:
        """Decide ``node`` (``node.decision``); whether to hold its result until the region ends."""
        d = resolve(self.policy, node, self.constant)
        if self.planning is not None:
            return self.planning.decide(node, d)
        node.decision = d
        return is_save(d)

    def hold(self, group, tensor) -> None:
        """Keep ``tensor`` (the program's own) for ``group`` until ``alias`` replaces it."""
        if self.planning is not None and not self.planning.keeps(group):
            return  # a planned op's result the plan does not keep
        group.held = tensor
        self.raw_held.append((group, tensor))

    def alias(self, group, t: torch.Tensor) -> torch.Tensor:
        """A detached alias of ``t`` sharing its version counter, also held for ``group``
        in place of the program's tensor (which would close a reference cycle through the
        grad_fn of the tensor autograd is saving)."""
        with torch._C._DisableTorchDispatch():  # above autograd: detach shares the version counter
            a = t.detach()
        if group.held is t:
            group.held = a
        return a

    def pack(self, t: torch.Tensor):
        handle = self._pack(t)
        if self.handles is not None:
            self.handles.append(handle)
        return handle

    def _pack(self, t: torch.Tensor):
        # Autograd saves an op's inputs before the op reaches the tracer: an input seen for
        # the first time has no group yet.
        meta = self.tracer._meta(t)  # usually cached: an argument or result of the op just recorded
        g = self.graph.groups[meta.group]
        if g.creator is None and not g.mutations:
            if (t is not g.external or (self.parent is not None and self.parent.can_rebuild(t))
                    or (REBUILDERS and _owner(t) is not None)):
                # A view made in the region of an input (an expert's slice of a weight) is
                # rebuilt from the input's storage rather than pinned with its autograd node;
                # an input an enclosing region computed (or a REBUILDERS owner can rebuild),
                # through that one's handle.
                return self.tracer.packed(Slot(self.graph, meta), t)
            # An input as it came in: kept as eager keeps it. If the region writes it later,
            # region exit plans its replay from the copy taken before the write.
            slot = Slot(self.graph, meta, t, exact=True)
        elif is_save(g.node.decision) if self.planning is None else self.planning.keeps(g):
            # detached: the saved output's grad_fn holds this handle; no reference cycle
            slot = Slot(self.graph, meta, self.alias(g, t))
            if g.held is None:
                g.held = slot.tensor  # replay of what reads it starts from it
        else:
            return self.tracer.packed(Slot(self.graph, meta), t)
        self.kept.append(slot)
        return self.tracer.packed(slot, t)

    def can_rebuild(self, t: torch.Tensor) -> bool:
        """Whether this region (or one around it) computed ``t`` and could replay it."""
        if self.tracer is None:
            return False
        g = self.tracer.group_of(t)
        if g is None:
            return False
        if g.creator is not None or g.mutations:
            return True
        return self.parent is not None and self.parent.can_rebuild(t)

    # -- entering and leaving --
    def __enter__(self):
        stack = _stack()
        self.parent = stack[-1] if stack else None
        stack.append(self)
        if self.tracks_modules:
            track_modules(True)
        self.tracer.__enter__()
        self._hooks.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            self._hooks.__exit__(exc_type, exc, tb)
            self.tracer.__exit__(exc_type, exc, tb)
        finally:
            if self.tracks_modules:
                track_modules(False)
            stack = _stack()
            if stack and stack[-1] is self:
                stack.pop()
        try:
            if exc_type is None:
                self._finish()
        finally:
            self.graph.recording = False  # (a region that raised: nothing is live any more)
            self.tracer.close()
            self.tracer = self._hooks = None
        return False

    def _finish(self) -> None:
        """Plan replay for every handle, then let go of everything the plan does not use."""
        graph = self.graph
        self.tracer.settle_packed()
        for g, t in self.raw_held:
            if g.held is t:
                self.alias(g, t)
        self.raw_held = []
        if self.planning is not None:
            self.planning.finish(self)  # decide what was left undecided, let go of the rest
        module = weakref.ref(self.module) if self.module is not None else None
        graph.namer = functools.partial(_describe, module, self.arg_refs)
        # From here a version counter that moves means a change the recorder did not see.
        graph.recording = False
        graph.plan = None  # a plan made while recording (autograd.grad in the region) may use what goes now
        for g in graph.groups:
            live = g.held if g.held is not None else g.external
            if live is not None:
                g.version = live._version
        self._hand_inputs_to_parent()
        # What replay must be able to build: every handle not kept, and every kept one the
        # region itself modified after saving it.
        for slot in self.kept:
            if slot.changed:
                graph.add_slot(slot)
        kept_groups = {slot.meta.group for slot in self.kept}
        self.kept = []
        p = plan(graph, [(s.meta.group, s.meta.state) for s in graph.slots()])  # not kept: memory
        self._release(p, kept_groups)

    def _hand_inputs_to_parent(self) -> None:
        """An input of a nested region that the enclosing region computed is held as the
        enclosing region's handle, so it is replayed rather than pinned; an input a
        ``REBUILDERS`` owner can rebuild (a gathered parameter), as that owner's handle."""
        parent = self.parent
        if parent is not None and parent.tracer is None:
            parent = None
        if parent is None and not REBUILDERS:
            return
        for g in self.graph.groups:
            if g.external is None or g.mutations:
                continue
            if parent is not None and parent.can_rebuild(g.external):
                g.outer, g.external = parent.pack(g.external), None
            elif REBUILDERS:
                owner = _owner(g.external)
                if owner is not None:  # a handle no plan uses is dropped by _release
                    g.outer, g.external = owner.handle(g.external), None

    def _release(self, p, kept_groups: set) -> None:
        """Drop every source, generator state and record the plan ``p`` does not use."""
        graph = self.graph
        for g in graph.groups:
            kind = p.starts.get(g.id, _UNUSED)[0]
            if kind != "external":
                g.external = None
            if kind != "snapshot":
                g.snapshot = None
            if kind != "held":
                g.held = None
            if kind != "outer":
                g.outer = None
        needed = set(p.nodes)
        for node in graph.nodes:
            if node.index not in needed:
                node.rng = None
                if not self.report:  # reports show the whole graph
                    node.forget_arguments()
            elif node.rng is not None:
                gen, state, follows = node.rng
                if follows in needed:
                    node.rng = (gen, None, follows)  # replaying ``follows`` first restores it
                else:
                    node.rng = (gen, state, None)
        if not self.report:
            # Keep only the records replay can reach (the plan's storages, those of kept
            # handles, and their nodes, for messages): the rest of the graph goes.
            reachable = set(p.starts) | kept_groups
            groups, nodes = graph.groups, graph.nodes
            for gid in range(len(groups)):
                if gid not in reachable:
                    groups[gid] = None
            for i in range(len(nodes)):
                if i not in needed:
                    nodes[i] = None  # a reachable group still holds its creator and writers


def _arg_refs(items, label: str) -> list:
    """(label, weak reference) for each tensor argument, and each tensor in a tuple or list
    argument (Hugging Face passes ``position_embeddings=(cos, sin)``)."""
    refs = []
    for k, a in items:
        if isinstance(a, torch.Tensor):
            refs.append((label.format(k), weakref.ref(a)))
        elif isinstance(a, (tuple, list)):
            refs += [(f"{label.format(k)}[{i}]", weakref.ref(x)) for i, x in enumerate(a) if isinstance(x, torch.Tensor)]
    return refs


def _describe(module_ref, arg_refs, t) -> str:
    """A name a person can find: an argument, a parameter's or buffer's qualified name, else a shape."""
    shape = f"of shape {list(t.shape)} ({t.dtype})"
    cdata = t.untyped_storage()._cdata
    for label, ref in arg_refs:
        a = ref()
        if a is not None and a.untyped_storage()._cdata == cdata:
            return f"{label} {shape}"
    module = module_ref() if module_ref is not None else None
    if module is not None:
        for kind, items in (("parameter", module.named_parameters()), ("buffer", module.named_buffers())):
            for n, p in items:
                if p.untyped_storage()._cdata == cdata:
                    return f"{kind} {n!r} {shape}"
    return f"a tensor {shape}"


class reporting:
    """Collect every region created in this thread while active, in report mode."""

    def __enter__(self) -> list:
        self.previous = getattr(_local, "reporting", None)
        _local.reporting = self.regions = []
        return self.regions

    def __exit__(self, *exc):
        _local.reporting = self.previous
        return False


def _plan_key(policy, code, module, args, kwargs):
    """What a cached plan is looked up by (None: not cacheable): the policy, the code run,
    the module it runs on and the call's inputs. The structure recorded is checked against
    the plan node by node, and what autograd saved against what the plan was made for
    (``Planning.finish``), so the key only has to find the right candidate; it names what
    changes the plan without changing the ops (a frozen parameter is saved by nobody) so
    that layers of one class that differ there do not take turns replacing each other's plan.
    It holds no object of the call: a cache entry must not keep a step's tensors alive."""
    if module is not None:
        params = tuple(p.requires_grad for p in module.parameters())
        module = (type(module), module.training, params)
    key = (policy, code, module, input_signature(args, kwargs))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def computation(fn, args, kwargs):
    """``(code, module, args, kwargs)``: what calling ``fn(*args, **kwargs)`` runs.

    Unwraps ``functools.partial`` (its arguments join the call's) and bound methods, so a
    new ``partial(layer.forward_fn, layer, mask=m)`` each step (Hugging Face's layers) is
    still the same computation: ``code`` is the function's code object (or the type of a
    module or callable object), ``module`` the ``nn.Module`` it runs on, if any: ``fn``
    itself, or the first argument a partial or bound method supplies, which is then taken
    out of ``args`` (the caller's own arguments keep their positions, for messages).
    """
    kwargs = dict(kwargs) if kwargs else {}
    args = tuple(args)
    own = len(args)  # the caller's arguments are the last ``own``
    while True:
        if isinstance(fn, functools.partial):
            args = fn.args + args
            kwargs = {**fn.keywords, **kwargs}
            fn = fn.func
        elif isinstance(fn, types.MethodType):
            args = (fn.__self__,) + args
            fn = fn.__func__
        else:
            break
    if isinstance(fn, nn.Module):
        return type(fn), fn, args, kwargs
    code = getattr(fn, "__code__", None)
    if code is None:
        code = type(fn)  # a builtin or callable object: its type, never the object itself
    if len(args) > own and isinstance(args[0], nn.Module):
        return code, args[0], args[1:], kwargs
    return code, None, args, kwargs


# Qualified names of modules in the model they were checkpointed in (tracedac.integrations.hf
# registers each layer): regions entered through checkpoint_call are named by them.
_module_names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def register_name(module: nn.Module, qualified: str) -> None:
    """Name the regions ``module`` runs in (``model.layers.3``) when entered by checkpoint_call."""
    _module_names[module] = qualified


def unregister_name(module: nn.Module) -> None:
    _module_names.pop(module, None)


def _module_table(module: nn.Module, name: str, qualified: bool):
    """A builder of ``id(submodule) -> name`` under ``module`` named ``name`` (paths below it
    start with ``name.`` when that is a qualified name, as ``wrap`` names them)."""
    prefix = f"{name}." if qualified else ""
    return lambda: {id(m): prefix + n if n else name for n, m in module.named_modules()}


def current_region() -> Region | None:
    stack = getattr(_local, "regions", None)
    return stack[-1] if stack else None


def tracing(args=(), kwargs=None) -> bool:
    """Whether a tracer (dynamo, make_fx, export, a fake-tensor mode) is running the region:
    then no recorder runs and the region's ops are marked instead (``tracedac.compile``)."""
    if torch.compiler.is_compiling():
        return True
    for key in _TRACING_MODES:
        if torch._C._get_dispatch_mode(key) is not None:
            return True
    return any(isinstance(a, _FakeTensor) for a in (*args, *(kwargs or {}).values()))


def run_region(fn, args, kwargs, policy, name=None, *, module=None, module_names=None, report=False):
    """Call ``fn`` once inside a region (or plainly when no gradient is being recorded).

    Without a ``name``, the region is named for the module ``fn`` runs on (its qualified
    name if registered, else its class) or for the function.
    """
    if tracing(args, kwargs):  # under dynamo, make_fx, export or fake tensors: marked, not recorded
        return traced_region(fn, args, kwargs, policy, name or getattr(fn, "__qualname__", type(fn).__name__))
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    code, on, call_args, call_kwargs = computation(fn, args, kwargs)
    if module is None:
        module = on
    qualified = False
    if name is None:
        if on is not None:
            name = _module_names.get(on)
            qualified = name is not None
            name = name or type(on).__name__
        else:
            name = getattr(fn, "__qualname__", type(fn).__name__)
    if module_names is None and module is not None:
        module_names = _module_table(module, name, qualified)
    with Region(policy, name, module=module, module_names=module_names, report=report, args=call_args,
                kwargs=call_kwargs, code=code):
        return fn(*args, **kwargs)


# --- modules -----------------------------------------------------------------------------


class _ModuleHooks:
    """Forward pre/post hooks that run a module's forward (and the hooks after ours) in a region."""

    def __init__(self, policy, name: str, qualified: bool):
        self.policy = policy
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
        region = Region(self.policy, self.name, module=module, module_names=self.names, args=args, code=type(module))
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

    def __repr__(self) -> str:
        return f"tracedac.checkpoint(policy={self.policy!r})"


def _checkpoint_module(module: nn.Module, policy, name: str | None = None) -> nn.Module:
    existing = getattr(module, "_tracedac", None)
    if existing is not None:
        raise CheckpointError(
            f"{type(module).__name__} {existing.name!r} is already checkpointed by tracedac "
            f"with {existing.policy!r}; checkpointing it again would nest a region in itself. "
            "Wrap each module once (tracedac.wrap skips modules inside a matched one)."
        )
    hooks = _ModuleHooks(policy, name if name is not None else type(module).__name__, qualified=name is not None)
    hooks.handles = (
        module.register_forward_pre_hook(hooks.pre, prepend=True),
        module.register_forward_hook(hooks.post, always_call=True),
    )
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
        return traced_region(forward, args, kwargs, hooks.policy, hooks.name)
    return forward(*args, **kwargs)


def _is_traced_forward(f) -> bool:
    return isinstance(f, functools.partial) and f.func is _traced_forward


# --- public entry points -----------------------------------------------------------------

# The default policy, made once at import: a region under torch.compile names its policy by id,
# and one made inside the compiled code (``checkpoint_call(f, x)`` there) would have none
# tracedac holds (compile/registry.py).
DEFAULT_POLICY = recompute_all()


def checkpoint(fn=None, /, *, policy=None):
    """Checkpoint a function or module: its forward is recorded, and backward replays it.

    Usable as ``@checkpoint``, ``@checkpoint(policy=...)``, ``checkpoint(fn, policy=...)``
    (returns a wrapped callable) or ``checkpoint(module, policy=...)`` (returns the same
    module, its forward checkpointed; parameters, buffers and state_dict keys unchanged).
    ``policy`` defaults to ``policies.recompute_all()``.
    """
    if fn is None:
        return functools.partial(checkpoint, policy=policy)
    policy = DEFAULT_POLICY if policy is None else policy
    check_policy(policy)
    if isinstance(fn, nn.Module):
        return _checkpoint_module(fn, policy)
    if not callable(fn):
        raise TypeError(
            f"checkpoint() takes a function or an nn.Module, got {fn!r} of type {type(fn).__name__}"
        )
    region_name = getattr(fn, "__qualname__", type(fn).__name__)

    @functools.wraps(fn)
    def checkpointed(*args, **kwargs):
        return run_region(fn, args, kwargs, policy, region_name)

    checkpointed._tracedac = _FunctionRegion(fn, policy, region_name)
    return checkpointed


class _FunctionRegion:
    __slots__ = ("fn", "policy", "name")

    def __init__(self, fn, policy, name):
        self.fn = fn
        self.policy = policy
        self.name = name


def checkpoint_call(function, *args, policy=None, use_reentrant=False, preserve_rng_state=True,
                    determinism_check="default", debug=False, early_stop=True, context_fn=None, **kwargs):
    """``torch.utils.checkpoint.checkpoint``'s calling convention, run by tracedac.

    For libraries that take a checkpoint function (Hugging Face's
    ``gradient_checkpointing_func``, torchtitan-style wrappers). ``preserve_rng_state``,
    ``determinism_check``, ``debug`` and ``early_stop`` are accepted and have nothing to do:
    random ops always replay the same numbers, and replay runs only what backward needs.
    """
    if use_reentrant:
        raise CheckpointError(
            "tracedac.checkpoint_call does not run reentrant checkpointing (use_reentrant=True): "
            "it records the forward instead of re-running it. Pass use_reentrant=False. With "
            "Hugging Face transformers, enable tracedac with tracedac.integrations.hf.enable(model, "
            "policy=...) and leave use_reentrant out of gradient_checkpointing_kwargs (or set it "
            "to False); see README, 'Hugging Face transformers'."
        )
    if context_fn is not None and getattr(context_fn, "__name__", "") != "noop_context_fn":
        raise CheckpointError(
            "checkpoint_call got a context_fn (torch's selective checkpointing); tracedac does "
            "not use context managers around recomputation. Express the same choice as "
            "policy=tracedac.policies.save_ops(...) and drop context_fn."
        )
    policy = DEFAULT_POLICY if policy is None else policy
    check_policy(policy)
    return run_region(function, args, kwargs, policy)


def module_matcher(match, where: str = "wrap(match=...)"):
    """A predicate ``(qualified_name, module) -> bool`` from a class, a tuple of classes or a
    predicate, as ``wrap`` and ``tracedac.zero.shard`` take them; ``where`` names the argument
    in errors."""
    if isinstance(match, type):
        if not issubclass(match, nn.Module):
            raise TypeError(f"{where} takes nn.Module classes, got {match!r}")
        return lambda name, m: isinstance(m, match)
    if isinstance(match, tuple):
        if not match or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in match):
            raise TypeError(f"{where} takes a non-empty tuple of nn.Module classes, got {match!r}")
        return lambda name, m: isinstance(m, match)
    if callable(match):
        return match
    raise TypeError(
        f"{where} takes an nn.Module class, a tuple of them, or a predicate "
        f"(qualified_name, module) -> bool, got {match!r} of type {type(match).__name__}"
    )


def wrap(model: nn.Module, match, policy=None) -> nn.Module:
    """Checkpoint every submodule of ``model`` that ``match`` selects; returns ``model``.

    ``match`` is a class, a tuple of classes, or a predicate on ``(qualified_name, module)``.
    Modules inside a matched module are not checkpointed again.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"wrap() takes an nn.Module, got {type(model).__name__}")
    policy = DEFAULT_POLICY if policy is None else policy
    check_policy(policy)
    pred = module_matcher(match)
    matched = []

    def visit(prefix: str, module: nn.Module):
        if pred(prefix, module):
            _checkpoint_module(module, policy, prefix or None)
            matched.append(prefix)
            return
        for child_name, child in module.named_children():
            visit(f"{prefix}.{child_name}" if prefix else child_name, child)

    visit("", model)
    if not matched:
        classes = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(
            f"wrap() matched no module of {type(model).__name__}: nothing would be "
            f"checkpointed. Module classes present: {', '.join(classes)}."
        )
    return model


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
    for region in getattr(_local, "regions", ()):
        if region.tracer is None:
            continue
        g = region.tracer.group_of(tensor)
        if g is None or g.node is None:
            continue
        node = g.node
        node.labels = node.labels | {label}
        if region.decide(node) and g.held is None:
            region.hold(g, tensor)
    return tensor
