"""Offload as a third choice: a result the policy offloads is copied to host memory in the
forward and brought back in backward (``tracedac.offload.host``).

Oracles: eager autograd (values and gradients, bitwise), the same region keeping what is
offloaded here (``save_all``/``save_ops``: offloading must change where a tensor lives,
never its value), and storage weak references (what the device still holds after the
forward). On the CPU host and device are one memory, so "the device holds nothing" is
measured as the original storage being freed, not as allocator bytes (the copy is host
memory too). The asynchronous CUDA path has its own test, run where a GPU is.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy

import tracedac
from tracedac import CheckpointError, checkpoint, policies
from tracedac.region import reporting

aten = torch.ops.aten


def block(x, w1, w2, norm_w):
    """A transformer-ish MLP block: matmuls, a label, a norm, dropout, an in-place op."""
    h = tracedac.name(x @ w1, "up")
    h = F.gelu(h).mul_(1.5)  # mul_ writes gelu's result, which its backward does not read
    h = F.dropout(h, 0.25, training=True)
    h = h @ w2
    h = F.layer_norm(h, (h.shape[-1],), norm_w)
    return (torch.tanh(h) + x).square().mean()


def args(seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    shapes = [(16, 32), (32, 64), (64, 32), (32,)]
    return [torch.randn(*s, generator=g).to(device).requires_grad_() for s in shapes]


def run(fn, a, seed=1):
    torch.manual_seed(seed)
    out = fn(*a)
    return out.detach(), torch.autograd.grad(out, a)


def offload_mm(node):
    return (
        CheckpointPolicy.MUST_CPU_OFFLOAD if node.op is aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE
    )


def prefer_offload_all(node):
    return CheckpointPolicy.PREFER_CPU_OFFLOAD


OFFLOADING = {
    "offload_ops(mm)": policies.offload_ops(aten.mm),
    "offload_names('up')": policies.offload_names("up"),
    "function -> MUST_CPU_OFFLOAD": offload_mm,
    "function -> PREFER_CPU_OFFLOAD everywhere": prefer_offload_all,
    "either(offload_ops(mm), memory_budget(0.3))": policies.either(
        policies.offload_ops(aten.mm), policies.memory_budget(0.3)
    ),
    "either(offload_names('up'), min_cut())": policies.either(
        policies.offload_names("up"), policies.min_cut()
    ),
    "offload_kept(save_all())": policies.offload_kept(policies.save_all()),
    "offload_kept(memory_budget(0.3))": policies.offload_kept(policies.memory_budget(0.3)),
}


@pytest.mark.parametrize("policy", OFFLOADING.values(), ids=OFFLOADING.keys())
def test_offloading_gives_eagers_values_and_gradients_bitwise_and_those_of_keeping(policy):
    """Offloading moves a tensor, it never changes a bit: the copy back is the saved value,
    and replay that starts from a host copy (the block's in-place op, dropout's mask) runs the
    same kernels as eager. Twice: the second call of a planned region decides from the cached
    plan while recording (offloading at once), the first at the region's end."""
    a = args()
    eager = run(block, a)
    kept = run(checkpoint(block, policy=policies.save_all()), a)
    f = checkpoint(block, policy=policy)
    for _ in range(2):
        got = run(f, a)
        for want in (eager, kept):
            assert torch.equal(got[0], want[0])
            assert all(torch.equal(x, y) for x, y in zip(got[1], want[1], strict=True))


