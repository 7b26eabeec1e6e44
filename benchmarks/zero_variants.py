"""The ZeRO-3 implementations the ``--zero`` benchmark compares, each as a ``Trainer``.

Every variant gets a deep copy of one seeded fp32 model (on the device the base model is
on: CPU, or this rank's GPU) and the same optimizer (AdamW, ``LR``), and is driven the
same way: ``loss = trainer.forward(idx, targets)`` then ``trainer.finish(loss)``
(backward, gradient reduction, optimizer step, gradients cleared). Units are the same
everywhere: each ``Block`` is sharded on its own and the rest of the model (embeddings,
final norm, head) forms the root unit.

- ``replicated``: no sharding; gradients all-reduced and averaged, as DDP does. The
  reference the others' losses are compared with.
- ``tracedac``: ``tracedac.zero.shard``; bf16 with ``MixedPrecision(param_dtype=bf16,
  reduce_dtype=fp32)`` whose low-precision modules are ``nn.Linear`` and the model's
  ``MoE`` (its parameters are the experts' matmul weights); ``tracedac_auto`` (and the
  ``--compile`` rows) with ``MixedPrecision("auto")`` under ``torch.autocast`` (of the
  batch's device type), no list.
- ``fsdp2``: ``fully_shard`` on each block then the root, on a 1-D ``DeviceMesh`` of the
  model's device type (cpu or cuda);
  bf16 with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``. FSDP2's
  defaults otherwise (the root is not resharded after forward).
- ``deepspeed``: ZeRO stage 3 with the same torch AdamW as client optimizer, and
  ``stage3_param_persistence_threshold``, ``stage3_max_reuse_distance`` and
  ``stage3_prefetch_bucket_size`` at 0. By default DeepSpeed keeps parameters under 100k
  elements whole on every rank, and, from the second step on, prefetches the whole model
  in forward (its 5e7-element bucket is larger than this model) and keeps it gathered
  into backward, which then all-gathers about 1% of the bytes: not ZeRO-3 any more. With
  the three at 0 it shards everything and gathers each module again in backward, as the
  others do (without prefetching ahead). bf16 is DeepSpeed's ``bf16`` mode (the model in
  bf16, fp32 master weights in the optimizer, gradients reduced in fp32 via
  ``communication_data_type``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import io
import logging
import os
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import checkpoint as torch_checkpoint

from .model import GPT, MoE

__all__ = ["COMPILED_VARIANTS", "LR", "Trainer", "ZERO_VARIANTS", "ZeroVariant"]

LR = 1e-3


class Trainer:
    """A model and its optimizer; ``finish`` is everything after the forward."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model = model
        self.optimizer = optimizer

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.model(idx, targets)

    def finish(self, loss: torch.Tensor) -> None:
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class _Replicated(Trainer):
    def finish(self, loss: torch.Tensor) -> None:
        loss.backward()
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])  # one all-reduce for all gradients
        dist.all_reduce(flat)
        flat.div_(dist.get_world_size())
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class _DeepSpeed(Trainer):
    """``model`` is DeepSpeed's engine, which runs backward and the optimizer itself."""

    def finish(self, loss):
        self.model.backward(loss)
        self.model.step()  # also clears the gradients


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR)


def _device(model: nn.Module) -> torch.device:
    """Where the model (a copy of the benchmark's base model) lives: cpu or a CUDA device."""
    return next(model.parameters()).device


def _replicated(model: GPT, bf16: bool, per_rank_batch: int) -> Trainer:
    return _Replicated(model, _adamw(model))


def _tracedac(model: GPT, bf16: bool, per_rank_batch: int) -> Trainer:
    from tracedac import zero

    mp = (
        zero.MixedPrecision(torch.bfloat16, torch.float32, low_precision_modules=(nn.Linear, MoE))
        if bf16
        else None
    )
    zero.shard(model, mixed_precision=mp)  # units: each block (a ModuleList child), the rest as root
    return Trainer(model, _adamw(model))


