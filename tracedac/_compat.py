"""Private torch API, and dynamo behaviour, that changed between the torch releases tracedac
supports (2.11 to 2.15), reached through one name each, so a torch upgrade that moves one
breaks here only.

Checked by running the test suite on torch 2.11, 2.13, 2.14.1 and 2.15.0 (docs/design.md,
"Supported torch").
"""

from __future__ import annotations

import functools
import sys

import torch
from torch.fx.experimental import symbolic_shapes as _symbolic_shapes

__all__ = [
    "activation_memory_budget",
    "allocation_events",
    "checkpoint_wrapper_module",
    "class_forward",
    "graph_input_sources",
    "inductor_cache_tag",
    "inductor_exact_options",
    "insert_mode_below",
    "is_exporting",
    "is_fake_type",
    "is_wrapper_subclass",
    "is_wrapper_subclass_type",
    "op_effect",
    "optimization_hint",
    "owners",
    "place_inside_fsdp_hooks",
    "prepend_forward_pre_hook",
    "process_group_named",
    "put_back_parameter",
    "remove_mode",
    "trace_time_error",
]

# (torch major, minor)
_VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])

# A SymInt's concrete hint (or ``fallback`` when it has none): ``optimization_hint`` in torch
# 2.13, ``size_hint`` in 2.11 (whose ``hint_int`` warns on every call that it is deprecated:
# each compile of a region printed it, found on a GPU machine's 2.11 on 2026-11-27).
optimization_hint = getattr(_symbolic_shapes, "optimization_hint", None) or _symbolic_shapes.size_hint


def prepend_forward_pre_hook(module, hook):
    """``module.register_forward_pre_hook(hook, prepend=True)``, with the hooks' dict in that
    order as a plain dict too: ``prepend`` moves the hook to the front of the ``OrderedDict``
    only, and dynamo 2.11 guards on a hook by its position in the plain dict's order
    (``list(dict.keys(hooks))[i]``), so a guard built for the hook after ours read ours
    (``tracedac.wrap`` after ``zero.shard``, compiled: "'_ModuleHooks' object has no attribute
    'slots'"). Re-inserting the others after it makes both orders one."""
    handle = module.register_forward_pre_hook(hook)
    hooks = module._forward_pre_hooks
    for key in [k for k in hooks if k != handle.id]:
        hooks[key] = hooks.pop(key)
    return handle


# Where FSDP2 (``torch.distributed.fsdp.fully_shard``) defines its forward hooks, a module's
# (``FSDPState._pre_forward``, ``_post_forward``) and a group's (closures around them).
_FSDP_HOOKS_MODULE = "torch.distributed.fsdp._fully_shard._fsdp_state"


def place_inside_fsdp_hooks(module, pre, post) -> None:
    """Move the forward pre-hook of handle ``pre`` to run right after the pre-forward hook
    ``fully_shard`` put on ``module`` (its all-gather of the parameters), and the forward
    hook of handle ``post`` right before its post-forward (which frees them); nothing where
    ``fully_shard`` was not applied. FSDP2's hooks are told by the module defining them.
    Both dicts are re-inserted in the new order (see ``prepend_forward_pre_hook``)."""

    def fsdp(hooks) -> list:
        return [k for k, h in hooks.items() if getattr(h, "__module__", None) == _FSDP_HOOKS_MODULE]

    def move(hooks, key, at) -> None:
        keys = [k for k in hooks if k != key]
        at = at(keys)
        for k in [*keys[:at], key, *keys[at:]]:
            hooks[k] = hooks.pop(k)

    unshard, reshard = fsdp(module._forward_pre_hooks), fsdp(module._forward_hooks)
    if unshard:
        move(module._forward_pre_hooks, pre.id, lambda keys: keys.index(unshard[-1]) + 1)
    if reshard:
        move(module._forward_hooks, post.id, lambda keys: keys.index(reshard[0]))


