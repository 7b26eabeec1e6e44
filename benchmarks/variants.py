"""The ways of checkpointing the benchmark compares, each applied to its own copy of one model.

Every variant checkpoints the same unit, each ``Block`` of ``model.GPT``, so differences in
time, memory and counted tokens come from the library, not from where it was applied.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.utils.checkpoint import CheckpointPolicy

import tracedac
from tracedac.policies import MATMUL_OPS

from .model import GPT, Block

__all__ = ["VARIANTS", "Variant"]


@dataclass(frozen=True)
class Variant:
    """One way to checkpoint: ``apply`` turns a copy of the base model into the variant."""

    key: str
    label: str
    apply: Callable[[GPT], GPT]
    tracedac: bool = False
    # Returns why the variant cannot run here (e.g. a package is missing), or None.
    unavailable: Callable[[], str | None] = lambda: None

    def build(self, base: GPT) -> GPT:
        return self.apply(copy.deepcopy(base))


def _no_checkpoint(model: GPT) -> GPT:
    return model


def _torch_checkpoint(model: GPT) -> GPT:
    model.checkpoint_fn = functools.partial(torch_checkpoint.checkpoint, use_reentrant=False)
    return model


def _matmul_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    # The op list of tracedac's save_matmuls(), so both sides keep the same results.
    if func.overloadpacket in MATMUL_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _torch_selective(model: GPT) -> GPT:
    context_fn = functools.partial(torch_checkpoint.create_selective_checkpoint_contexts, _matmul_policy)
    model.checkpoint_fn = functools.partial(
        torch_checkpoint.checkpoint, use_reentrant=False, context_fn=context_fn
    )
    return model


class _GeneratorState:
    """A torch_remat ``RecomputeStateHook`` that replays dropout with the forward's numbers.

    torch_remat refuses ``preserve_rng_state=True`` and documents this hook as the way to
    get the same random numbers in its re-run; without it dropout draws new masks and the
    gradients are wrong.
    """

    def __init__(self, device: torch.device):
        self.device = device

    def snapshot(self):
        cpu = torch.get_rng_state()
        if self.device.type == "cuda":
            return cpu, torch.cuda.get_rng_state(self.device)
        return cpu, None

    def restore(self, state) -> None:
        cpu, cuda = state
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, self.device)


def _torch_remat_missing() -> str | None:
    try:
        import torch_remat  # noqa: F401
    except ImportError:
        return "not installed"
    return None


def _torch_remat(model: GPT) -> GPT:
    import torch_remat

    device = next(model.parameters()).device
    names = {id(block): f"blocks.{i}" for i, block in enumerate(model.blocks)}
    hooks = (_GeneratorState(device),)
    wrapped = {}

    def call(block, x):
        fn = wrapped.get(id(block))
        if fn is None:
            fn = wrapped[id(block)] = torch_remat.checkpoint(
                region_name=names[id(block)], recompute_state_hooks=hooks
            )(block)
        return fn(x)

    model.checkpoint_fn = call
    return model


def _tracedac(policy) -> Callable[[GPT], GPT]:
    def apply(model: GPT) -> GPT:
        return tracedac.wrap(model, Block, policy=policy)

    return apply


VARIANTS: tuple[Variant, ...] = (
    Variant("none", "no checkpoint", _no_checkpoint),
    Variant("torch", "torch.utils.checkpoint", _torch_checkpoint),
    Variant("torch_sac", "torch selective (matmuls)", _torch_selective),
    Variant("torch_remat", "torch_remat", _torch_remat, unavailable=_torch_remat_missing),
    Variant(
        "tracedac_recompute_all",
        "tracedac recompute_all",
        _tracedac(tracedac.policies.recompute_all()),
        tracedac=True,
    ),
    Variant(
        "tracedac_save_matmuls",
        "tracedac save_matmuls",
        _tracedac(tracedac.policies.save_matmuls()),
        tracedac=True,
    ),
)
