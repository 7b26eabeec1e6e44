"""The region runtime: one call of a checkpointed callable, recorded, packed and planned.

A region is one call of a checkpointed function or module. Entering it pushes a
``TracerMode`` and a ``saved_tensors_hooks`` pair; autograd's saved tensors become handles
(``replay.Slot``) on the recorded graph. Leaving it plans what backward will replay and
drops every reference the plan does not use, so the region holds no more than it keeps.
The public ways to make one (``checkpoint``, ``checkpoint_call``, ``wrap``) are in
``checkpoint.py``; ``tracedac.zero`` and the integrations meet regions here.
"""

from __future__ import annotations

import functools
import threading
import warnings
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensor as _FakeTensor

from .compile import traced_region
from .errors import CheckpointError
from .offload.host import host_copy, leave_device, settle
from .policies.collectives import check_agreement
from .policies.held import describe_policy
from .policies.plan_cache import Planning, computation, input_signature, plan_key
from .policies.spec import PolicySpec
from .record import warm as _warm
from .record.decisions import is_offload, is_save, resolve
from .record.graph import RegionGraph
from .record.location import track_modules
from .record.naming import arg_refs, describe, module_table, registered_name
from .record.op_info import storage_address
from .record.subclasses import is_subclass, saved
from .record.template import TEMPLATES
from .record.tracer import TracerMode
from .replay.plan import plan
from .replay.run import Slot

__all__ = ["REBUILDERS", "Region", "current_region", "regions", "reporting", "run_region", "tracing"]

_local = threading.local()
# Modes under which a region is being traced, not run: its ops are marked, not recorded.
_TRACING_MODES = (
    torch._C._TorchDispatchModeKey.FAKE,
    torch._C._TorchDispatchModeKey.PROXY,
    torch._C._TorchDispatchModeKey.FUNCTIONAL,
)


def _stack() -> list:
    stack = getattr(_local, "regions", None)
    if stack is None:
        stack = _local.regions = []
    return stack


_UNUSED = (None,)


def _unpack(handle):
    return handle.unpack()


def _unpack_warm(region, handle):
    """Unpacking a handle of a region that may still run warm: replay reads the recorded graph,
    which a warm call has not made yet (``WarmMode.unpacking``)."""
    r = region()
    if r is not None and r.warm is not None:
        r.warm.unpacking()
    return handle.unpack()