def put_back_parameter(module, name: str) -> None:
    """Let ``module.<name>`` read its registered parameter again after an instance attribute
    (a gathered view) shadowed it, in code dynamo traces (``zero/unit.py``). From torch 2.13 the
    attribute leaves the instance ``__dict__``. Dynamo 2.11 traces no removal from it
    (``__dict__.pop``, ``del``, ``object.__delattr__``: "Unsupported method call"), so there
    it is set to the parameter itself: the attribute reads what it read before, and the entry
    stays until the unit's next eager exit removes it (an assignment to the attribute replaces
    it, as ``nn.Module.__setattr__`` drops a ``__dict__`` entry of that name)."""
    if _VERSION >= (2, 13):
        module.__dict__.pop(name, None)
    else:
        object.__setattr__(module, name, module._parameters[name])


def process_group_named(name: str):
    """The process group a functional collective's ``group_name`` argument names."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def is_wrapper_subclass(t) -> bool:
    """Whether ``t`` is a traceable wrapper subclass (``__tensor_flatten__``: DTensor, ...)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return is_traceable_wrapper_subclass(t)


def is_wrapper_subclass_type(cls) -> bool:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass_type

    return is_traceable_wrapper_subclass_type(cls)


def is_fake_type(cls) -> bool:
    """Whether tensors of type ``cls`` are fake (shapes only: DTensor's sharding propagation)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return issubclass(cls, FakeTensor)


def is_exporting() -> bool:
    """Whether ``torch.export`` is tracing. torch 2.11's dynamo answers
    ``torch.compiler.is_exporting()`` True under every trace, ``torch.compile``'s included (2.13
    reads the flag); the flag itself is right in both."""
    return torch.compiler._is_exporting_flag


def class_forward(module):
    """``type(module).forward`` bound to ``module``, bypassing an instance ``forward``. A
    partial, not ``forward.__get__(module)``: torch 2.11's dynamo cannot trace ``__get__``."""
    return functools.partial(type(module).forward, module)


@functools.cache
def _trace_time_error_class():
    from torch._dynamo.exc import Unsupported  # loaded only once dynamo traces

    from .errors import CheckpointError

    class TraceTimeCheckpointError(CheckpointError, Unsupported):
        """A CheckpointError raised while dynamo calls a marked-constant function: dynamo
        wraps any other exception there as an internal error ("report a PyTorch bug"); an
        ``Unsupported`` it passes on as it is (fullgraph), or graph-breaks and runs the
        code eagerly, where tracedac records it."""

    return TraceTimeCheckpointError


def trace_time_error(message: str) -> Exception:
    """A ``CheckpointError`` to raise from a function dynamo calls at trace time
    (``_dynamo_marked_constant``) that reaches the user as one."""
    return _trace_time_error_class()(message)


def graph_input_sources(gm) -> list[str | None]:
    """Dynamo's source of each input of the graph it hands a backend (``L['self']._modules
    ['blocks']...``), or None: a property in torch 2.13, a method before."""
    out = []
    for p in gm.graph.find_nodes(op="placeholder"):
        source = getattr(p.meta.get("grapharg"), "source", None)
        name = getattr(source, "name", None)
        out.append(name() if callable(name) else name)
    return out


def mutated_inputs(graph) -> list:
    """The placeholders of an AOTAutograd joint graph that the compiled program writes in place,
    either way AOTAutograd writes them: as an ``aten.copy_`` into the placeholder in the graph
    (inductor keeps an input's mutation in the graph), or as a new value the graph returns and
    the runtime copies in after the forward (``aot_eager``; the output's descriptor is an
    ``InputMutationAOTOutput``, torch 2.11 to 2.15, none on a torch without descriptors)."""
    written = {n.args[0] for n in graph.find_nodes(op="call_function", target=torch.ops.aten.copy_.default)}
    try:
        from torch._functorch._aot_autograd.descriptors import InputMutationAOTOutput
    except ImportError:
        InputMutationAOTOutput = ()
    (output,) = graph.find_nodes(op="output")
    descs = output.meta.get("desc") or ()
    returned = {d.mutated_input for d in descs if isinstance(d, InputMutationAOTOutput)}
    return [p for p in graph.find_nodes(op="placeholder") if p in written or p.meta.get("desc") in returned]


