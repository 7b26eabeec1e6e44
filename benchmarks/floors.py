"""Floors under tracedac's recorder: what any recorder written in Python pays.

The tracing section of the main benchmark runs the same blocks under each of these beside
plain and beside tracedac, so the cost of recording splits into what Python dispatch
costs, what the least possible record costs on top, and what tracedac adds to that.

- ``EmptyMode`` runs each op and nothing else: the price of seeing aten ops from Python.
- ``LeastRecorder`` also writes down the least a recorder must for backward to replay the
  region, and turns autograd's saved tensors into records, as any checkpoint must (or
  autograd would keep them). It keeps no mutation order, random state or policy decision,
  and cannot replay: a floor to measure against, not a checkpoint.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["EmptyMode", "LeastRecorder", "under_empty_mode", "under_least_recorder"]

_Tensor = torch.Tensor
# A storage's address without making a Python storage object: the same lookup as tracedac's
# recorder (tracedac/op_info.py's storage_address), written here so the benchmark stands alone.
_address = getattr(torch._C, "_storage_address", None) or (lambda t: t.untyped_storage()._cdata)
_SEQUENCES = (list, tuple)


class EmptyMode(TorchDispatchMode):
    """Runs each op and nothing else: the floor of any dispatch-level recorder in Python."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # as tracedac's mode: no dynamo-disable frame around each call

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func._op(*args, **(kwargs or {}))


class LeastRecorder(EmptyMode):
    """Records each op that is not a pure view: the op, its arguments with each tensor as
    (storage number, size, stride, offset), and a number for each storage first seen, whose
    address a weak reference pins until ``close()`` so that it cannot be reused meanwhile."""

    _views: dict = {}  # id(op) -> whether it is a pure view, shared by every instance

    def __init__(self):
        super().__init__()
        self.storages: dict[int, int] = {}  # storage address -> its number
        self.pins: list = []
        self.ops: list[tuple] = []
        self.saved: list[tuple] = []  # what autograd saved, as records

    def record(self, t: _Tensor) -> tuple:
        number = self.storages.get(_address(t))
        if number is None:
            storage = t.untyped_storage()
            number = self.storages[storage._cdata] = len(self.storages)
            self.pins.append(storage._weak_ref())
        return number, t.size(), t.stride(), t.storage_offset()

    def _arg(self, a):
        if isinstance(a, _Tensor):
            return self.record(a)
        if a.__class__ in _SEQUENCES:
            return [self.record(x) if isinstance(x, _Tensor) else x for x in a]
        return a

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        view = self._views.get(id(func))
        if view is None:
            view = self._views[id(func)] = bool(getattr(func, "is_view", False))
        if view:
            return func._op(*args, **kwargs)
        margs = [self._arg(a) for a in args]
        mkwargs = {k: self._arg(v) for k, v in kwargs.items()}
        out = func._op(*args, **kwargs)
        flat = (out,) if isinstance(out, _Tensor) else out if isinstance(out, _SEQUENCES) else ()
        outs = [o for o in flat if isinstance(o, _Tensor)]
        if not self._writes(func) and all(_address(o) in self.storages for o in outs):
            return out  # an alias of what it read (``_unsafe_view``): as tracedac, nothing to record
        self.ops.append((func, margs, mkwargs, [self.record(o) for o in outs]))
        return out

    _writing: dict = {}  # id(op) -> whether its schema writes an argument, shared by every instance

    def _writes(self, func) -> bool:
        writes = self._writing.get(id(func))
        if writes is None:
            args = func._schema.arguments
            writes = self._writing[id(func)] = any(
                a.alias_info is not None and a.alias_info.is_write for a in args
            )
        return writes

    def pack(self, t: _Tensor) -> tuple:
        record = self.record(t)
        self.saved.append(record)
        return record

    @staticmethod
    def unpack(record):
        raise RuntimeError("LeastRecorder times forwards only; it cannot rebuild a saved tensor for backward")

    def close(self) -> None:
        free = torch.UntypedStorage._free_weak_ref
        for handle in self.pins:
            free(handle)
        self.pins = []
        self.storages = {}


def under_empty_mode(block, x: _Tensor) -> _Tensor:
    """A ``GPT.checkpoint_fn``: the block under ``EmptyMode``."""
    with EmptyMode():
        return block(x)


def under_least_recorder(block, x: _Tensor) -> _Tensor:
    """A ``GPT.checkpoint_fn``: the block recorded by a ``LeastRecorder``, which then lets go
    (a forward to time; backward through it raises)."""
    recorder = LeastRecorder()
    try:
        with torch.autograd.graph.saved_tensors_hooks(recorder.pack, recorder.unpack), recorder:
            return block(x)
    finally:
        recorder.close()