def _storages(fn, a):
    """Run ``fn`` forward with every result of ``aten.mm`` watched by a storage weak reference."""
    refs = []

    class Watch(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is aten.mm.default:
                refs.append(out.untyped_storage()._weak_ref())
            return out

    with Watch():
        out = fn(*a)
    gc.collect()
    alive = [not torch.UntypedStorage._expired(r) for r in refs]
    for r in refs:
        torch.UntypedStorage._free_weak_ref(r)
    return out, alive


@pytest.mark.parametrize(
    "policy",
    [
        policies.offload_ops(aten.mm),
        offload_mm,
        policies.either(policies.offload_ops(aten.mm), policies.memory_budget(0.3)),
    ],
    ids=["offload_ops", "function", "either with memory_budget"],
)
def test_after_the_forward_the_device_holds_nothing_that_was_offloaded(policy):
    """The point of offloading: the original storage is freed once the program lets go of it,
    and the region holds only its host copy (counted as host bytes, not kept ones). Keeping
    the same ops holds those storages alive, which shows the probe sees them."""
    a = args()
    out, alive = _storages(checkpoint(block, policy=policies.save_ops(aten.mm)), a)
    assert alive == [True, True], "kept matmul results stay on the device"
    del out
    out, alive = _storages(checkpoint(block, policy=policy), a)
    assert alive == [False, False], "offloaded matmul results are freed"
    out.backward()
    report = tracedac.saved_report(block, *a, policy=policy)
    offloaded = [r for r in report.rows if r.kind == "offloaded"]
    assert [r.op for r in offloaded] == ["aten.mm.default"] * 2
    assert report.offloaded_bytes == (16 * 64 + 16 * 32) * 4
    assert all("in host memory" in r.why for r in offloaded)
    assert "offloaded to host 6.00 KiB" in str(report)
    assert all(r.op != "aten.mm.default" for r in report.rows if r.kind == "activation")


def test_planners_take_an_offload_as_given_and_spend_their_budget_on_the_rest():
    """MUST_CPU_OFFLOAD binds a planner as a MUST does: the tensor is neither kept on the
    device nor replayed, and costs none of the budget, which goes to other tensors."""
    a = args()
    for planner in (policies.memory_budget(0.3), policies.memory_budget(4096), policies.min_cut()):
        report = tracedac.saved_report(
            block, *a, policy=policies.either(policies.offload_ops(aten.mm), planner)
        )
        assert {r.op for r in report.rows if r.kind == "offloaded"} == {"aten.mm.default"}
        assert all(r.op != "aten.mm.default" for r in report.rows if r.kind == "activation")
        with reporting() as regions:
            torch.manual_seed(1)
            checkpoint(block, policy=policies.either(policies.offload_ops(aten.mm), planner))(*a).backward()
        nodes = regions[0].graph.nodes
        assert not any(nodes[i].op is aten.mm.default for i in regions[0].graph.plan.nodes), (
            "no matmul replayed"
        )
        if planner == policies.memory_budget(4096):
            assert report.kept_bytes <= 4096


def test_offload_kept_offloads_what_the_planner_keeps():
    """``offload_kept(memory_budget(b))``: the budget's choice, on the host instead of the device."""
    a = args()
    kept = tracedac.saved_report(block, *a, policy=policies.memory_budget(0.3))
    moved = tracedac.saved_report(block, *a, policy=policies.offload_kept(policies.memory_budget(0.3)))
    assert kept.kept_bytes > 0 and moved.kept_bytes == 0
    assert moved.offloaded_bytes == kept.kept_bytes
    assert moved.replayed_bytes == kept.replayed_bytes


@pytest.mark.parametrize(
    "keep", [policies.save_ops(aten.exp), policies.offload_ops(aten.exp)], ids=["kept", "offloaded"]
)
def test_a_result_changed_after_the_forward_is_refused_as_a_kept_one_is(keep):
    """Eager autograd refuses a saved tensor modified in place before backward. A copy on the
    host is immune to the write, but tracedac gives an offloaded tensor the semantics of a
    kept one: the write is seen (a token sharing the tensor's version counter), and the value
    is rebuilt from the graph or, when what it was computed from was not kept, refused by name."""
    x = torch.randn(4, 4, requires_grad=True)
    y = x.exp()
    with torch.no_grad():
        y.mul_(3)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward(torch.ones_like(y))
    y = checkpoint(lambda x: x.exp(), policy=keep)(x)
    with torch.no_grad():
        y.mul_(3)
    word = "kept" if isinstance(keep, type(policies.save_ops(aten.exp))) else "offloaded to host"
    with pytest.raises(
        CheckpointError,
        match=f"aten.exp.default .*{word} for backward, was modified in place after the forward",
    ):
        y.backward(torch.ones_like(y))


@pytest.mark.parametrize(
    "keep", [policies.save_ops(aten.exp), policies.offload_ops(aten.exp)], ids=["kept", "offloaded"]
)
def test_a_result_changed_later_in_the_region_gives_the_gradient_of_the_state_saved(keep):
    """Eager refuses this too; tracedac answers it exactly, kept or offloaded: exp's backward
    reads e as saved (the host copy was taken before the write, which waited for it on CUDA),
    mul's reads it after the write."""

    def f(x):
        e = x.exp()
        with torch.no_grad():
            e.mul_(3)
        return (e * x).sum()

    x = torch.randn(4, 4, requires_grad=True)
    (g,) = torch.autograd.grad(checkpoint(f, policy=keep)(x), x)
    e = x.detach().exp()
    torch.testing.assert_close(g, 3 * e + x.detach() * e, rtol=1e-6, atol=1e-6)


def test_replay_starts_from_the_host_copy_of_a_later_state_and_runs_only_the_writes_after_it():
    """A result written twice in the region: ``sin`` saves it after the first write (``add_``,
    offloaded: its host copy is of state 1), ``cos`` after the second (``mul_``, replayed).
    Backward wants states 1 and 2, so replay starts from the copy, at state 1, and runs the
    writes after it: ``mul_`` once, ``add_`` and ``abs`` (which made the result) never. The
    gradients are eager's (the same program without in-place writes: eager refuses this one).
    Until this test no plan started a storage above its first state and then ran its writes."""
    from .util import OpCounter

    def f(x):
        y = x.abs()  # state 0; abs's backward reads x, not y
        y.add_(1)  # state 1: offloaded when sin saves it
        a = y.sin()
        y.mul_(2)  # state 2: replayed
        b = y.cos()
        return (a * b).sum()

    x = torch.randn(4, 4, requires_grad=True)
    y1 = x.abs() + 1
    (want,) = torch.autograd.grad((y1.sin() * (y1 * 2).cos()).sum(), x)
    with reporting() as regions:
        out = checkpoint(f, policy=policies.offload_ops(aten.add_))(x)
    with OpCounter() as ops:
        (got,) = torch.autograd.grad(out, x)
    (graph,) = [r.graph for r in regions]
    assert ("host", 1) in graph.plan.starts.values(), graph.plan.starts
    assert ops.counts[aten.mul_] == 1 and ops.counts[aten.add_] == 0 and ops.counts[aten.abs] == 0, ops.counts
    assert torch.equal(got, want)


def test_a_saved_input_its_own_op_writes_is_read_after_the_write_as_in_eager():
    """rrelu writes its noise, an input autograd saved, without bumping the version counter:
    eager's backward reads the noise after the write. A copy taken when the noise was saved
    holds the value before it, so it is not used; the copy taken after the write is."""

    def f(x):
        return F.rrelu(x * 1.0, training=True).sum()

    x = torch.randn(64, requires_grad=True)
    want = run(f, [x])
    got = run(checkpoint(f, policy=prefer_offload_all), [x])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1][0], want[1][0])