class _Autocast(Trainer):
    """bf16 with ``MixedPrecision("auto")``: torch.autocast around the forward, each parameter
    traveling in the dtype the program computes with it there (eager: decided from the first
    forward; compiled: the gather-cast pass)."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with torch.autocast(idx.device.type, torch.bfloat16):  # cpu or cuda, where the batch is
            return self.model(idx, targets)


def _tracedac_auto(model: GPT, bf16: bool, per_rank_batch: int) -> Trainer:
    """bf16 from the trace: ``MixedPrecision("auto")`` under the caller's autocast, no module list."""
    from tracedac import zero

    zero.shard(model, mixed_precision=zero.MixedPrecision("auto") if bf16 else None)
    return (_Autocast if bf16 else Trainer)(model, _adamw(model))


def _tracedac_checkpointed(model: GPT, bf16: bool, per_rank_batch: int) -> Trainer:
    """Eager: each block a tracedac region (recompute_all), then shard: the compiled row's
    model, not compiled."""
    import tracedac

    for block in model.blocks:
        tracedac.checkpoint(block)
    return _tracedac_auto(model, bf16, per_rank_batch)


def _tracedac_compiled(model: GPT, bf16: bool, per_rank_batch: int) -> Trainer:
    """torchtitan's order: checkpoint each block, shard, compile each block (fullgraph)."""
    import tracedac

    for block in model.blocks:
        tracedac.checkpoint(block)
    trainer = _tracedac_auto(model, bf16, per_rank_batch)
    for block in model.blocks:
        block.compile(fullgraph=True)
    return trainer


def _tracedac_compiled_unchecked(model: GPT, bf16: bool, per_rank_batch: int) -> Trainer:
    """The compiled row with the per-collective order check switched off on this model's
    groups: a measurement of what the check costs (FSDP2 has none), not a configuration a
    user can choose (ranks that diverge would pair different collectives)."""
    from tracedac.zero.module import sharded

    trainer = _tracedac_compiled(model, bf16, per_rank_batch)
    for group in sharded(model).all_groups:
        group.agree = _unchecked
    return trainer


def _unchecked(what, dtype, together=()) -> None:
    return None


def _fsdp2_compiled(model: GPT, bf16: bool, per_rank_batch: int) -> Trainer:
    """fully_shard, then each block's forward compiled with torch's checkpoint inside it
    (FSDP2's hooks stay outside the compiled forward, as torchtitan has them)."""
    trainer = _fsdp2(model, bf16, per_rank_batch)
    for block in model.blocks:
        forward = functools.partial(torch_checkpoint.checkpoint, block.forward, use_reentrant=False)
        block.forward = torch.compile(forward, fullgraph=True)
    return trainer


def _fsdp2_compiled_autocast(model: GPT, bf16: bool, per_rank_batch: int) -> Trainer:
    """The compiled FSDP2 row under the same ``torch.autocast`` as tracedac's bf16 "auto" rows:
    the same computation (matmuls in bf16, norms, softmax and the loss in fp32), where FSDP2's
    plain bf16 row computes everything in bf16 (fewer bytes through every elementwise op)."""
    trainer = _fsdp2_compiled(model, bf16, per_rank_batch)
    return _Autocast(trainer.model, trainer.optimizer) if bf16 else trainer


def _fsdp2(model: GPT, bf16: bool, per_rank_batch: int) -> Trainer:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(_device(model).type, (dist.get_world_size(),))  # "cpu" or "cuda"
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else MixedPrecisionPolicy()
    )
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return Trainer(model, _adamw(model))


def _deepspeed(model: GPT, bf16: bool, per_rank_batch: int) -> Trainer:
    if _device(model).type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when deepspeed is first imported
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # one INFO line per step otherwise
    config = {
        "train_micro_batch_size_per_gpu": per_rank_batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 2**31 - 1,
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": 0,
        },
        "bf16": {"enabled": bf16},
    }
    if bf16:
        config["communication_data_type"] = "fp32"
    # DeepSpeed prints the build of its CPU comm op on every rank's stdout, where only rank 0's
    # table belongs, and calls torch.distributed's *_tensor collectives, deprecated in torch 2.13,
    # once a step each.
    warnings.filterwarnings("ignore", r"`torch\.distributed\.\w+` is deprecated", FutureWarning)
    with contextlib.redirect_stdout(io.StringIO()):
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=_adamw(model), config=config, dist_init_required=False
        )
    return _DeepSpeed(engine, engine.optimizer)


def _no_deepspeed() -> str | None:
    """Why the DeepSpeed rows cannot run, or None. (tracedac.zero and FSDP2 ship with tracedac and torch.)"""
    return (
        None if importlib.util.find_spec("deepspeed") is not None else "not installed (pip install deepspeed)"
    )


