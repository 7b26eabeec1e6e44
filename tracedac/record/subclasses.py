"""Tensor subclasses in a region: recorded beneath them, saved as their inner tensors.

A traceable wrapper subclass (``DTensor``, torchao's float8 training tensor, torch's
``TwoTensor``, an ``AsyncCollectiveTensor``) holds plain tensors and runs every op by
calling ops on them (its ``__torch_dispatch__``), and can be taken apart and put back
together (``__tensor_flatten__`` / ``__tensor_unflatten__``). So the recorder records no op
on a subclass: it declines it (``NotImplemented``), the subclass's own dispatch runs, and
the plain ops it calls reach the recorder as any program's ops do: DTensor's
redistributions among them, functional collectives kept as every collective is. What
autograd saves is the subclass; the region saves its flattened form instead
(``Flattened``): a handle per inner tensor and the subclass's own recipe to rebuild it.
Backward rebuilds the inner tensors as any other and unflattens them; autograd attaches the
history it noted at save time, as it does for every saved tensor.

Policies therefore see the ops a plain program runs (a DTensor matmul is an ``aten.mm`` on
the local shards), and replay runs exactly those. A subclass that cannot be taken apart (no
``__tensor_flatten__``) is recorded beneath the same way; autograd's saved copy of it is held
as it is (``Held``), as eager holds it.
"""

from __future__ import annotations

import torch

from .._compat import is_fake_type, is_wrapper_subclass
from ..errors import CheckpointError

__all__ = [
    "Constant",
    "Flattened",
    "Held",
    "check_replayable",
    "decline",
    "has_subclass",
    "is_subclass",
    "saved",
]

_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer)
_DISABLED = torch._C._disabled_torch_dispatch_impl


def is_subclass(t: torch.Tensor) -> bool:
    """Whether ``t`` is a subclass with a dispatch of its own (not a plain tensor, parameter
    or buffer, nor a subclass that only adds Python methods)."""
    return _own_dispatch(type(t))


_SEEN: dict = {}  # types -> whether they name a subclass with a dispatch of its own


def has_subclass(types) -> bool:
    """Whether the ``types`` a dispatch mode is given name a subclass with a dispatch of its
    own (they may name plain ``torch.Tensor`` too). One lookup per op after the first sight of
    its argument types (the classes are held: few, and alive for the process anyway)."""
    try:
        known = _SEEN.get(types)
    except TypeError:  # (torch hands a tuple; anything else is looked at each time)
        return any(_own_dispatch(t) for t in types)
    if known is None:
        known = _SEEN[types] = any(_own_dispatch(t) for t in types)
    return known


def _own_dispatch(cls) -> bool:
    return cls not in _PLAIN_TYPES and cls.__torch_dispatch__ is not _DISABLED


def _unreplayable(t: torch.Tensor, where: str) -> CheckpointError:
    return CheckpointError(
        f"a {type(t).__name__} (a tensor subclass) {where} inside a checkpointed region, where "
        "tracedac expected a plain tensor: it records the plain ops beneath a subclass's own "
        "dispatch, and this subclass reached the recorder itself (an op on plain tensors that "
        "returns one), so it could not be replayed. Make it outside the region, or checkpoint "
        "a region that does not make it."
    )


def decline(func, types, args, kwargs):
    """What the recorder does with an op that has a subclass among its arguments: a fake
    tensor's op (DTensor's sharding propagation runs ops on fake tensors to learn shapes)
    runs unrecorded; any other gets ``NotImplemented``, so that the subclass's own dispatch
    runs and calls the plain ops the recorder records. (Never raises: metadata ops such as
    ``sym_size`` reach a mode from C++, where an exception aborts the process.)"""
    if any(is_fake_type(t) for t in types if t not in _PLAIN_TYPES):
        return func._op(*args, **kwargs)
    return NotImplemented


def saved(t: torch.Tensor, pack):
    """The handle for a subclass autograd saves: flattened when it can be taken apart, else
    held as it is (``Held``)."""
    return Flattened(t, pack) if is_wrapper_subclass(t) else Held(t)