def _warm_key(spec, code, module, args, kwargs):
    """What a region's template is cached by (None: not cacheable): its policy (as a value), the code run,
    the module's class and mode, the inputs' shapes, dtypes, devices and ``requires_grad``.
    Everything else a call does is checked against the template as it runs."""
    key = (
        spec.value,
        code,
        None if module is None else (type(module), module.training),
        input_signature(args, kwargs),
    )
    try:
        hash(key)
    except TypeError:
        return None
    return key


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

    def __init__(
        self,
        spec,
        name: str,
        *,
        module=None,
        module_names=None,
        report=False,
        args=(),
        kwargs=None,
        code=None,
        prefix: str = "",
    ):
        """``spec``: the policy's ``PolicySpec`` (``policies.spec.spec_of``), read once where the
        policy was checked."""
        self.spec = spec
        self.constant = spec.constant  # a policy that never looks at the node
        self.graph = RegionGraph(name, spec.policy)
        self.module = module
        self.prefix = prefix  # "blocks.3." when the region is named by its module's qualified name
        reporting = getattr(_local, "reporting", None)
        self.report = report or reporting is not None
        # (a nested region records: it reads the enclosing one's groups)
        warm = spec.warm and not self.report and _warm.enabled() and not _stack()
        # module paths cost two hooks per module call: only for policies and reports that read
        # them (a structural policy never does)
        self.tracks_modules = self.report or (self.constant is None and not warm)
        if callable(module_names):  # a table built on demand
            module_names = module_names() if self.tracks_modules else None
        self.module_names = module_names if module_names is not None else {}
        self.handles = [] if self.report else None  # every handle packed, for saved_report
        self.kept: list = []  # handles holding their tensor (or its host copy), until the region ends
        self.raw_held: dict = {}  # group id -> (group, the program's tensor) held until the region ends
        if reporting is not None:
            reporting.append(self)
        self.parent: Region | None = None
        self.owner = None  # the module whose forward this region is, if any
        # weak references to the call's tensor arguments, to name them in messages
        self.arg_refs = arg_refs(enumerate(args), "argument {}")
        if kwargs:
            self.arg_refs += arg_refs(kwargs.items(), "argument {!r}")
        # A whole-graph planner decides from a plan cached for this code and these inputs
        # (checked against the structure as it records), or plans when the region ends.
        self.planning = None
        # a planner across regions (policies.peak) follows the region's forward and backward
        self.watch = None
        self.timing = spec.timing
        self.offload_inputs = spec.offloads_inputs  # computed inputs leave at the end
        # the recorder hands a policy that reads the op's values those (``tracer.deciding``)
        self.reads_values = spec.reads_values
        # whether anything may be offloaded (region exit then settles the host copies)
        self.offloads = spec.may_offload
        if spec.planner is not None:
            planner, bind = spec.planner, getattr(spec.planner, "bind", None)
            if bind is not None:  # it hands each region a planner of its own (None: the policy decides)
                planner, self.watch = bind(self, code, args, kwargs)
            if planner is not None:
                by = spec.policy if planner is spec.planner else (spec.policy, planner)
                key = None if self.report else plan_key(by, code, module, args, kwargs)
                self.planning = Planning(planner, key, offload=spec.offloads_kept)
        self.tracer = TracerMode(self.graph, self)
        # The warm path (record/warm.py): a call whose structure repeats a recorded one's runs
        # its template, checked op by op; a first call records one. Not for what it cannot
        # repeat without recording (docs/design.md, "The warm path").
        self.warm = None
        if warm:
            wkey = _warm_key(spec, code, module, args, kwargs)
            if wkey is not None:
                entry, cache_key = TEMPLATES.find(wkey, name)
                if entry is None or not entry.cold:
                    t = entry.template if entry is not None else None
                    planned = self.planning.cached if self.planning is not None else None
                    run = t is not None and t.plan_entry is planned
                    self.warm = _warm.WarmMode(
                        self, entry if run else None, cache_key, Slot, _owner if REBUILDERS else None
                    )
        # Autograd keeps the pack hook in every saved variable: let it hold the region weakly,
        # so nothing but the handles keeps the graph alive.
        region = weakref.ref(self)
        if self.report:
            pack = lambda t: region().pack(t)  # noqa: E731
        elif self.warm is not None:
            pack = self.warm.pack  # (holds the region only until it ends: WarmMode.close)
        else:
            pack = lambda t: region()._pack(t)  # noqa: E731
        if self.watch is not None:  # (peak's: its regions never run warm)
            unpack = self.watch.unpack
        else:
            unpack = _unpack if self.warm is None else functools.partial(_unpack_warm, region)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    @property
    def policy(self):
        return self.graph.policy  # held once, by the graph (reports and replay read it there)

    # -- recording --
    def decide(self, node) -> bool:
        """Decide ``node`` (``node.decision``); whether to hold its result until the region ends."""
        d = resolve(self.spec, node)
        offload = is_offload(d)
        if offload:
            self.offloads = True
        if self.planning is not None:
            return self.planning.decide(node, d)
        node.decision = d
        return offload or is_save(d)

    def hold(self, group, tensor) -> None:
        """Keep ``tensor`` (the program's own) for ``group`` until ``alias`` replaces it. A
        result the policy offloads is held the same way until autograd saves it (``_pack``
        copies it to host memory then and lets go of it here) or the region ends (a copy is
        made then only if replay starts from it: ``offload.leave_device``), so only what
        backward reads crosses the link."""
        if (
            self.planning is not None
            and not is_offload(group.node.decision)
            and not self.planning.keeps(group)
        ):
            return  # a planned op's result the plan does not keep
        group.held = tensor
        self.raw_held[group.id] = (group, tensor)
        if self.warm is not None and self.warm.log is not None:
            self.warm.held_now(group, tensor)  # the template holds it at the same event

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
            leaves = getattr(handle, "leaves", None)  # a subclass's handle: its plain tensors'
            self.handles.extend(leaves() if leaves is not None else (handle,))
        return handle

    def _pack(self, t: torch.Tensor):
        # a DTensor (say): its inner tensors' handles (``subclasses.py``); a plain tensor is none
        if type(t) is not torch.Tensor and is_subclass(t):
            return saved(t, self._pack)
        # Autograd saves an op's inputs before the op reaches the tracer: an input seen for
        # the first time has no group yet.
        meta = self.tracer._meta(t)  # usually cached: an argument or result of the op just recorded
        g = self.graph.groups[meta.group]
        if g.creator is None and not g.mutations:
            if (
                t is not g.external
                or (self.parent is not None and self.parent.can_rebuild(t))
                or (REBUILDERS and _owner(t) is not None)
            ):
                # A view made in the region of an input (an expert's slice of a weight) is
                # rebuilt from the input's storage rather than pinned with its autograd node;
                # an input an enclosing region computed (or a REBUILDERS owner can rebuild),
                # through that one's handle.
                return self.tracer.packed(Slot(self.graph, meta), t)
            # An input as it came in: kept as eager keeps it. If the region writes it later,
            # region exit plans its replay from the copy taken before the write.
            slot = Slot(self.graph, meta, t, exact=True)
        elif is_offload(g.node.decision):
            slot = Slot(self.graph, meta, host=host_copy(g, t))
            slot.host.watch(t)  # up here a detach() shares t's version counter
            if g.held is not None:  # the copy is of the held state: replay starts from it too
                g.held = None
                self.raw_held.pop(g.id, None)
        elif is_save(g.node.decision) if self.planning is None else self.planning.keeps(g):
            # detached: the saved output's grad_fn holds this handle; no reference cycle
            slot = Slot(self.graph, meta, self.alias(g, t))
            if g.held is None:
                g.held = slot.tensor  # replay of what reads it starts from it
        else:
            return self.tracer.packed(Slot(self.graph, meta), t)
        self.kept.append(slot)
        return self.tracer.packed(slot, t)

    def label(self, tensor: torch.Tensor, label: str) -> None:
        """``tracedac.name(tensor, label)`` inside this region: label the node that produced the
        tensor's current state and decide it again (a warm call checks the label against its
        template instead)."""
        warm = self.warm
        if warm is not None:
            if warm.running() and warm.label(tensor, label):
                return
            if warm.log is not None:
                warm.logged_label(tensor, label, lambda: self._label(tensor, label))
                return
        self._label(tensor, label)

    def _label(self, tensor: torch.Tensor, label: str):
        g = self.tracer.group_of(tensor)
        if g is None or g.node is None:
            return None
        node = g.node
        node.labels = node.labels | {label}
        if self.decide(node) and g.held is None:
            self.hold(g, tensor)
        return node

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
        if self.parent is not None and self.parent.warm is not None:
            self.parent.warm.nested()  # it records from here: this region reads its groups
        stack.append(self)
        if self.tracks_modules:
            track_modules(True)
        (self.warm or self.tracer).__enter__()
        self._hooks.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            self._hooks.__exit__(exc_type, exc, tb)
            (self.warm or self.tracer).__exit__(exc_type, exc, tb)
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
            if self.warm is not None:
                self.warm.close()
            self.tracer = self._hooks = self.warm = None
        return False

    def _finish(self) -> None:
        """Plan replay for every handle, then let go of everything the plan does not use."""
        graph = self.graph
        warm = self.warm
        if warm is not None and warm.running():
            module = weakref.ref(self.module) if self.module is not None else None
            graph.namer = functools.partial(describe, module, self.arg_refs, self.prefix)
            if warm.finish(self):
                return  # the graph a recorded call leaves, from the template and this call's tensors
        if self.spec.labels:
            _warn_unmatched_labels(self.spec, graph)
        self.tracer.settle_packed()
        for g, t in self.raw_held.values():
            if g.held is t:
                self.alias(g, t)
        self.raw_held = {}
        if self.planning is not None:
            self.planning.finish(self)  # decide what was left undecided, let go of the rest
        if self.offloads:
            # what is offloaded leaves the device (and the inputs, with offload_inputs)
            self.kept = settle(self.graph.groups, self.kept, self.offload_inputs)
        module = weakref.ref(self.module) if self.module is not None else None
        graph.namer = functools.partial(describe, module, self.arg_refs, self.prefix)
        # From here a version counter that moves means a change the recorder did not see.
        graph.recording = False
        graph.plan = None  # a plan made while recording (autograd.grad in the region) may use what goes now
        for g in graph.groups:
            live = g.held if g.held is not None else g.external
            if live is not None:
                g.version = live._version
                if live is g.external and g.address is None:  # (the recorder took it at first sight)
                    g.address = storage_address(live)
        self._hand_inputs_to_parent()
        # What replay must be able to build: every handle not kept, and every kept one the
        # region itself modified after saving it.
        for slot in self.kept:
            if slot.changed:
                graph.add_slot(slot)
        if self.watch is not None:  # (the graph whole, the kept handles still listed)
            self.watch.finished(self)
        kept_groups = {slot.meta.group for slot in self.kept}
        kept, self.kept = self.kept, []
        wanted = [(s.meta.group, s.meta.state) for s in graph.slots()]  # not kept: memory
        if not self.spec.replays_collectives:
            p = plan(graph, wanted)
        else:  # every rank replays the same collectives, or every rank refuses (collectives.py)
            try:
                p = plan(graph, wanted)
            except CheckpointError as e:
                check_agreement(graph, None, error=e)
                raise
            check_agreement(graph, frozenset(p.nodes))
        if warm is not None:
            warm.keep(self, p, kept_groups)  # a logging call's template, before the release
        self._release(p, kept_groups)
        if self.offloads:  # what is still held of an offloaded result: to host if replay reads it
            leave_device(graph.groups, kept)

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
        starts = p.starts
        for g in graph.groups:
            kind = starts.get(g.id, _UNUSED)[0]
            if kind is None or kind == "create":  # (most groups) no source at all
                g.external = g.snapshot = g.held = g.outer = g.host = None
                continue
            if kind != "external":
                g.external = None
            if kind != "snapshot":
                g.snapshot = None
            if kind != "held":
                g.held = None
            if kind != "outer":
                g.outer = None
            if kind != "host":
                g.host = None  # (handles that share it keep it)
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


