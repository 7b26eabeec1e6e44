"""The ops are torch.library custom ops: one graph node per call, a fake kernel, a valid schema."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode

from tracedac.ops import accumulate_, pack_cast


def ops_in(graph_module):
    return [n.target for n in graph_module.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("tracing_mode", ["real", "fake"])
def test_a_traced_graph_shows_each_call_as_one_node(tracing_mode):
    """Graph passes (gather placement, recompute) reason about whole casts, not their parts;
    the fake kernel must let tracing run on tensors that have no data."""

    def step(shards, bucket, grad_shard, reduced):
        pack_cast(shards, bucket[16:40])
        accumulate_(grad_shard, reduced)
        return bucket, grad_shard

    shards = [torch.randn(4, 3), torch.randn(12)]
    bucket = torch.zeros(64, dtype=torch.bfloat16)
    graph = make_fx(step, tracing_mode=tracing_mode)(
        shards, bucket, torch.zeros(8), torch.ones(8, dtype=torch.bfloat16)
    )
    calls = [t for t in ops_in(graph) if t not in (torch.ops.aten.slice.Tensor,)]
    assert calls == [torch.ops.tracedac.pack_cast.default, torch.ops.tracedac.accumulate_.default]


def test_opcheck_passes_for_both_ops_on_the_torch_backend():
    """Schema (declared mutation of dst only), fake kernel and autograd registration agree
    with what the ops really do."""
    srcs = [torch.randn(3, 5), torch.randn(7).to(torch.float16), torch.randn(4, 2).t()]
    torch.library.opcheck(
        torch.ops.tracedac.pack_cast.default, (srcs, torch.empty(30, dtype=torch.bfloat16), "torch")
    )
    torch.library.opcheck(
        torch.ops.tracedac.accumulate_.default, (torch.zeros(6), torch.ones(6, dtype=torch.bfloat16), "torch")
    )


def test_opcheck_passes_for_both_ops_on_the_triton_backend(interpreter):
    """The Triton path mutates only dst, too (it writes through raw pointers, so a stray
    write outside dst would show here as a mutated source)."""
    srcs = [torch.randn(3, 5), torch.randn(7).to(torch.float16), torch.randn(4, 2).t()]
    torch.library.opcheck(
        torch.ops.tracedac.pack_cast.default, (srcs, torch.empty(30, dtype=torch.bfloat16), "triton")
    )
    torch.library.opcheck(
        torch.ops.tracedac.accumulate_.default,
        (torch.zeros(6), torch.ones(6, dtype=torch.bfloat16), "triton"),
    )


class _RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_a_dispatch_mode_sees_one_op_per_call(backend):
    """tracedac's tracer is a TorchDispatchMode: under it, calls must go through the op (the
    direct eager path is only for calls nothing observes)."""
    dst = torch.empty(12, dtype=torch.bfloat16)
    grad = torch.zeros(12)
    with _RecordOps() as recorder:
        pack_cast([torch.ones(3, 4)], dst, backend=backend)
        accumulate_(grad, dst, backend=backend)
    ops = [op for op in recorder.ops if op.namespace == "tracedac"]
    assert ops == [torch.ops.tracedac.pack_cast.default, torch.ops.tracedac.accumulate_.default]


def test_dst_version_counter_moves_on_every_path(backend):
    """Autograd detects in-place changes to saved tensors by version; the Triton kernel writes
    through raw pointers, so the version must be bumped explicitly."""
    dst = torch.empty(4, dtype=torch.bfloat16)
    before = dst._version
    pack_cast([torch.ones(4)], dst, backend=backend)
    assert dst._version > before
    grad = torch.zeros(4)
    before = grad._version
    accumulate_(grad, dst, backend=backend)
    assert grad._version > before


def test_meta_tensors_go_through_the_fake_kernel():
    """Shape-only tensors (meta) have no memory to check or write."""
    dst = torch.empty(6, device="meta", dtype=torch.bfloat16)
    assert pack_cast([torch.empty(2, 3, device="meta")], dst) is dst
