"""Planning a replay: from which live tensors, and through which recorded nodes, the wanted
(storage group, state) pairs are rebuilt (step 1 of ``replay.py``'s pass).

A group starts from a live tensor when all that is wanted of it is its final state and that
tensor has not changed since the region ended (something the policy kept, an outside input,
an enclosing region's handle); from its copy in host memory (a result the policy offloaded,
``offload.HostCopy``) when no state before the copy's is wanted and the tensor has not
changed since; an outside tensor the region wrote starts from the copy taken before the
write; anything else starts by replaying its creator. Then come the
group's writes up to the latest state wanted. A plan that can no longer be followed (a kept
tensor written after the region, a value forgotten) is an error naming what changed.
"""

from __future__ import annotations

from ..errors import CheckpointError
from ..record.decisions import EFFECT_REPLAYED, MUST_RECOMPUTE, PREFER_RECOMPUTE, effect
from ..record.graph import Group, RegionGraph, human_bytes, walk
from ..record.op_info import storage_address

__all__ = ["Plan", "changed_error", "plan"]


def _live(graph: RegionGraph, g: Group):
    """The source of a group's final state that is still valid, or None. While the region
    records, a held or outside tensor is in its group's latest state (``RegionGraph.recording``);
    once it has ended, only if its version counter is where it was then."""
    recording = graph.recording
    if g.held is not None and (recording or g.held._version == g.version):
        return "held"
    if g.external is not None and (recording or (g.external._version == g.version and not _swapped(g))):
        return "external"
    if g.outer is not None:
        return "outer"
    return None


def _swapped(g: Group) -> bool:
    """Whether an outside tensor's storage was replaced since the region first read it
    (``p.data = x``, ``set_``, in the region or after it): the tensor's version counter does not
    move, its storage does."""
    return g.address is not None and storage_address(g.external) != g.address


def _host(graph: RegionGraph, g: Group, lowest: int) -> bool:
    """Whether replay can start ``g`` from its host copy when ``lowest`` is the earliest state wanted."""
    h = g.host
    return h is not None and h.state <= lowest and (graph.recording or h.unchanged)


def _stale(graph: RegionGraph, g: Group) -> bool:
    """Kept or offloaded, then modified by the program after the region ended."""
    if graph.recording:
        return False
    if g.held is not None:
        return g.held._version != g.version
    return g.host is not None and not g.host.unchanged


class _EffectReplayed(CheckpointError):
    """Replay would run a collective (or another op with an effect) again: a value it wrote was
    written again in the region, and backward needs the value from before."""

    def __init__(self, graph: RegionGraph, node, why: str):
        super().__init__(
            f"backward needs the result of {node.name} (node {node.index} of region {graph.name!r}) as it "
            "was before a later in-place write to it, and the region could only rebuild that by running "
            f"{node.name} again, {why}, which tracedac never replays ({EFFECT_REPLAYED}). Write into a "
            "copy (y = y.clone() before the in-place op), or move the write out of the region."
        )


class _Forgotten(CheckpointError):
    """Replay needs a node the region ended sure nothing would replay (a source changed since)."""

    def __init__(self, node):
        super().__init__(
            f"replay needs {node.name} (node {node.index}), which the region did not keep because "
            "nothing was to replay it; something it relied on was modified in place after the "
            "forward. Modify a copy instead, or make the change after backward."
        )


def _unavailable(graph: RegionGraph, g: Group) -> Exception:
    if g.external is not None and _swapped(g):
        return CheckpointError(
            f"{graph.namer(g.external)}, which region {graph.name!r} read, was given another "
            "storage after the forward read it (its .data assigned, or set_, later in the region or "
            "after it), and backward needs the value the forward saw to replay the ops that read "
            "it; the tensor's version counter does not show such a change, so nothing else would "
            "notice. Assign after backward, or update it in place under torch.no_grad() (a write "
            "the version counter sees: refused, or replayed from a kept value)."
        )
    if g.external is not None:
        return CheckpointError(
            f"{graph.namer(g.external)}, which region {graph.name!r} read, was modified in place "
            f"after the forward (version {g.external._version}, read at {g.version}), and "
            "backward needs the value the forward saw to replay the ops that read it. Apply "
            "the update after backward, or keep what the region computed from it with a policy "
            "(tracedac.name(...) on the result and policies.save_names(...))."
        )
    return AssertionError(  # region exit plans every source replay may need: a bug of ours
        f"a storage of {human_bytes(g.nbytes)} that region {graph.name!r} read is needed to "
        "replay its ops but was not kept; this is a tracedac bug, please report it with the "
        "region's code."
    )


