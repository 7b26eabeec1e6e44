"""The peak of a step's live tensor bytes on the CPU, measured from outside tracedac.

``LivePeak(*alive)`` is entered around a step: it counts the storages of the tensors it is
given (what is alive before the step: parameters, gradients, optimizer state, the batch) and
every storage an op returns while it is active (a dispatch mode, so the forward, backward and
optimizer step are all seen), and drops each when its storage dies (a weak reference on the
storage). ``peak`` is the most bytes alive at once. It is written apart from the library's own
meter (``tracedac.policies.meter``), which finds what is alive by the garbage collector: the
tests compare the library's promise with this count.
"""

from __future__ import annotations

import gc
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LivePeak(TorchDispatchMode):
    def __init__(self, *alive):
        super().__init__()
        self.sizes: dict[int, int] = {}
        self.watchers: dict[int, weakref.ref] = {}
        self.level = self.peak = 0
        for t in tree_leaves(alive):
            if isinstance(t, torch.Tensor):
                self._count(t)
        self.start = self.level

    @classmethod
    def everything(cls) -> LivePeak:
        """Counting every plain tensor the process holds (the garbage collector's), as the
        device holds them all: the budget of ``peak`` is the whole device's."""
        return cls(*(o for o in gc.get_objects() if type(o) is torch.Tensor or type(o) is torch.nn.Parameter))

    def _count(self, t: torch.Tensor) -> None:
        if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
            return
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.sizes:
            return
        self.sizes[key] = storage.nbytes()
        self.level += self.sizes[key]
        self.peak = max(self.peak, self.level)

        def gone(_ref, key=key, me=weakref.ref(self)):
            mine = me()
            if mine is not None:
                mine.level -= mine.sizes.pop(key, 0)
                mine.watchers.pop(key, None)

        self.watchers[key] = weakref.ref(storage, gone)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._count(t)
        return out


def state_tensors(model: torch.nn.Module, optimizer=None) -> list:
    """What a training step finds alive: parameters, their gradients, buffers, optimizer state."""
    out = [*model.parameters(), *model.buffers()]
    out += [p.grad for p in model.parameters() if p.grad is not None]
    if optimizer is not None:
        out += [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return out