@dataclass(frozen=True)
class ZeroVariant:
    """One library at one precision; ``build`` turns a copy of the base model into a Trainer."""

    key: str
    label: str
    library: str  # replicated, tracedac, fsdp2, deepspeed
    bf16: bool
    make: Callable[[GPT, bool, int], Trainer]
    unavailable: Callable[[], str | None] = lambda: None
    baseline: str = "fsdp2"  # the row this one's step time is compared with: {baseline}_{precision}
    compiled: bool = False  # its blocks run compiled graphs

    @property
    def precision(self) -> str:
        return "bf16" if self.bf16 else "fp32"

    def build(self, base: GPT, per_rank_batch: int) -> Trainer:
        return self.make(copy.deepcopy(base), self.bf16, per_rank_batch)


ZERO_VARIANTS: tuple[ZeroVariant, ...] = (
    ZeroVariant("replicated", "replicated (all-reduce) fp32", "replicated", False, _replicated),
    ZeroVariant("tracedac_fp32", "tracedac.zero fp32", "tracedac", False, _tracedac),
    ZeroVariant("fsdp2_fp32", "FSDP2 fp32", "fsdp2", False, _fsdp2),
    ZeroVariant("deepspeed_fp32", "DeepSpeed ZeRO-3 fp32", "deepspeed", False, _deepspeed, _no_deepspeed),
    ZeroVariant("tracedac_bf16", "tracedac.zero bf16", "tracedac", True, _tracedac),
    ZeroVariant("tracedac_auto", "tracedac.zero bf16 auto (autocast)", "tracedac", True, _tracedac_auto),
    ZeroVariant("fsdp2_bf16", "FSDP2 bf16", "fsdp2", True, _fsdp2),
    ZeroVariant("deepspeed_bf16", "DeepSpeed ZeRO-3 bf16", "deepspeed", True, _deepspeed, _no_deepspeed),
)


# ``--zero --compile``: the model with fixed-capacity routing (static shapes), every block
# checkpointed; tracedac compiled against FSDP2 compiled, and against itself eager. The bf16
# "auto" rows (under autocast) are compared with FSDP2 compiled under the same autocast
# (``fsdp2ca``); FSDP2's all-bf16 row, a different computation, is shown beside them.
COMPILED_VARIANTS: tuple[ZeroVariant, ...] = (
    ZeroVariant("replicated", "replicated (all-reduce) fp32", "replicated", False, _replicated),
    ZeroVariant(
        "tracedac_fp32",
        "tracedac.zero eager fp32",
        "tracedac",
        False,
        _tracedac_checkpointed,
        baseline="fsdp2c",
    ),
    ZeroVariant(
        "tracedacc_fp32",
        "tracedac.zero compiled fp32",
        "tracedac",
        False,
        _tracedac_compiled,
        baseline="fsdp2c",
        compiled=True,
    ),
    ZeroVariant(
        "fsdp2c_fp32",
        "FSDP2 compiled fp32",
        "fsdp2",
        False,
        _fsdp2_compiled,
        baseline="fsdp2c",
        compiled=True,
    ),
    ZeroVariant(
        "tracedac_bf16",
        "tracedac.zero eager bf16 auto",
        "tracedac",
        True,
        _tracedac_checkpointed,
        baseline="fsdp2ca",
    ),
    ZeroVariant(
        "tracedacc_bf16",
        "tracedac.zero compiled bf16 auto",
        "tracedac",
        True,
        _tracedac_compiled,
        baseline="fsdp2ca",
        compiled=True,
    ),
    ZeroVariant(
        "fsdp2ca_bf16",
        "FSDP2 compiled bf16 (autocast)",
        "fsdp2",
        True,
        _fsdp2_compiled_autocast,
        baseline="fsdp2ca",
        compiled=True,
    ),
    ZeroVariant(
        "fsdp2c_bf16", "FSDP2 compiled bf16", "fsdp2", True, _fsdp2_compiled, baseline="fsdp2c", compiled=True
    ),
    ZeroVariant(
        "tracedacc_bf16_unchecked",
        "(compiled bf16 auto, no order check)",
        "tracedac",
        True,
        _tracedac_compiled_unchecked,
        baseline="fsdp2ca",
        compiled=True,
    ),
)