def op_effect(op):
    """The effect ``op`` was registered with (``register_effect`` of a ``torch.library`` op,
    torch's own ``_register_effectful_op``), or None. ``_get_effect`` in torch 2.10 to 2.13."""
    from torch._higher_order_ops import effects

    get = getattr(effects, "_get_effect", None)
    if get is not None:
        return get(op)
    return getattr(effects, "SIDE_EFFECTS", {}).get(op)


def owners(t: torch.Tensor) -> int:
    """How many references hold ``t``'s TensorImpl (its Python object is one; a collective's
    work holding it, another): ``Tensor._use_count``, there since torch 1.x."""
    return t._use_count()


def dynamo_off():
    """Run what follows with dynamo off, as ``torch.compiler.set_stance("force_eager")``; the
    state to hand ``dynamo_restore``.

    A ``torch.compile``d function called inside a region must run as plain Python (see
    ``trace.TracerMode.ignore_compile_internals``). Left to itself, dynamo meets the frame under a
    dispatch mode, declines to compile it and marks its code skipped for the rest of the
    process: the function would never run compiled again, even outside regions. With the
    stance forced to eager and no frame callback (a region entered from a graph-broken
    compiled frame has one), dynamo never sees the frame, so nothing is marked.
    Nothing to do when dynamo was never imported: nothing can have been compiled.
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None:
        return None
    callback = torch._C._dynamo.eval_frame.set_eval_frame(None)
    stance = eval_frame._set_stance(_force_eager(eval_frame))
    return eval_frame, callback, stance


@functools.cache
def _force_eager(eval_frame):
    """Dynamo's force_eager stance, made once (a region is entered at every call)."""
    return eval_frame.DynamoStance(stance="force_eager")


def dynamo_restore(state) -> None:
    if state is None:
        return
    eval_frame, callback, stance = state
    eval_frame._set_stance(stance)
    torch._C._dynamo.eval_frame.set_eval_frame(callback)


def selective_checkpoint_policy(contexts):
    """What ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` was given (a list
    of ops or a policy function), from the pair of modes it returned; None for anything else.
    torch keeps it on its private caching modes, a list wrapped in a policy function of its
    own whose closure holds the list."""
    from torch.utils import checkpoint as tc

    caching, cached = (
        getattr(tc, "_CachingTorchDispatchMode", None),
        getattr(tc, "_CachedTorchDispatchMode", None),
    )
    if not (
        isinstance(contexts, tuple)
        and len(contexts) == 2
        and caching is not None
        and type(contexts[0]) is caching
        and type(contexts[1]) is cached
    ):
        return None
    policy_fn = contexts[0].policy_fn
    if getattr(policy_fn, "__code__", None) is _sac_list_policy_code():
        cells = dict(zip(policy_fn.__code__.co_freevars, (c.cell_contents for c in policy_fn.__closure__)))
        return list(cells["policy_fn_or_list"])
    return policy_fn


@functools.cache
def _sac_list_policy_code():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts([])[0].policy_fn.__code__


_CHECKPOINT_WRAPPER = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"


def checkpoint_wrapper_module(load: bool = True):
    """torch's private module of ``checkpoint_wrapper``, ``CheckpointWrapper`` and
    ``CheckpointImpl`` (what torchtitan and FSDP users wrap blocks with). With ``load=False``,
    None unless something imported it already (importing it loads torch.distributed)."""
    if not load:
        return sys.modules.get(_CHECKPOINT_WRAPPER)
    import importlib

    return importlib.import_module(_CHECKPOINT_WRAPPER)