def test_nested_regions_offload_and_give_eagers_gradients():
    """An inner region's input that the outer region computed is the outer one's handle: with
    both regions offloading, the inner replay reads through the outer's host copies."""
    inner = checkpoint(lambda h, w: F.gelu(h @ w), policy=policies.offload_ops(aten.mm))

    def outer(x, w1, w2):
        return (inner(x @ w1, w2) @ w2.t()).tanh().sum()

    a = args()[:3]
    want = run(outer, a)
    got = run(checkpoint(outer, policy=policies.offload_kept(policies.save_all())), a)
    assert torch.equal(got[0], want[0]) and all(
        torch.equal(x, y) for x, y in zip(got[1], want[1], strict=True)
    )


def test_offload_factories_print_as_their_call_compare_by_value_and_check_their_inputs():
    """As save_ops and save_names: frozen, hashable (a plan cache key), held by id."""
    assert repr(policies.offload_ops(aten.mm, aten.bmm.default)) == "offload_ops(aten.bmm.default, aten.mm)"
    assert repr(policies.offload_names("b", "a")) == "offload_names('a', 'b')"
    assert repr(policies.offload_kept(policies.memory_budget(0.3))) == "offload_kept(memory_budget(0.3))"
    assert policies.offload_ops(aten.mm) == policies.offload_ops(aten.mm)
    assert hash(policies.offload_names("a")) == hash(policies.offload_names("a"))
    with pytest.raises(ValueError, match=r"offload_ops\(\) needs at least one op"):
        policies.offload_ops()
    with pytest.raises(TypeError, match=r"For 'mm', pass torch.ops.aten.mm"):
        policies.offload_ops("mm")
    with pytest.raises(TypeError, match=r"offload_names\(\) takes non-empty strings"):
        policies.offload_names("")
    with pytest.raises(TypeError, match="a policy is a callable"):
        policies.offload_kept(3)
    with pytest.raises(ValueError, match=r"offload_kept\(either\(...\)\)"):
        policies.either(policies.offload_kept(policies.min_cut()), policies.save_matmuls())


