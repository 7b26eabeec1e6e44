"""Private torch API, and dynamo behaviour, that changed between the torch releases tracedac
supports (>= 2.10), reached through one name each, so a torch upgrade that moves one breaks
here only.

Checked by running the test suite on torch 2.11 and 2.13 (docs/design.md, "Supported torch").
"""

from __future__ import annotations

import functools

import torch
from torch.fx.experimental import symbolic_shapes as _symbolic_shapes

__all__ = ["class_forward", "graph_input_sources", "is_exporting", "op_effect", "optimization_hint", "trace_time_error"]

# (torch major, minor): zero/unit.py's compiles_zero reads it
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


def op_effect(op):
    """The effect ``op`` was registered with (``register_effect`` of a ``torch.library`` op,
    torch's own ``_register_effectful_op``), or None. ``_get_effect`` in torch 2.10 to 2.13."""
    from torch._higher_order_ops import effects

    get = getattr(effects, "_get_effect", None)
    if get is not None:
        return get(op)
    return getattr(effects, "SIDE_EFFECTS", {}).get(op)