# Inductor's settings under which the code it generates for an op computes eager's bits
# (compiled replay's exact fusion, replay/compiled.py; docs/design.md, "Compiled replay: bits").
_EXACT_INDUCTOR = {
    # inductor lite mode (torch 2.10 on): every node runs eager's kernel except those marked
    # node.meta["custom"]["compile_with_inductor"]; only marked nodes are decomposed
    "fallback_by_default": True,
    "selective_decompose": True,
    # carries node.meta (the marks) through compile_fx's retrace into the selective
    # decomposition: compile_fx preserves node meta only at this level
    "trace.provenance_tracking_level": 1,
    # pattern rewrites (mm + add into addmm, small mm into pointwise, attention patterns)
    # change which kernels run, so what numbers come out
    "use_pre_grad_passes": False,
    "use_joint_graph_passes": False,
    "use_post_grad_passes": False,
    # bf16/fp16: round after every op as eager does (and in Triton: no FMA contraction)
    "emulate_precision_casts": True,
    # C++: no FMA contraction, no unsafe math (also the defaults, which an environment can change)
    "cpp.enable_floating_point_contract_flag": "off",
    "cpp.enable_unsafe_math_opt_flag": False,
    "use_fast_math": False,
    # Triton: correctly rounded fp32 division (eager's), no flushing of subnormals
    "eager_numerics.division_rounding": True,
    "eager_numerics.disable_ftz": True,
}
_EXACT_REQUIRED = ("fallback_by_default", "selective_decompose", "trace.provenance_tracking_level")


def inductor_exact_options() -> dict | None:
    """The inductor options of ``_EXACT_INDUCTOR`` this torch knows (a fresh dict), or None
    where it lacks lite mode (``fallback_by_default``, ``selective_decompose``): without them a
    compiled program could not keep eager's kernels for the ops it must not fuse."""
    known = _inductor_exact_known()
    return None if known is None else {k: _EXACT_INDUCTOR[k] for k in known}


@functools.cache
def _inductor_exact_known() -> tuple | None:
    from torch._inductor import config

    known = config.get_config_copy()
    if not all(k in known for k in _EXACT_REQUIRED):
        return None
    return tuple(k for k in _EXACT_INDUCTOR if k in known)


def inductor_cache_tag(tag: str):
    """A context in which inductor's compile caches key on ``tag`` too (added to
    ``torch.compiler.config.cache_key_tag``): the caches hash a graph's code and the options,
    not its nodes' ``meta``, so two programs of one graph with different nodes marked for
    fusion would share an entry."""
    import contextlib

    from torch.compiler import config

    if not hasattr(config, "cache_key_tag"):
        return contextlib.nullcontext()
    return config.patch(cache_key_tag=f"{config.cache_key_tag}|{tag}")


def insert_mode_below(mode) -> None:
    """Put ``mode`` at the bottom of this thread's dispatch-mode stack, under the modes already
    there, which stay above it in their order. A mode that must outlive the modes entered around
    it (``policies.meter``'s, from one step's first region to the next's) cannot be entered with
    ``with``: a mode entered before it and exited after would pop it instead of itself. Not
    under a tracer (its infra modes are kept apart from this stack)."""
    above = [torch._C._pop_torch_dispatch_stack(None) for _ in range(torch._C._len_torch_dispatch_stack())]
    torch._C._push_on_torch_dispatch_stack(mode)
    for m in reversed(above):
        torch._C._push_on_torch_dispatch_stack(m)


def remove_mode(mode) -> bool:
    """Take ``mode`` out of this thread's dispatch-mode stack wherever it is, the modes above it
    staying in their order; whether it was there."""
    above, found = [], False
    while torch._C._len_torch_dispatch_stack():
        m = torch._C._pop_torch_dispatch_stack(None)
        if m is mode:
            found = True
            break
        above.append(m)
    for m in reversed(above):
        torch._C._push_on_torch_dispatch_stack(m)
    return found


def activation_memory_budget(budget: float):
    """A context in which torch.compile's min-cut partitioner keeps at most ``budget`` (0-1) of
    its activation memory (``torch._functorch.config.activation_memory_budget``, a private
    config), read when a graph is compiled: compile inside it."""
    import torch._functorch.config as functorch_config

    return functorch_config.patch(activation_memory_budget=budget)


def allocation_events(prof) -> list[int]:
    """The sizes of the allocations (positive) and frees (negative) torch's CPU allocator
    reported to the profiler ``prof`` (``profile_memory=True``), in time order; read from its
    private event tree (``kineto_results``), which is how torch's own memory views read them."""
    from torch._C._profiler import _EventType

    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == _EventType.Allocation:
            events.append((e.start_time_ns, e.extra_fields.alloc_size))
    return [size for _, size in sorted(events)]