def test_either_lets_a_must_offload_beat_a_prefer_and_refuses_two_different_musts():
    """Offload is a MUST like the others: it overrides save_all's PREFER, and a MUST_SAVE of the
    same op cannot also be honoured (kept on the device and moved off it)."""
    x = torch.randn(8, 8, requires_grad=True)
    report = tracedac.saved_report(
        lambda x: x.exp().sin().cos(),
        x,
        policy=policies.either(policies.save_all(), policies.offload_ops(aten.exp)),
    )
    assert {r.op: r.kind for r in report.rows} == {
        "aten.exp.default": "offloaded",
        "aten.sin.default": "activation",
    }
    with pytest.raises(CheckpointError, match="One must keep it and another must offload it"):
        checkpoint(
            lambda x: x.exp(),
            policy=policies.either(policies.save_ops(aten.exp), policies.offload_ops(aten.exp)),
        )(x)


def test_offload_under_torch_compile_is_refused_at_compile_time_with_what_to_use():
    """torch's partitioner (2.13) does not act on CPU_OFFLOAD tags (torch's own selective
    checkpointing compiled saves such a result on the device): refused rather than kept
    silently on the device."""
    import torch._dynamo

    torch._dynamo.reset()
    w = torch.randn(16, 16, requires_grad=True)
    f = checkpoint(lambda x: (x @ w).tanh(), policy=policies.offload_ops(aten.mm))
    c = torch.compile(lambda x: f(x).sum(), backend="aot_eager_decomp_partition", fullgraph=True)
    with pytest.raises(Exception) as err:
        c(torch.randn(4, 16, requires_grad=True)).backward()
    cause = getattr(err.value, "inner_exception", err.value)  # dynamo wraps a backend's error
    assert isinstance(cause, CheckpointError), repr(err.value)
    assert f"offload under torch.compile is not supported by torch {torch.__version__}'s partitioner" in str(
        cause
    )
    assert "use eager or a keep/replay policy" in str(cause)
    torch._dynamo.reset()
    # offload_kept of a policy that keeps nothing offloads nothing: compiled as it is
    g = checkpoint(lambda x: (x @ w).tanh(), policy=policies.offload_kept(policies.recompute_all()))
    torch.compile(lambda x: g(x).sum(), backend="aot_eager_decomp_partition", fullgraph=True)(
        torch.randn(4, 16, requires_grad=True)
    ).backward()
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_copy_is_pinned_asynchronous_and_the_device_memory_goes():
    """CUDA: copies to pinned host memory on a side stream, the original's block released to
    the allocator once the program drops it, the values back bitwise; a write the region
    records right after the copy waits for it (the copy holds the state before the write)."""
    from tracedac.offload.host import HostCopy
    from tracedac.record.graph import TensorMeta

    a = args(device="cuda")
    eager = run(block, a)
    keep = checkpoint(block, policy=policies.save_ops(aten.mm))
    off = checkpoint(block, policy=policies.offload_ops(aten.mm))
    for f in (keep, off):  # warm up: the caching allocator's pools, cuBLAS workspaces
        run(f, a)
    held = {}
    for name, f in (("keep", keep), ("offload", off)):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.manual_seed(1)
        out = f(*a)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # frees blocks whose side-stream use (record_stream) has ended
        held[name] = torch.cuda.memory_allocated() - before
        out.backward()
        del out
    assert held["keep"] - held["offload"] >= (16 * 64 + 16 * 32) * 4
    got = run(off, a)
    assert torch.equal(got[0], eager[0])
    assert all(torch.equal(x, y) for x, y in zip(got[1], eager[1], strict=True))
    t = torch.randn(1 << 22, device="cuda")
    value = t.clone()
    copy = HostCopy(t, 0)
    assert copy.host.is_pinned() and copy.event is not None
    copy.before_write()
    t.add_(1)  # ordered after the copy: it holds the value before
    assert torch.equal(copy.host.view(torch.float32).cuda(), value)
    assert torch.equal(copy.fetch(TensorMeta(0, 0, torch.float32, tuple(t.shape), t.stride(), 0)), value)


