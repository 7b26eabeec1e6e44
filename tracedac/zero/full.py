"""``full_parameters(model)``: the full parameters for a block of code, as FSDP's ``summon_full_params``."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..errors import ZeroError
from .module import sharded
from .state_dict import _full_parameters
from .tp import local_value

__all__ = ["full_parameters"]


@contextlib.contextmanager
def full_parameters(module: nn.Module, *, writeback: bool = True):
    """Inside the block every parameter of the sharded ``module`` is a plain full fp32
    ``nn.Parameter`` (shared ones stay shared), for evaluation code, logging or surgery:
    read it, write it in place. On exit each rank keeps its rows of what the block left
    (``writeback=False``: discards writes) and the DTensor shards come back, the same
    objects as before, so an optimizer built on them goes on. Every rank must enter, and
    write the same values. A forward inside the block raises (nothing would be gathered
    or reduced).
    """
    z = sharded(module)
    groups = z.all_groups
    if any(g.summoned for g in groups):
        raise ZeroError("full_parameters() is already active on this model; nest it once.")
    full = _full_parameters(module)
    plain = {}
    for g in groups:
        for s in g.slices:
            plain[id(s.param)] = nn.Parameter(full[id(s.param)], requires_grad=s.param.requires_grad)
            for m, attr in s.uses:
                m._parameters[attr] = plain[id(s.param)]
        g.summoned = True
    try:
        yield module
    finally:
        with torch.no_grad():
            for g in groups:
                for s in g.slices:
                    value = plain[id(s.param)]
                    for m, attr in s.uses:
                        now = m._parameters.get(attr)
                        if now is not value and now is not None and writeback:
                            if now.shape != value.shape:
                                raise ZeroError(
                                    f"{s.fqn!r} was replaced inside full_parameters() by a tensor of shape "
                                    f"{tuple(now.shape)}; it must keep {tuple(value.shape)}."
                                )
                            value = now  # replaced by assignment: its value is what was meant
                        m._parameters[attr] = s.param
                    if writeback:
                        s.local(g.local).copy_(s.rows_of(local_value(s, value.detach()), g.rank, g.world))
                g.summoned = False