def check_replayable(t: torch.Tensor, producer=None) -> None:
    """Refuse what tracedac cannot replay: ``t`` reached an op, or ``producer`` returned it."""
    where = "reached an op" if producer is None else f"was returned by {producer}"
    if is_subclass(t):
        raise _unreplayable(t, where)
    if t.layout is not torch.strided or (t.is_complex() and (t.is_conj() or t.is_neg())):
        raise CheckpointError(
            f"a tensor with layout {t.layout} (or a lazy conjugate/negative bit) {where} "
            "inside a checkpointed region; tracedac records and replays strided tensors on "
            "storages only. Call .to_dense() / .resolve_conj() before the region, or do the "
            "sparse (or other non-strided) work outside it."
        )


class Flattened:
    """A handle on a saved subclass tensor: a handle per inner tensor (made by ``pack``; a
    subclass inside a subclass is flattened in turn) and what ``__tensor_unflatten__`` needs.

    A write to the subclass after it was saved (``dtensor.add_(1)``) bumps its own version
    counter, not its inner tensors' (the subclass's dispatch runs below autograd), so the
    inner handles cannot see it: the handle keeps a tensor sharing the subclass's counter and
    nothing else, and refuses a changed one as eager's autograd does."""

    __slots__ = ("cls", "context", "inner", "size", "stride", "counter", "version")

    def __init__(self, t: torch.Tensor, pack):
        self.counter, self.version = _counter(t)
        names, self.context = t.__tensor_flatten__()
        self.cls = type(t)
        # (torch 2.13's DTensor lists its device mesh among its "inner tensors": kept as is)
        self.inner = {name: _pack_inner(getattr(t, name), pack) for name in names}
        self.size = t.size()
        self.stride = t.stride()

    def leaves(self):
        """The handles of the plain tensors inside, nested subclasses' included."""
        for h in self.inner.values():
            if isinstance(h, (Flattened, Held, Constant)):
                yield from h.leaves()
            else:
                yield h

    def unpack(self) -> torch.Tensor:
        _check_version(self.counter, self.version, self.cls, self.size)
        inner = {name: h.unpack() for name, h in self.inner.items()}
        return self.cls.__tensor_unflatten__(inner, self.context, self.size, self.stride)


class Constant:
    """An inner object handed back as it is: one that is not a tensor (a DTensor's device
    mesh), or a tensor its packer keeps (``zero/unit.py``)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def leaves(self):
        return iter(())

    def unpack(self):
        return self.value


def _pack_inner(x, pack):
    return pack(x) if isinstance(x, torch.Tensor) else Constant(x)


class Held:
    """A handle on a saved subclass that cannot be taken apart (no ``__tensor_flatten__``):
    the tensor itself, as eager autograd holds it (nothing of it is replayed, and reports,
    which count storages, do not see it), refused at unpack if written since."""

    __slots__ = ("tensor", "counter", "version")

    def __init__(self, t: torch.Tensor):
        self.tensor = t
        self.counter, self.version = _counter(t)

    def leaves(self):
        return iter(())

    def unpack(self) -> torch.Tensor:
        t = self.tensor
        _check_version(self.counter, self.version, type(t), t.size())
        return t


def _counter(t: torch.Tensor):
    """A tensor sharing ``t``'s version counter and holding nothing of it, and the version."""
    with torch._C._DisableTorchDispatch():  # below the subclass: an alias of its empty storage
        return torch.Tensor.detach(t), t._version


def _check_version(counter, version, cls, size) -> None:
    if counter._version != version:
        raise CheckpointError(
            f"a {cls.__name__} of shape {list(size)} saved for backward in a checkpointed region "
            f"was modified by an inplace operation after it was saved (version {counter._version}, "
            f"saved at {version}); eager autograd refuses it too, since backward needs the value "
            "it had. Write a copy instead (x = x.add(1), not x.add_(1)), or write it before the op "
            "that saves it."
        )