def _three_offloaded_regions(device="cpu"):
    """Three blocks, each a region offloading its matmuls, and their input."""
    torch.manual_seed(0)
    ws = [torch.randn(16, 16, device=device, requires_grad=True) for _ in range(3)]
    policy = policies.offload_ops(aten.mm)
    blocks = [checkpoint(lambda x, w=w: (x @ w).tanh() @ w, policy=policy) for w in ws]
    return blocks, ws, torch.randn(8, 16, device=device, requires_grad=True)


def _last_batches(n: int) -> list:
    """The host copies of the last ``n`` regions that ended, per region (weak references:
    copies no handle kept are gone)."""
    from tracedac.offload import host as offload

    return list(offload._batches[-n:])


def _live(batches) -> list:
    return [[c for c in (r() for r in b.refs) if c is not None] for b in batches]


def test_reading_a_regions_host_copies_brings_back_the_region_before_it_and_no_further():
    """Backward runs the regions in reverse: when it first reads region 3's copies, region
    2's start coming back (``prefetch_regions(1)``, the default), region 1's not yet; when it
    reaches region 2, region 1's. (On the CPU a copy is served in place: the schedule is what
    is checked; on CUDA the same schedule copies on a side stream.)"""
    blocks, ws, x = _three_offloaded_regions()
    h = x
    seen = []
    for i, b in enumerate(blocks):
        h = b(h)
        if i < 2:  # when region i+2's backward is done and region i+1's starts
            h.register_hook(lambda g: seen.append([[c.prefetched for c in b] for b in _live(batches)]))
    batches = _last_batches(3)
    first, second, third = _live(batches)
    assert first and second and third
    assert all(c.prefetched is None for c in first + second + third)
    (grads_got) = torch.autograd.grad(h.sum(), [x, *ws])
    # after region 3's backward (hook on region 2's output): region 2's copies asked for, region 1's not
    after_third, after_second = seen  # the hook on region 2's output fires first
    assert all(p is not None for p in after_third[1]) and all(p is None for p in after_third[0])
    assert all(p is not None for p in after_second[0])
    h = x
    for f in (lambda t, w=w: (t @ w).tanh() @ w for w in ws):
        h = f(h)
    want = torch.autograd.grad(h.sum(), [x, *ws])
    assert all(torch.equal(a, b) for a, b in zip(grads_got, want, strict=True))


