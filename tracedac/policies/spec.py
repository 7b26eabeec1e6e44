"""A policy's contract with the regions it runs: ``PolicySpec``, worked out once by ``spec_of``.

A policy is a callable ``policy(node) -> CheckpointPolicy``. What else a region must know of
it is read here, once, where the policy is checked (``checkpoint``, ``wrap``,
``checkpoint_call``, ``hf.enable``, a compiled region's pass), into a frozen description the
region receives; nothing probes the policy later. tracedac's own policy classes declare their
abilities as class attributes, and a flag of a policy they combine or wrap counts too
(``either(...)``, ``offload_kept(...)``):

- ``constant``: the decision for every node (``recompute_all()``): a region need not ask.
- ``planner``: the whole-graph planner inside (``either(save_names("x"), memory_budget(b))``).
- ``offloads_kept``: what it keeps goes to host memory instead (``offload_kept``).
- ``offloads_inputs``: the region's computed inputs leave the device at its end (``offload_inputs``).
- ``reads_values``: asked with the op's real tensors (torch's selective checkpointing).
- ``replays_collectives``: it decides functional collectives itself (``replay_collectives``).
- ``labels``: the ``tracedac.name`` labels it asks for (``save_names``, ``offload_names``): a
  region none of whose results carries one of them warns, once (a typo keeps nothing).
- ``structural``: it decides each node from what a repeated structure fixes (the op, its
  outputs' shapes and dtypes, its labels), never from module paths, values or a state of its
  own, so a call that repeats a recorded one may take that one's decisions (the warm path,
  ``record/warm.py``). All of a combined or wrapped policy's policies must be.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from torch.utils.checkpoint import CheckpointPolicy

from .held import check_policy, fields_of, hold
from .planners import planner_of

__all__ = ["PolicySpec", "spec_of"]


def _labels(policy) -> frozenset:
    """The labels ``policy``, or one it combines or wraps, asks for."""
    own = getattr(policy, "labels", None)
    found = frozenset(own) if isinstance(own, (set, frozenset)) else frozenset()
    inner = getattr(policy, "policies", None) or (getattr(policy, "policy", None),)
    return found.union(*(_labels(p) for p in inner if p is not None and p is not policy))


def _all(policy, name: str) -> bool:
    """Whether ``policy`` and every policy it combines or wraps are of classes that set ``name``."""
    if getattr(policy, name, False) is not True:
        return False
    inner = getattr(policy, "policies", None) or (getattr(policy, "policy", None),)
    return all(p is None or p is policy or _all(p, name) for p in inner)


def _flag(policy, name: str) -> bool:
    """Whether ``policy``, or one it combines or wraps, is of a class that sets ``name``."""
    if getattr(policy, name, False) is True:
        return True
    inner = getattr(policy, "policies", None) or (getattr(policy, "policy", None),)
    return any(p is not None and p is not policy and _flag(p, name) for p in inner)


@dataclass(frozen=True, eq=False)
class PolicySpec:
    """What a region needs of its policy, read once (``spec_of``)."""

    policy: object
    constant: CheckpointPolicy | None  # the decision for every node, for a policy that never looks
    planner: object | None  # the whole-graph planner inside, or None
    offloads_kept: bool  # what it keeps goes to host memory
    offloads_inputs: bool  # the region's computed inputs go to host memory at its end
    reads_values: bool  # asked with the op's real tensors while it records
    replays_collectives: bool  # decides functional collectives itself (checked across ranks)
    labels: frozenset = frozenset()  # the tracedac.name labels it asks for
    structural: bool = False  # decides from the structure alone: a repeated call may reuse its decisions
    # the policy as a value holding no policy object (its class and fields), for the warm path's
    # cache key: a policy made every step (policy=save_names(...) in the loop) is not kept by it
    value: object = None

    def __reduce__(self):
        """Pickled as its policy, read again where it is loaded (``torch.save`` of a whole
        checkpointed model: ``value`` holds the policy's ops, which do not pickle)."""
        return spec_of, (self.policy,)

    # (read by every region: worked out on first use, then kept)
    @functools.cached_property
    def timing(self) -> bool:
        """Whether the planner prices replay by recorded durations (the region times its ops)."""
        return getattr(self.planner, "cost", None) == "time"

    @functools.cached_property
    def may_offload(self) -> bool:
        """Whether anything may go to host memory (the region settles host copies at its end)."""
        planner_offloads = self.planner is not None and getattr(self.planner, "offload", False) is not False
        return self.offloads_kept or self.offloads_inputs or planner_offloads

    @functools.cached_property
    def warm(self) -> bool:
        """Whether its regions may run warm (``record/warm.py``): it decides from the structure
        alone, and none of what the warm path leaves to a full record (timing ops, reading their
        values, offloading, replaying collectives checked across ranks)."""
        return (
            self.structural
            and not self.timing
            and not self.reads_values
            and not self.may_offload
            and not self.replays_collectives
        )


def spec_of(policy) -> PolicySpec:
    """``policy`` checked (a TypeError says what to pass instead), held by id while it lives
    (``held.hold``: a compiled region names it so), and described."""
    check_policy(policy)
    hold(policy)
    return PolicySpec(
        policy=policy,
        constant=getattr(policy, "constant", None),
        planner=planner_of(policy),
        offloads_kept=getattr(policy, "offloads_kept", False) is True,
        offloads_inputs=_flag(policy, "offloads_inputs"),
        reads_values=_flag(policy, "reads_values"),
        replays_collectives=_flag(policy, "replays_collectives"),
        labels=_labels(policy),
        structural=_all(policy, "structural"),
        value=_value(policy),
    )


def _value(x):
    """A frozen dataclass policy as (its class, its fields' values), policies inside it in turn."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return (type(x), tuple(_value(v) for v in fields_of(x)))
    if isinstance(x, (tuple, list)):
        return tuple(_value(y) for y in x)
    return x