def changed_error(graph: RegionGraph, slot) -> CheckpointError:
    if slot.host is not None:
        now, then = slot.host.versions()
        return _kept_changed_error(graph, graph.groups[slot.meta.group], now, then, offloaded=True)
    t = slot.tensor
    if slot.exact:
        return CheckpointError(
            f"{graph.namer(t)}, which region {graph.name!r} read and autograd saved, was "
            f"modified in place after the forward (version {t._version}, saved at "
            f"{slot.version}); its gradient would be computed from the new value. Modify a "
            "copy, or make the change after backward."
        )
    return _kept_changed_error(graph, graph.groups[slot.meta.group], t._version, slot.version)


def _kept_changed_error(graph: RegionGraph, g: Group, now: int, then: int, offloaded=False):
    node = g.node
    kept = "offloaded to host for backward" if offloaded else "kept for backward"
    if node is None:  # an input offloaded (``policies.offload_inputs``)
        return CheckpointError(
            f"an input of region {graph.name!r} that autograd saved, {kept}, was modified in place "
            f"after the forward (version {now}, offloaded at {then}); its gradient would be computed "
            "from the new value. Modify a copy, or make the change after backward."
        )
    return CheckpointError(
        f"the result of {node.name} (node {node.index} of region {graph.name!r}), {kept}, "
        f"was modified in place after the forward (version {now}, {kept.split()[0]} at {then}), "
        "and what it was computed from was not kept, so it cannot be rebuilt. Modify a copy "
        "instead, or use a policy that does not keep it."
    )


def _stale_error(graph: RegionGraph, g: Group) -> CheckpointError:
    if g.held is not None:
        return _kept_changed_error(graph, g, g.held._version, g.version)
    return _kept_changed_error(graph, g, *g.host.versions(), offloaded=True)


class Plan:
    __slots__ = ("starts", "nodes", "wanted", "reads", "_last_use")

    def __init__(self, starts, nodes, wanted, reads):
        self.starts = starts  # group id -> (source kind, state it starts in)
        self.nodes = nodes  # node indices to run, in recorded order
        self.wanted = wanted  # the (group id, state) pairs it was made for
        self.reads = reads  # node index -> its tensor arguments (TensorMeta)
        self._last_use = None

    def last_use(self) -> dict:
        """The last planned node reading each group."""
        if self._last_use is None:
            self._last_use = {m.group: i for i in self.nodes for m in self.reads[i]}
        return self._last_use

    def still_valid(self, graph: RegionGraph, wanted: frozenset) -> bool:
        """Whether this plan still answers ``wanted``: same requests, live sources unchanged."""
        return wanted == self.wanted and all(
            (kind not in ("held", "external") or _live(graph, graph.groups[gid]) == kind)
            and (kind != "host" or _host(graph, graph.groups[gid], state))
            for gid, (kind, state) in self.starts.items()
        )


_CREATE = ("create", 0)


def plan(graph: RegionGraph, wanted) -> Plan:
    """What to run to produce every (group id, state) in ``wanted``."""
    stale = None  # a kept storage the program modified since, if planning had to go around one

    def refuse(error):
        if stale is not None:
            raise _stale_error(graph, stale)
        raise error

    def start_of(g: Group, lowest: int) -> tuple:
        nonlocal stale
        if (
            g.creator is not None
            and g.held is None
            and g.external is None
            and g.outer is None
            and g.host is None
        ):
            return _CREATE  # only its creator to start from (most groups): what the checks below return
        kind = _live(graph, g) if lowest == len(g.mutations) else None
        if kind is not None:
            return (kind, lowest)
        if _host(graph, g, lowest):
            return ("host", g.host.state)
        if _stale(graph, g):
            stale = stale or g  # kept (or offloaded), then modified by the program: must be rebuilt
        if g.creator is None and g.snapshot is not None:
            return ("snapshot", 0)
        if g.creator is None:
            refuse(_unavailable(graph, g))
        return ("create", 0)

    def visit(node) -> None:
        if node.args is None:  # (not node.replayable, inline: once per node)
            refuse(_Forgotten(node))
        # kept by every policy (decisions.effect), unless replay_collectives let the policy
        # replay it (collectives.py): reached only around the kept value. (The decision is
        # read first: a node decided to replay is allowed whatever its op.)
        d = node.decision
        if d is not MUST_RECOMPUTE and d is not PREFER_RECOMPUTE:
            why = effect(node.op)
            if why is not None:
                refuse(_EffectReplayed(graph, node, why))

    starts, chosen, reads = walk(graph, wanted, start_of, visit)
    return Plan(starts, chosen, frozenset(wanted), reads)