_UNMATCHED: set = set()  # (policy, region name, labels) warned about


def _warn_unmatched_labels(spec, graph) -> None:
    """Warn, once per policy, region and labels, when no result the region recorded carries a
    label its policy asks for (``save_names("attn_out")`` with a label never set, or misspelt,
    keeps nothing and says nothing otherwise)."""
    seen = frozenset().union(*(n.labels for n in graph.nodes if n is not None and n.labels))
    missing = spec.labels - seen
    key = (describe_policy(spec.policy), graph.name, missing)
    if not missing or key in _UNMATCHED:
        return
    _UNMATCHED.add(key)
    warnings.warn(
        f"tracedac: region {graph.name!r} runs under {key[0]}, but none of its results carries the "
        f"label{'s' if len(missing) > 1 else ''} {', '.join(repr(x) for x in sorted(missing))}: "
        f"nothing is kept for {'them' if len(missing) > 1 else 'it'}. Label a tensor inside the region "
        "with tracedac.name(tensor, label) (labels seen here: "
        f"{', '.join(repr(x) for x in sorted(seen)) or 'none'}).",
        stacklevel=3,
    )


class reporting:
    """Collect every region created in this thread while active, in report mode."""

    def __enter__(self) -> list:
        self.previous = getattr(_local, "reporting", None)
        _local.reporting = self.regions = []
        return self.regions

    def __exit__(self, *exc):
        _local.reporting = self.previous
        return False


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


