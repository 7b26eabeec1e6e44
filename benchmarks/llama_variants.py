"""The ways ``llama_steps`` checkpoints (or offloads, or compiles) each ``DecoderLayer``: one
``Variant`` each, ``apply`` turning a copy of the model into the variant's. See
``llama_steps`` for the list in words."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

import tracedac
from tracedac import policies
from tracedac.policies import MATMUL_OPS

from .llama import DecoderLayer, Llama

__all__ = ["BUDGET", "VARIANTS", "Variant"]

_SAC_OPS = set(MATMUL_OPS) | {
    torch.ops.aten._scaled_dot_product_flash_attention,
    torch.ops.aten._scaled_dot_product_efficient_attention,
    torch.ops.aten._scaled_dot_product_cudnn_attention,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
}


class _Checkpointed(nn.Module):
    """A layer called through ``fn(layer, x)``: torch's checkpoint functions."""

    def __init__(self, layer: nn.Module, fn: Callable):
        super().__init__()
        self.layer = layer
        self.fn = fn

    def forward(self, x):
        return self.fn(self.layer, x)


def _sac_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    return (
        CheckpointPolicy.MUST_SAVE if func.overloadpacket in _SAC_OPS else CheckpointPolicy.PREFER_RECOMPUTE
    )


def _torch(context_fn=None) -> Callable[[Llama], nn.Module]:
    kwargs = (
        {"use_reentrant": False} if context_fn is None else {"use_reentrant": False, "context_fn": context_fn}
    )
    fn = functools.partial(torch_checkpoint.checkpoint, **kwargs)

    def apply(model: Llama) -> nn.Module:
        model.layers = nn.Sequential(*(_Checkpointed(layer, fn) for layer in model.layers))
        return model

    return apply


def _tracedac(policy) -> Callable[[Llama], nn.Module]:
    return lambda model: tracedac.wrap(model, DecoderLayer, policy=policy)


def _compiled(model: Llama) -> nn.Module:
    return torch.compile(_torch()(model))


def _per_block(apply: Callable[[Llama], nn.Module]) -> Callable[[Llama], nn.Module]:
    """``apply``, then each layer compiled on its own with ``fullgraph=True``, as torchtitan does
    (one graph per layer, its checkpoint inside it)."""

    def compiled(model: Llama) -> nn.Module:
        model = apply(model)
        for layer in model.layers:
            layer.compile(fullgraph=True)
        return model

    return compiled


def _torch_offload_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """torch's selective checkpoint sending the matmuls' and attention's results to the host."""
    return (
        CheckpointPolicy.MUST_CPU_OFFLOAD
        if func.overloadpacket in _SAC_OPS
        else CheckpointPolicy.PREFER_RECOMPUTE
    )


def _no_torch_offload() -> str | None:
    return (
        None
        if hasattr(CheckpointPolicy, "MUST_CPU_OFFLOAD")
        else f"torch {torch.__version__} has no CheckpointPolicy.MUST_CPU_OFFLOAD"
    )


def _save_on_cpu() -> contextlib.AbstractContextManager:
    return torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())


@contextlib.contextmanager
def _recorded():
    """Every region call recorded in full: tracedac's warm path off (docs/design.md, "The warm
    path"), as before it existed."""
    before = tracedac.warm_path(False)
    try:
        yield
    finally:
        tracedac.warm_path(before)


@dataclass(frozen=True)
class Variant:
    key: str
    label: str
    apply: Callable[[Llama], nn.Module]
    compiled_replay: bool = False  # set for the variant's steps: the other rows replay op by op
    fusion: str = "exact"  # compiled replay's fusion for the variant's steps (tracedac's default)
    # around each step (torch's save_on_cpu)
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    # torch._functorch.config while the variant compiles (its warm-up steps)
    functorch_config: tuple[tuple[str, object], ...] = ()
    unavailable: Callable[[], str | None] = lambda: None


BUDGET = 0.5
_TIGHT = 0.2
_MATMULS = tuple(MATMUL_OPS)
_sac = functools.partial(torch_checkpoint.create_selective_checkpoint_contexts, _sac_policy)

