"""Policies that wrap a whole policy: ``offload_kept`` (what it would keep goes to host memory
instead), ``offload_inputs`` (the region's inputs autograd computed go too), and
``collectives.replay_collectives``, all on one base (``Wrapper``)."""

from __future__ import annotations

from dataclasses import dataclass

from torch.utils.checkpoint import CheckpointPolicy

from ..record.decisions import MUST_CPU_OFFLOAD, MUST_SAVE, PREFER_CPU_OFFLOAD, PREFER_SAVE, decision
from .held import Held, check_policy, describe_policy, interning
from .per_op import recompute_all
from .planners import planner_of

__all__ = ["OffloadInputs", "OffloadKept", "Wrapper", "offload_inputs", "offload_kept"]


class Wrapper(Held):
    """A policy around ``self.policy`` (a dataclass field of the subclass): it decides as that
    one unless the subclass says otherwise, and answers for it what a region asks of its policy
    (its constant decision, its planner, whether it offloads what it keeps)."""

    policy: object
    structural = True  # as structural as the policy it wraps (``spec._all`` asks that one too)

    @property
    def constant(self):
        return getattr(self.policy, "constant", None)

    @property
    def planner(self):
        return planner_of(self.policy)

    @property
    def offloads_kept(self):
        return getattr(self.policy, "offloads_kept", False)

    def __call__(self, node) -> CheckpointPolicy:
        return decision(self.policy, node)


_TO_HOST = {MUST_SAVE: MUST_CPU_OFFLOAD, PREFER_SAVE: PREFER_CPU_OFFLOAD}


@dataclass(frozen=True)
class OffloadKept(Wrapper):
    """Offload to host memory what ``policy`` would keep on the device: its SAVE decisions
    become CPU_OFFLOAD ones, and a planner's choice is offloaded instead of kept."""

    policy: object
    offloads_kept = True  # read by the region's planning (plan_cache.Planning)

    @property
    def constant(self):
        c = getattr(self.policy, "constant", None)
        return _TO_HOST.get(c, c)

    def __call__(self, node) -> CheckpointPolicy:
        d = decision(self.policy, node)
        return _TO_HOST.get(d, d)

    def __repr__(self) -> str:
        return f"offload_kept({describe_policy(self.policy)})"


@dataclass(frozen=True)
class OffloadInputs(Wrapper):
    """``policy``, and at the region's end its inputs that autograd computed go to host memory
    (``offload.settle``): the tensors the region received as arguments, kept for backward as
    eager keeps them, made by ops with a gradient (a layer's input, the layer before's output).
    Leaves (parameters, the program's own inputs, constants) stay: their owners hold them."""

    policy: object
    offloads_inputs = True  # read by the region (``decisions.inner_flag``)

    def __repr__(self) -> str:
        return f"offload_inputs({describe_policy(self.policy)})"


@interning
def offload_kept(policy) -> OffloadKept:
    """Offload to host memory what ``policy`` would keep on the device, e.g.
    ``offload_kept(memory_budget(0.3))`` (what Hugging Face's ``offload=True`` maps to). Inputs
    the region keeps as eager keeps them (arguments, parameters) stay where they are."""
    check_policy(policy)
    if isinstance(policy, OffloadKept):
        return policy
    return OffloadKept(policy)


@interning
def offload_inputs(policy=None) -> OffloadInputs:
    """Offload to host memory, at the region's end, the region's inputs autograd computed and
    saved (a decoder layer's input: ``layers x tokens x hidden`` bytes, what dominates memory at
    long sequence lengths under full recompute), as well as whatever ``policy`` offloads
    (default ``recompute_all()``: replay everything else, as Hugging Face's ``offload=True``
    does with torch's checkpoint and ``save_on_cpu``). Leaves stay (parameters, the program's own
    inputs, constants: their owners hold them), and so does an input an enclosing region
    computed (it replays it) or ``tracedac.zero`` gathered (gathered again); a tensor handed to
    several regions is copied by each."""
    if policy is None:
        policy = recompute_all()
    check_policy(policy)
    if isinstance(policy, OffloadInputs):
        return policy
    return OffloadInputs(policy)