def run_region(
    fn, args, kwargs, spec, name=None, *, module=None, module_names=None, report=False, contexts=None
):
    """Call ``fn`` once inside a region under ``spec`` (a ``PolicySpec``), or plainly when no
    gradient is being recorded; under a tracer, marked for the compiler (``spec`` may then be
    the policy itself: the compiled path names it, ``compile/registry.py``).

    Without a ``name``, the region is named for the module ``fn`` runs on (its qualified
    name if registered, else its class) or for the function. ``contexts``: a context_fn's
    (``selective.Contexts``), entered around the forward inside the region and around its replays.
    """
    if tracing(args, kwargs):  # under dynamo, make_fx, export or fake tensors: marked, not recorded
        policy = spec.policy if isinstance(spec, PolicySpec) else spec
        return traced_region(fn, args, kwargs, policy, name or getattr(fn, "__qualname__", type(fn).__name__))
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    code, on, call_args, call_kwargs = computation(fn, args, kwargs)
    if module is None:
        module = on
    qualified = False
    if name is None:
        if on is not None:
            name = registered_name(on)
            qualified = name is not None
            name = name or type(on).__name__
        else:
            name = getattr(fn, "__qualname__", type(fn).__name__)
    if module_names is None and module is not None:
        module_names = module_table(module, name, qualified)
    with Region(
        spec,
        name,
        module=module,
        module_names=module_names,
        report=report,
        args=call_args,
        kwargs=call_kwargs,
        code=code,
        prefix=f"{name}." if qualified else "",
    ) as region:
        if contexts is not None:
            return contexts.run(region.graph, fn, args, kwargs)
        return fn(*args, **kwargs)


def regions() -> list:
    """The regions running in this thread, outermost first."""
    return list(getattr(_local, "regions", ()))
