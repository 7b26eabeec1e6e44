"""The collectives a process issues, counted at the dispatcher by op name: the tests' small
counter for libraries that call torch's collectives directly (FSDP2, DDP, accelerate).
(``tracedac.zero``'s own go through ``zero_logs``, at the calls it makes to the process group;
``benchmarks/collectives.py`` counts through custom ops as well, for the benchmarks.)
"""

from __future__ import annotations

from collections import Counter

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CollectiveOps"]

NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd", "c10d_functional"})


class CollectiveOps(TorchDispatchMode):
    """``ops["c10d._allgather_base_"]``: calls of each collective op while the mode is on, by
    namespace and name (``dist.all_gather_into_tensor`` is ``c10d._allgather_base_``)."""

    # a higher-order op (a replayed dropout's ``run_and_save_rng_state``) runs as it is
    supports_higher_order_operators = True

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(t.__torch_dispatch__ is not torch._C._disabled_torch_dispatch_impl for t in types):
            # a tensor subclass (a DTensor): counted beneath it, where it calls the collectives
            return func(*args, **kwargs) if any(issubclass(t, FakeTensor) for t in types) else NotImplemented
        if not isinstance(func, torch._ops.HigherOrderOperator) and func.namespace in NAMESPACES:
            self.ops[f"{func.namespace}.{func._schema.name.split('::')[-1]}"] += 1
        return func(*args, **kwargs)
