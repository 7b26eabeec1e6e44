"""Memory, measured at the allocator: what a region holds, when replay frees, what survives."""

import functools
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import tracedac
from tracedac import checkpoint, policies
from tracedac.policies.wrappers import OffloadKept
from tracedac.region import reporting
from tracedac.replay import compiled as replay_compiled

from .support.probe import allocated_bytes as allocated

MiB = 1 << 20
N = (256, 1024)  # one activation: 1 MiB of fp32


def mlp(x, w1, w2):
    h = x @ w1  # [256, 1024]
    h = F.gelu(h) * 1.5
    h = h @ w2
    h = torch.tanh(h) + x
    return h.square().mean()


def args():
    torch.manual_seed(0)
    return (
        torch.randn(*N, requires_grad=True),
        torch.randn(1024, 1024, requires_grad=True) / 32,
        torch.randn(1024, 1024, requires_grad=True) / 32,
    )


def held_after_forward(fn, *a):
    fn(*a)  # the first use of a dispatch mode allocates torch's caches once: keep that out
    gc.collect()
    before = allocated()
    out = fn(*a)
    gc.collect()
    return allocated() - before, out


def test_under_recompute_all_nothing_but_inputs_is_held_after_forward():
    a = args()
    plain, out = held_after_forward(mlp, *a)
    del out
    traced, out = held_after_forward(checkpoint(mlp), *a)
    assert plain > 3.9 * MiB, "without checkpointing four activations stay"
    assert traced < 64 * 1024, f"{traced} bytes held beyond the inputs"
    out.backward()


def test_save_matmuls_holds_no_more_than_torch_selective_checkpointing():
    """torch SAC keeps every matmul output; tracedac only those backward reads."""

    def f(x, w1, w2):
        unread = (x @ w1).sum(-1, keepdim=True)  # a matmul whose output nothing saves
        return mlp(x, w1, w2) + unread.mean()

    def sac_policy(ctx, op, *args, **kwargs):
        keep = op.overloadpacket in policies.MATMUL_OPS
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    a = args()
    sac = functools.partial(
        torch_checkpoint,
        f,
        use_reentrant=False,
        context_fn=functools.partial(create_selective_checkpoint_contexts, sac_policy),
    )
    torch_held, out = held_after_forward(sac, *a)
    del out
    traced, out = held_after_forward(checkpoint(f, policy=policies.save_matmuls()), *a)
    assert 1.9 * MiB < traced < 2.1 * MiB, "the two matmul outputs backward reads"
    assert torch_held > traced + 0.9 * MiB, "torch also keeps the unread one"
    out.backward()


class AllocationTrace(TorchDispatchMode):
    """The allocator's count after every op that runs while active."""

    def __init__(self):
        super().__init__()
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, allocated())
        return out


def test_replayed_intermediates_are_freed_as_soon_as_nothing_pending_needs_them():
    def chain(x):
        for _ in range(8):
            x = x * 1.01 + 0.5  # saves nothing: the intermediates exist only during replay
        return x.exp().sum()  # exp saves its result

    x = torch.randn(*N, requires_grad=True)
    out = checkpoint(chain)(x)
    gc.collect()
    before = allocated()
    with AllocationTrace() as trace:
        out.backward()
    assert trace.peak - before < 4.5 * MiB, f"{(trace.peak - before) / MiB:.1f} MiB live at once (16 if kept)"


@pytest.mark.parametrize(
    "policy",
    [policies.save_matmuls(), policies.memory_budget(0.5), policies.offload_kept(policies.save_all())],
    ids=repr,
)
@pytest.mark.parametrize("compiled", [False, True], ids=["op by op", "compiled replay"])
def test_after_backward_nothing_of_the_graph_survives(policy, compiled):
    replay_compiled.clear()
    before = tracedac.compiled_replay(compiled)
    try:
        for _ in range(3):  # compiled replay compiles a structure the second time it sees it
            a = args()
            with reporting() as regions:
                out = checkpoint(mlp, policy=policy)(*a)
            graph = weakref.ref(regions[0].graph)
            kept = [weakref.ref(g.held) for g in regions[0].graph.groups if g.held is not None]
            handles = [weakref.ref(h) for h in regions[0].handles]
            regions.clear()
            assert handles and graph() is not None
            assert kept or isinstance(policy, OffloadKept)  # (offloaded: held on the host)
            out.backward()
            assert graph() is None and all(r() is None for r in kept + handles), (
                "freed by reference counting alone"
            )
        replays = not isinstance(policy, OffloadKept)  # (save_all offloaded: nothing to replay)
        assert (replay_compiled.stats().get("runs", 0) > 0) == (compiled and replays)
    finally:
        tracedac.compiled_replay(before)
        replay_compiled.clear()


def test_a_forward_without_backward_frees_the_graph_with_its_output():
    with reporting() as regions:
        out = checkpoint(mlp)(*args())
    graph = weakref.ref(regions[0].graph)
    regions.clear()
    del out
    assert graph() is None, "no reference cycle keeps it alive"


def test_nested_regions_do_not_pin_the_inner_regions_inputs():
    """The inner region's input is the outer region's intermediate: replayed, not kept."""

    def outer(x, w1, w2):
        h = F.gelu(x @ w1)  # [256, 1024], internal to the outer region
        return checkpoint(lambda h: (h @ w2).tanh().square().mean())(h)

    held, out = held_after_forward(checkpoint(outer), *args())
    assert held < 64 * 1024
    out.backward()


def test_outside_regions_there_is_no_dispatch_mode_no_module_hook_and_no_saved_tensor_hook():
    a = args()
    checkpoint(mlp)(*a).backward()
    assert torch._C._len_torch_dispatch_stack() == 0
    assert not torch.nn.modules.module._global_forward_pre_hooks
    assert not torch.nn.modules.module._global_forward_hooks
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