def test_prefetch_regions_zero_brings_back_each_copy_only_when_read():
    from tracedac.offload import host as offload

    offload.prefetch_regions(0)
    try:
        blocks, ws, x = _three_offloaded_regions()
        h = x
        for b in blocks:
            h = b(h)
        batches = _live(_last_batches(3))
        h.sum().backward()
        assert all(c.prefetched is None for batch in batches for c in batch)
    finally:
        offload.prefetch_regions(1)
    with pytest.raises(ValueError, match="number of regions >= 0"):
        offload.prefetch_regions(-1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_prefetched_copy_is_on_the_device_before_backward_reads_it_and_exact():

    blocks, ws, x = _three_offloaded_regions("cuda")
    h = x
    for b in blocks:
        h = b(h)
    first, second, third = _live(_last_batches(3))
    third[0].source()  # backward's first read of region 3
    assert all(isinstance(c.prefetched, tuple) for c in second)  # on its way, on the side stream
    assert all(c.prefetched is None for c in first)
    got = torch.autograd.grad(h.sum(), [x, *ws])
    h = x
    for w in ws:
        h = (h @ w).tanh() @ w
    want = torch.autograd.grad(h.sum(), [x, *ws])
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


class _BringBacks:
    """Serve copies as on a GPU (brought back, not read in place) and count each bring-back."""

    def __init__(self, monkeypatch):
        from tracedac.offload import host as offload

        self.counts: dict = {}
        bring_back = offload.HostCopy._bring_back

        def counted(copy):
            self.counts[id(copy)] = self.counts.get(id(copy), 0) + 1
            return bring_back(copy).clone()  # a separate buffer, as a device copy is

        monkeypatch.setattr(offload, "_in_place", lambda device: False)
        monkeypatch.setattr(offload.HostCopy, "_bring_back", counted)


def shares(x, w):
    y = tracedac.name(x @ w, "y")  # offloaded; sin and cos both save it: two handles on one copy
    return (y.sin() * y.cos()).sum()


def test_a_copy_several_handles_share_comes_back_once_and_the_device_copy_goes_after_the_last(
    monkeypatch, host_copies
):
    """Without sharing, each further reader copied the whole storage back again (on a GPU, on
    the main stream, where no compute hides it)."""
    seen = _BringBacks(monkeypatch)
    g = torch.Generator().manual_seed(0)
    x, w = (torch.randn(8, 8, generator=g).requires_grad_() for _ in range(2))
    out = checkpoint(shares, policy=policies.offload_names("y"))(x, w)
    (copy,) = host_copies
    assert len(copy.readers) == 2 and copy.back is None
    got = torch.autograd.grad(out, [x, w], retain_graph=True)
    assert seen.counts == {id(copy): 1}
    assert not copy.readers and copy.back is None  # read by both: the device copy is gone
    want = torch.autograd.grad(shares(x, w), [x, w])
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    # A second backward (retain_graph) finds no holder left to share with: each read brings
    # the copy back (the replay of sin and cos for mul's backward, then the two handles).
    again = torch.autograd.grad(out, [x, w])
    assert seen.counts == {id(copy): 1 + 3}
    assert all(torch.equal(a, b) for a, b in zip(again, want, strict=True))


@pytest.mark.parametrize("policy", OFFLOADING.values(), ids=OFFLOADING.keys())
def test_every_copy_comes_back_at_most_once_per_backward_and_gives_eagers_gradients(monkeypatch, policy):
    seen = _BringBacks(monkeypatch)
    a = args()
    got = run(checkpoint(block, policy=policy), a)
    want = run(block, a)
    assert seen.counts and set(seen.counts.values()) == {1}
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(x, y) for x, y in zip(got[1], want[1], strict=True))


def test_tracked_counts_the_copies_each_way_once_and_nothing_outside_it(monkeypatch):
    """``tracedac.offload.host.tracked``: what a step sent to the host and brought back, counted by
    tracedac (served as on a GPU, brought back; the CPU's wait is none: ``stalled_s`` 0)."""
    from tracedac.offload import host as offload

    _BringBacks(monkeypatch)
    g = torch.Generator().manual_seed(0)
    x, w = (torch.randn(8, 8, generator=g).requires_grad_() for _ in range(2))
    f = checkpoint(shares, policy=policies.offload_names("y"))
    with offload.tracked() as outer:
        with offload.tracked() as step:
            out = f(x, w)
            assert (step.out_copies, step.out_bytes, step.back_copies) == (1, 8 * 8 * 4, 0)
            torch.autograd.grad(out, [x, w])
        out = f(x, w)  # outside the inner block: counted by the outer one only
    torch.autograd.grad(out, [x, w])  # outside both: counted by none
    assert (step.out_copies, step.back_copies, step.back_bytes) == (1, 1, 8 * 8 * 4)  # one copy, shared
    assert (outer.out_copies, outer.back_copies) == (2, 1)
    assert step.stalled_s == 0.0 and "out: 1 copies, 256 B; back: 1 copies, 256 B" in repr(step)