VARIANTS = (
    Variant("none", "no checkpoint", lambda m: m),
    Variant("torch", "torch checkpoint", _torch()),
    Variant("torch_sac", "torch selective (matmuls + attention)", _torch(_sac)),
    Variant(
        "tracedac_recompute_all", "tracedac recompute_all, op by op", _tracedac(policies.recompute_all())
    ),
    Variant(
        "tracedac_compiled_replay",
        "tracedac recompute_all, compiled replay",
        _tracedac(policies.recompute_all()),
        compiled_replay=True,
    ),
    Variant(
        "tracedac_compiled_replay_all",
        "tracedac recompute_all, compiled replay fusing all (within rounding)",
        _tracedac(policies.recompute_all()),
        compiled_replay=True,
        fusion="all",
    ),
    Variant(
        "tracedac_recompute_all_recorded",
        "tracedac recompute_all, op by op, every call recorded (warm path off)",
        _tracedac(policies.recompute_all()),
        context=_recorded,
    ),
    Variant("tracedac_save_matmuls", "tracedac save_matmuls, op by op", _tracedac(policies.save_matmuls())),
    Variant(
        "tracedac_save_matmuls_recorded",
        "tracedac save_matmuls, op by op, every call recorded (warm path off)",
        _tracedac(policies.save_matmuls()),
        context=_recorded,
    ),
    Variant(
        "tracedac_save_matmuls_cr",
        "tracedac save_matmuls, compiled replay",
        _tracedac(policies.save_matmuls()),
        compiled_replay=True,
    ),
    Variant(
        "tracedac_save_matmuls_cr_all",
        "tracedac save_matmuls, compiled replay fusing all (within rounding)",
        _tracedac(policies.save_matmuls()),
        compiled_replay=True,
        fusion="all",
    ),
    Variant(
        "tracedac_budget",
        f"tracedac memory_budget({BUDGET}), op by op",
        _tracedac(policies.memory_budget(BUDGET)),
    ),
    Variant(
        "tracedac_budget_cr",
        f"tracedac memory_budget({BUDGET}), compiled replay",
        _tracedac(policies.memory_budget(BUDGET)),
        compiled_replay=True,
    ),
    # offload (eager): what goes to the host, and who decides
    Variant("save_on_cpu", "torch save_on_cpu (everything offloaded)", lambda m: m, context=_save_on_cpu),
    Variant(
        "torch_sac_offload",
        "torch selective, matmuls + attention offloaded",
        _torch(
            functools.partial(torch_checkpoint.create_selective_checkpoint_contexts, _torch_offload_policy)
        ),
        unavailable=_no_torch_offload,
    ),
    Variant(
        "tracedac_offload_matmuls",
        "tracedac offload_ops(matmuls)",
        _tracedac(policies.offload_ops(*_MATMULS)),
    ),
    Variant(
        "tracedac_offload_all",
        "tracedac offload_kept(save_all) (every result offloaded, layer inputs kept)",
        _tracedac(policies.offload_kept(policies.save_all())),
    ),
    Variant(
        "tracedac_offload_everything",
        "tracedac offload_inputs(offload_kept(save_all)) (everything offloaded)",
        _tracedac(policies.offload_inputs(policies.offload_kept(policies.save_all()))),
    ),
    # layer inputs to the host, everything else replayed: transformers' offload=True
    Variant(
        "torch_ckpt_save_on_cpu",
        "torch checkpoint in save_on_cpu (layer inputs offloaded)",
        _torch(),
        context=_save_on_cpu,
    ),
    Variant(
        "tracedac_offload_inputs",
        "tracedac offload_inputs() (layer inputs offloaded)",
        _tracedac(policies.offload_inputs()),
    ),
    Variant(
        "tracedac_budget_offload",
        f"tracedac memory_budget({BUDGET}, offload=True)",
        _tracedac(policies.memory_budget(BUDGET, offload=True)),
    ),
    Variant("tracedac_tight", f"tracedac memory_budget({_TIGHT})", _tracedac(policies.memory_budget(_TIGHT))),
    Variant(
        "tracedac_tight_offload",
        f"tracedac memory_budget({_TIGHT}, offload=True)",
        _tracedac(policies.memory_budget(_TIGHT, offload=True)),
    ),
    # compiled: each layer its own graph (fullgraph), as torchtitan compiles
    Variant("c_torch", "compiled: torch checkpoint", _per_block(_torch())),
    Variant("c_torch_sac", "compiled: torch selective (matmuls + attention)", _per_block(_torch(_sac))),
    Variant(
        "c_budget_torch",
        f"compiled: no checkpoint, activation_memory_budget={BUDGET}",
        _per_block(lambda m: m),
        functorch_config=(("activation_memory_budget", BUDGET),),
    ),
    Variant(
        "c_tracedac_recompute_all",
        "compiled: tracedac recompute_all",
        _per_block(_tracedac(policies.recompute_all())),
    ),
    Variant(
        "c_tracedac_save_matmuls",
        "compiled: tracedac save_matmuls",
        _per_block(_tracedac(policies.save_matmuls())),
    ),
    Variant(
        "c_tracedac_budget",
        f"compiled: tracedac memory_budget({BUDGET})",
        _per_block(_tracedac(policies.memory_budget(BUDGET))),
    ),
    Variant("torch_compile", "torch.compile (whole model), torch checkpoint", _compiled),
)
