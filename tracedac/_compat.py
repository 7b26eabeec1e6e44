"""Private torch API, and dynamo behaviour, that changed between the torch releases tracedac
supports (>= 2.10), reached through one name each, so a torch upgrade that moves one breaks
here only.

Checked by running the test suite on torch 2.11 and 2.13 (docs/design.md, "Supported torch").
"""

from __future__ import annotations

import functools

import torch
from torch.fx.experimental import symbolic_shapes as _symbolic_shapes

__all__ = ["class_forward", "compiles_zero", "is_exporting", "optimization_hint"]

_VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])

# A SymInt's concrete hint (or ``fallback`` when it has none): ``optimization_hint`` in torch
# 2.13, ``hint_int`` in 2.11.
optimization_hint = getattr(_symbolic_shapes, "optimization_hint", None) or _symbolic_shapes.hint_int


def is_exporting() -> bool:
    """Whether ``torch.export`` is tracing. torch 2.11's dynamo answers
    ``torch.compiler.is_exporting()`` True under every trace, ``torch.compile``'s included (2.13
    reads the flag); the flag itself is right in both."""
    return torch.compiler._is_exporting_flag


def class_forward(module):
    """``type(module).forward`` bound to ``module``, bypassing an instance ``forward``. A
    partial, not ``forward.__get__(module)``: torch 2.11's dynamo cannot trace ``__get__``."""
    return functools.partial(type(module).forward, module)


def compiles_zero(dynamo: bool) -> bool:
    """Raise, at trace time, where dynamo (``dynamo``: whether it is the tracer) cannot compile
    ``tracedac.zero``: torch before 2.13, whose dynamo cannot trace the removal of a gathered
    view from the module's ``__dict__`` (``__dict__.pop``, ``del``, ``object.__delattr__``:
    "Unsupported method call" on 2.11). ``make_fx`` and fake tensors trace it there."""
    if dynamo and _VERSION < (2, 13):
        from .zero.errors import ZeroError

        raise ZeroError(
            f"tracedac.zero under torch.compile needs torch 2.13 or newer (this is {torch.__version__}): "
            "dynamo before it cannot trace how a sharded unit puts its parameters back after "
            "forward. Upgrade torch, or run the sharded model eagerly (tracedac's checkpoint regions "
            "compile on this torch)."
        )
    return True


compiles_zero._dynamo_marked_constant = True  # run at trace time, its result a constant