def _three_regions():
    """Three regions offloading both matmuls of ``(x @ w).tanh() @ w``, the same unchecked, the
    inputs, and the copies (and bytes) backward reads: each region's first matmul result."""
    blocks, ws, x = _three_offloaded_regions()
    plain = [lambda t, w=w: (t @ w).tanh() @ w for w in ws]
    return blocks, plain, [x, *ws], 3, 3 * 8 * 16 * 4


def _doubled_sin():
    """``((x @ w) * 2).sin()`` under ``offload_kept(save_all())``: only sin's input is read."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(8, 16, generator=g), torch.randn(16, 4, generator=g)
    plain = [lambda t: ((t @ w) * 2).sin()]  # mul by a number saves nothing; sin saves its input
    blocks = [checkpoint(plain[0], policy=policies.offload_kept(policies.save_all()))]
    return blocks, plain, [x.requires_grad_(), w.requires_grad_()], 1, 8 * 4 * 4


@pytest.mark.parametrize(
    "case", [_three_regions, _doubled_sin], ids=["three regions, offload_ops(mm)", "offload_kept(save_all())"]
)
def test_only_what_backward_reads_crosses_the_link(monkeypatch, case):
    """A result the policy offloads is copied when autograd saves it, or at the region's end
    if replay starts from it; one that backward never reads is never copied. Before, every
    offloaded result was copied when made: twice the bytes here, and 1.7x in the Llama bench
    under ``offload_kept(save_all())``, link time spent for nothing.
    - Three regions: each first matmul result is saved by nobody (tanh saves its output) but
      replay of tanh starts from it, so it goes out at the region's end; the second is the
      region's output, which the next region holds as it came, and the last one's nobody saves.
    - ``offload_kept(save_all())``: only sin's input leaves; the matmul's result (saved by
      nobody, replayed for nothing) and sin's (the output) do not."""
    from tracedac.offload import host as offload

    _BringBacks(monkeypatch)
    blocks, plain, inputs, copies, nbytes = case()

    def forward(fs):
        h = inputs[0]
        for f in fs:
            h = f(h)
        return h.sum()

    with offload.tracked() as c:
        got = torch.autograd.grad(forward(blocks), inputs)
    want = torch.autograd.grad(forward(plain), inputs)
    assert (c.out_copies, c.out_bytes) == (copies, nbytes)
    assert (c.back_copies, c.back_bytes) == (copies, nbytes)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("keep", [False, True], ids=["offload_ops", "save_ops"])
def test_inside_the_region_an_offloaded_result_autograd_saved_is_let_go_at_once(keep):
    """Copied when autograd saves it, an offloaded result is not held on the device for the
    rest of the region: once the program lets go of it, it is freed, as in eager (a result
    nothing saved yet is held, as a kept one is, until the region's end decides)."""
    freed = []

    def f(x, w):
        y = x @ w
        ref = y.untyped_storage()._weak_ref()
        z = y.sin()  # saves y
        del y
        gc.collect()
        freed.append(torch.UntypedStorage._expired(ref))
        torch.UntypedStorage._free_weak_ref(ref)
        return z.cos()

    policy = policies.save_ops(aten.mm) if keep else policies.offload_ops(aten.mm)
    x, w = (torch.randn(8, 8).requires_grad_() for _ in range(2))
    checkpoint(f, policy=policy)(x, w).sum().backward()
    assert freed == [not keep]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_tracked_times_the_compute_streams_waits_for_copies():
    """Not brought back ahead (``prefetch_regions(0)``), every copy back runs on the compute
    stream: all of it a wait, timed by events. Of each block's two matmul results only the
    first goes out and comes back (replay starts from it); the second is the next block's
    input, which that region holds as it came, so it never leaves (as on the CPU:
    ``test_only_what_backward_reads_crosses_the_link``)."""
    from tracedac.offload import host as offload

    offload.prefetch_regions(0)
    try:
        blocks, ws, x = _three_offloaded_regions("cuda")
        with offload.tracked() as c:
            h = x
            for b in blocks:
                h = b(h)
            torch.autograd.grad(h.sum(), [x, *ws])
        assert (c.out_copies, c.back_copies) == (3, 3) and c.out_bytes == c.back_bytes > 0
        assert c.stalled_s > 0
    finally:
        offload.prefetch_regions(1)
