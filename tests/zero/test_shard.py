"""tracedac.zero in one process (a world-1 gloo group): the API, its errors, the op nodes."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.checkpoint import CheckpointPolicy

import tracedac
import tracedac.zero as zero
from tracedac import policies
from tracedac.region import reporting
from tracedac.zero.module import sharded

from ..support import zero_model as zm
from ..support.zero_logs import GatherLog


def test_shard_without_a_process_group_says_how_to_make_one():
    assert not dist.is_initialized()
    with pytest.raises(zero.ZeroError, match="init_process_group"):
        zero.shard(zm.model())


def test_bad_arguments_are_refused_with_what_to_pass(world1):
    with pytest.raises(TypeError, match="nn.Module"):
        zero.shard("model")
    with pytest.raises(ValueError, match="matched no submodule.*Block"):
        zero.shard(zm.model(), units=nn.Conv2d)
    with pytest.raises(TypeError, match="units"):
        zero.shard(zm.model(), units="blocks")
    with pytest.raises(TypeError, match="units"):
        zero.shard(zm.model(), units=(zm.Block, int))
    with pytest.raises(TypeError, match="MixedPrecision"):
        zero.shard(zm.model(), mixed_precision=torch.bfloat16)
    with pytest.raises(TypeError, match="param_dtype"):
        zero.MixedPrecision(param_dtype=torch.int8)
    with pytest.raises(TypeError, match="timeout"):
        zero.shard(zm.model(), timeout=-1)
    with pytest.raises(TypeError, match="group"):
        zero.shard(zm.model(), group="world")
    with pytest.raises(zero.ZeroError, match="float32"):
        zero.shard(zm.model().to(torch.bfloat16))
    m = zero.shard(zm.model())
    with pytest.raises(zero.ZeroError, match="already sharded"):
        zero.shard(m)
    with pytest.raises(zero.ZeroError, match="not sharded"):
        zero.full_state_dict(zm.model())
    with pytest.raises(zero.ZeroError, match="missing keys"):
        zero.load_full_state_dict(m, {})


def test_parameters_keep_their_names_and_are_dtensor_shards_viewing_one_buffer_per_group(world1):
    from torch.distributed.tensor import DTensor, Shard

    ref = zm.model()
    m = zero.shard(zm.model())
    assert [n for n, _ in m.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert list(m.state_dict()) == list(ref.state_dict())
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        assert isinstance(p, DTensor) and p.placements == (Shard(0),) and p.shape == q.shape, name
        torch.testing.assert_close(p.full_tensor(), q.detach())
    # read outside forward: the shard, never a placeholder; shared parameters stay shared
    assert isinstance(m.blocks[0].lin1.weight, DTensor) and m.blocks[0].lin1.weight.device.type == "cpu"
    assert m.blocks[1].lin2.weight is m.blocks[0].lin2.weight
    groups = m._tracedac_zero.all_groups
    for g in groups:
        for s in g.slices:
            assert s.param.to_local().untyped_storage().data_ptr() == g.local.untyped_storage().data_ptr()


def test_units_can_be_chosen_by_class_or_predicate(world1):
    m = zero.shard(zm.model(), units=zm.Block)
    assert [u.name for u in m._tracedac_zero.units] == ["", "blocks.0", "blocks.1", "blocks.2"]
    m = zero.shard(zm.model(), units=lambda name, mod: name == "head")
    assert [u.name for u in m._tracedac_zero.units] == ["", "head"]


@pytest.mark.parametrize("where", ["plain", "wrap-before", "wrap-after", "inside-unit"])
def test_one_rank_trains_exactly_as_the_unsharded_model(world1, where):
    assert zm.equivalence(0, 1, (where,))[where] < 1e-5


def _gather_decisions(policy):
    m = tracedac.wrap(zero.shard(zm.model()), zm.Block, policy=policy)
    x, y = zm.data(0)
    with reporting() as regions:
        loss = F.mse_loss(m(x), y)
    ops = {torch.ops.tracedac.all_gather.default}
    decisions = {n.decision for r in regions for n in r.graph.nodes if n is not None and n.op in ops}
    return m, loss, decisions


def test_gather_nodes_are_recompute_by_default_and_a_policy_may_keep_them(world1):
    """save_all() would keep the gathered weights and so pin whole units: gathers stay replayed."""
    _, loss, decisions = _gather_decisions(policies.save_all())
    assert decisions == {CheckpointPolicy.MUST_RECOMPUTE}
    loss.backward()
    m, loss, decisions = _gather_decisions(policies.save_ops(torch.ops.tracedac.all_gather))
    assert decisions == {CheckpointPolicy.MUST_SAVE}
    log = GatherLog()
    try:
        loss.backward()
    finally:
        log.close()
    block_flats = {f.key for u in m._tracedac_zero.units[1:] for f in u.own}
    assert not block_flats & set(log.counts), "a kept gather was gathered again in backward"


def test_gather_release_and_reduce_scatter_are_nodes_in_a_traced_graph(world1):
    m = zero.shard(zm.model())
    x, _ = zm.data(0)
    gm = make_fx(lambda x: m(x))(x)
    targets = {str(n.target) for n in gm.graph.nodes}
    assert {"tracedac.all_gather.default", "tracedac.release.default"} <= targets
    flat = m._tracedac_zero.all_groups[0]
    grad = torch.ones(flat.world * flat.shard_numel)
    gm = make_fx(lambda g: torch.ops.tracedac.reduce_scatter(g, flat.key))(grad)
    assert "tracedac.reduce_scatter.default" in {str(n.target) for n in gm.graph.nodes}


def test_fake_implementations_give_the_real_shapes(world1):
    from torch._subclasses.fake_tensor import FakeTensorMode

    m = zero.shard(zm.model(), mixed_precision=zero.MixedPrecision())
    flats = m._tracedac_zero.all_groups
    with FakeTensorMode() as mode:
        for f in flats:
            shard = mode.from_tensor(f.leaf)
            full = torch.ops.tracedac.all_gather(shard, f.key)
            assert full.shape == (f.world * f.shard_numel,) and full.dtype == f.dtype
            part = torch.ops.tracedac.reduce_scatter(full, f.key)
            assert part.shape == f.leaf.shape and part.dtype == torch.float32
    assert {f.dtype for f in flats} == {torch.bfloat16, torch.float32}


def test_bf16_gradients_reduced_in_bf16_are_upcast_into_fp32_shard_grads(world1):
    """reduce_dtype=bf16: the reduce-scatter moves bf16 and accumulate_ adds it into fp32 .grad.
    One rank sends nothing but still reduces in bf16: the LayerNorms' gradients, computed in
    fp32 (autocast runs the norm in fp32), hold bf16 values, which the unsharded model's do not."""
    ref = zm.model()
    m = zero.shard(zm.model(), mixed_precision=zero.MixedPrecision(reduce_dtype=torch.bfloat16))
    x, y = zm.data(0)
    F.mse_loss(ref(x), y).backward()
    F.mse_loss(m(x), y).backward()
    grads = {n: p.grad for n, p in m.named_parameters() if p.requires_grad}
    assert all(g.dtype == torch.float32 for g in grads.values())
    for name, p in ref.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(grads[name].full_tensor(), p.grad, atol=3e-2, rtol=5e-2)
    norms = [n for n in grads if ".norm." in n]
    assert norms
    for name in norms:
        g, want = grads[name].full_tensor(), ref.get_parameter(name).grad
        assert torch.equal(g, g.bfloat16().float()) and not torch.equal(want, want.bfloat16().float()), name


def test_one_ranks_reduce_scatter_is_the_cast_and_its_adjoint_the_identity(world1):
    """``tracedac::reduce_scatter`` with one rank: this rank's part of a sum over one rank,
    divided by one, is the gradient itself in the reduce dtype, a buffer of its own; its
    backward (what a gradient with a graph of its own differentiates) passes the cotangent on."""
    m = zero.shard(zm.model())
    flat = m._tracedac_zero.all_groups[0]
    g = torch.randn(flat.shard_numel, dtype=torch.bfloat16, requires_grad=True)
    part = torch.ops.tracedac.reduce_scatter(g, flat.key)
    assert part.dtype == torch.float32 and torch.equal(part, g.float())
    assert part.untyped_storage().data_ptr() != g.untyped_storage().data_ptr()
    v = torch.randn_like(part)
    part.backward(v)
    assert g.grad.dtype == torch.bfloat16 and torch.equal(g.grad, v.bfloat16())


def test_tracedac_zero_is_a_lazy_attribute():
    import sys

    import tracedac as td

    assert td.zero is sys.modules["tracedac.zero"]


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_model_whose_root_has_no_parameters_shards_trains_and_counts_its_passes(world1):
    """Every parameter is in a unit; the root's forward still marks where a pass starts, so
    the recorded order of gathers does not grow over forwards without backward (evaluation)."""
    torch.manual_seed(0)
    ref = Stack()
    m = zero.shard(Stack())
    zero.load_full_state_dict(m, ref.state_dict())
    x = torch.randn(3, 4)
    for model in (ref, m):
        for _ in range(3):
            model(x).sum().backward()
    torch.testing.assert_close(zero.full_state_dict(m), ref.state_dict())
    torch.testing.assert_close(m.layers[0].weight.grad.full_tensor(), ref.layers[0].weight.grad)
    state = m._tracedac_zero.units[0].state
    with torch.no_grad():
        for _ in range(5):
            m(x)
    assert len(state.current) == 2


@pytest.mark.parametrize("where", ["plain", "inside-unit"])
def test_each_backward_of_a_retained_graph_gathers_each_group_once_and_frees_it(world1, where):
    m = zm.with_checkpoint(zm.model(), where)
    x, y = zm.data(0)
    loss = F.mse_loss(m(x), y)
    counts = []
    for _ in range(2):
        log = GatherLog()
        try:
            loss.backward(retain_graph=True)
        finally:
            log.close()
        counts.append(dict(log.counts))
        assert log.alive() == 0, "a gathered buffer outlived the backward that needed it"
    assert counts[0] == counts[1] and counts[0]
    once = zm.model()
    F.mse_loss(once(x), y).backward()
    torch.testing.assert_close(zm.full_grads(m), 2 * zm.flat_grads(once))


def test_recompute_by_default_names_the_gather_and_refuses_a_packet():
    assert id(torch.ops.tracedac.all_gather.default) in policies.RECOMPUTE_OPS
    with pytest.raises(TypeError, match="OpOverload"):
        policies.recompute_by_default(torch.ops.tracedac.all_gather, "a packet, not an overload")


def test_nested_units_each_gather_their_own_parameters(world1):
    """units=(Block, nn.Linear): the Linears inside a block are units of their own."""
    ref, _ = zm.reference()
    m = zero.shard(zm.model(), units=(zm.Block, nn.Linear))
    names = [u.name for u in m._tracedac_zero.units]
    assert {"", "embed", "blocks.0", "blocks.0.lin1", "blocks.1.lin2"} <= set(names)
    zm.train(m, 0, 1)
    assert zm.max_diff(zero.full_state_dict(m), ref) < 1e-5


def test_gradients_dropped_or_zeroed_by_the_user_between_backwards_accumulate_as_torch(world1):
    """Some .grad set to None, some zeroed in place: the next backward adds parameter by
    parameter (the one-buffer fast path no longer applies) and equals torch's."""
    ref, m = zm.model(), zero.shard(zm.model())
    x, y = zm.data(0)
    for model in (ref, m):
        F.mse_loss(model(x), y).backward()
    for model in (ref, m):
        model.blocks[0].lin1.weight.grad = None
        model.blocks[2].norm.weight.grad.zero_()
    for model in (ref, m):
        F.mse_loss(model(x), y).backward()
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        if q.grad is not None:
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=name)


def test_zero_grad_set_to_none_frees_the_gradient_shards_and_accumulation_still_adds_in_place(
    world1, monkeypatch
):
    """``zero_grad(set_to_none=True)`` frees the gradients, as for plain parameters: before,
    each group held its flat gradient (and the DTensors viewing it) to the next backward's
    reduction, a rank's whole gradient shard held between steps and into the next peak (1.11x
    FSDP2's peak on an H200, 1.10x on a CPU run of the same measurement; 0.98x without it).
    Without ``zero_grad`` the next backward still adds into the same buffer, once per group."""
    from tracedac.zero import group as zgroup

    ref, m = zm.model(tie=False), zero.shard(zm.model(tie=False))
    opt = torch.optim.AdamW(m.parameters())
    x, y = zm.data(0)
    F.mse_loss(m(x), y).backward()
    grads = [p.grad for p in m.parameters() if p.grad is not None]
    storages = {g._local_tensor.untyped_storage()._cdata: g._local_tensor.untyped_storage() for g in grads}
    refs = [st._weak_ref() for st in storages.values()]
    del grads, storages
    opt.step()
    opt.zero_grad(set_to_none=True)
    gc.collect()
    try:
        assert all(torch.UntypedStorage._expired(r) for r in refs), "a gradient buffer outlived zero_grad"
    finally:
        for r in refs:
            torch.UntypedStorage._free_weak_ref(r)
    ref.load_state_dict(zero.full_state_dict(m))
    adds = []
    accumulate = zgroup.accumulate_
    monkeypatch.setattr(zgroup, "accumulate_", lambda buf, part: adds.append(buf) or accumulate(buf, part))
    for model in (ref, m):
        F.mse_loss(model(x), y).backward()
    first = [p.grad for p in m.parameters()]
    adds.clear()
    for model in (ref, m):
        F.mse_loss(model(x), y).backward()
    assert all(p.grad is g for p, g in zip(m.parameters(), first))
    assert len(adds) == sum(g.requires_grad for g in sharded(m).all_groups)  # the fused pass, once a group
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        if q.grad is not None:
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=name)


def _two_units_sharing_a_bias():
    m = nn.Module()
    m.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
    m.layers[1].bias = m.layers[
        0
    ].bias  # held by layers.1 after its own weight: two groups, one use out of order
    return m


def _meta_mesh_dispatches() -> bool:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = DeviceMesh.from_group(torch.distributed.group.WORLD, "meta")
    try:
        DTensor.from_local(torch.empty(2, device="meta"), mesh, [Shard(0)]).detach()
    except RuntimeError:
        return False
    return True


def test_to_empty_respecs_every_group_and_keeps_parameter_order(world1, monkeypatch):
    import sys

    zshard = sys.modules["tracedac.zero.shard"]
    with torch.device("meta"):
        m = _two_units_sharing_a_bias()
    keys = list(m.state_dict())
    from torch.distributed.device_mesh import DeviceMesh

    real = zshard._mesh
    # A mesh of another device type than the shards' next one (as meta -> cuda under NCCL).
    # torch >= 2.14 runs no DTensor op on a mesh of device type "meta" (its cost model asks
    # the device's handle how many devices a host has, and meta has none), which users never
    # make: there a "cpu" mesh stands in, and the respec below is to the same type.
    mesh_type = "meta" if _meta_mesh_dispatches() else "cpu"
    monkeypatch.setattr(zshard, "_mesh", lambda group, device: DeviceMesh.from_group(group, mesh_type))
    zero.shard(m)
    monkeypatch.setattr(zshard, "_mesh", real)
    assert len(sharded(m).all_groups) == 2
    m.to_empty(device="cpu")
    assert list(m.state_dict()) == keys
    params = [p for _, p in m.named_parameters()]
    assert {p.device_mesh.device_type for p in params} == {"cpu"}
    assert all(p.to_local().device.type == "cpu" for p in params)
    m.layers[0].reset_parameters()
    m.layers[1].reset_parameters()
    m.layers[1](m.layers[0](torch.randn(2, 4))).sum().backward()
    assert all(p.grad is not None for p in params)


def test_agreements_go_through_a_group_that_moves_cpu_tensors(world1, monkeypatch):
    """Order checks and decisions run on the host: gloo (or a CPU backend beside NCCL) is
    used as it is; NCCL gets a gloo twin of the same ranks, made once and kept; another
    backend keeps its group and the caller's device."""
    from tracedac import agreements as hg

    group, cuda = dist.group.WORLD, torch.device("cuda", 3)  # no GPU here: the choice, not a move
    for backend in ("gloo", "cpu:gloo,cuda:nccl"):
        monkeypatch.setattr(hg, "_backend", lambda g, b=backend: b)
        assert hg.host_group(group, cuda) == (group, torch.device("cpu"))
    monkeypatch.setattr(hg, "_backend", lambda g: "nccl" if g is group else dist.get_backend(g))
    twin, device = hg.host_group(group, cuda)
    assert twin is not group and device == torch.device("cpu")
    assert dist.get_backend(twin) == "gloo" and dist.get_process_group_ranks(twin) == [0]
    assert hg.host_group(group, cuda)[0] is twin  # made once
    monkeypatch.setattr(hg, "_backend", lambda g: "ucc")
    assert hg.host_group(group, cuda) == (group, cuda)


def test_a_weight_tied_between_a_block_sharded_first_and_the_model_is_refused_naming_both(world1):
    m = nn.Module()
    m.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
    m.head = nn.Linear(4, 4)
    m.head.weight = m.blocks[0].weight
    zero.shard(m.blocks[0])
    with pytest.raises(zero.ZeroError, match=r"'head.weight'.*'blocks.0.weight'.*level containing both"):
        zero.shard(m)
    n = nn.Module()  # the same tie sharded at one level: one parameter, gathered by both units
    n.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
    n.head = nn.Linear(4, 4)
    n.head.weight = n.blocks[0].weight
    zero.shard(n)
    assert n.head.weight is n.blocks[0].weight


def _linears():
    m = nn.Module()
    m.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 3)])
    return m


def test_load_state_dict_with_assign_writes_into_the_shards_and_keeps_training(world1):
    ref = _linears()
    sd = {k: v + 1 for k, v in ref.state_dict().items()}
    for assigned in (sd, {k: v for k, v in zero.shard(_linears()).state_dict().items()}):
        m = zero.shard(_linears())
        own = {n: p for n, p in m.named_parameters()}
        m.load_state_dict({k: v.clone() for k, v in assigned.items()}, assign=True)
        assert all(p is own[n] for n, p in m.named_parameters())  # the group's own parameters, still
        for k, v in assigned.items():
            full = v.full_tensor() if hasattr(v, "full_tensor") else v
            assert torch.equal(m.get_parameter(k).full_tensor(), full)
        x = torch.randn(2, 4)
        m.layers[1](m.layers[0](x)).sum().backward()
        assert all(p.grad is not None for p in m.parameters())


def test_load_state_dict_with_assign_into_a_model_on_meta_says_to_call_to_empty(world1):
    with torch.device("meta"):
        m = zero.shard(_linears())
    with pytest.raises(zero.ZeroError, match="to_empty"):
        m.load_state_dict(_linears().state_dict(), assign=True)
    assert all(p._tracedac_group is not None for p in m.parameters())  # nothing left detached
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    sd = _linears().state_dict()
    with pytest.raises(zero.ZeroError, match="to_empty"):
        set_model_state_dict(m, dict(sd), options=options)
    m.to_empty(device="cpu")
    set_model_state_dict(m, dict(sd), options=options)
    assert all(torch.equal(m.get_parameter(k).full_tensor(), v) for k, v in sd.items())


def test_one_rank_prefetches_nothing_and_gathers_by_a_cast_without_a_collective(world1):
    """One rank: a gather is a cast on the compute stream, so nothing is started early (it
    would overlap nothing and hold the next unit sooner) and no collective is issued; the
    unconsumed prefetch two ranks drain is tests/zero/test_distributed.py's. Gradients equal
    the unsharded model's, skipped layers and all."""
    torch.manual_seed(0)
    ref = zm.Skipping()
    m = zero.shard(zm.Skipping())
    zero.load_full_state_dict(m, ref.state_dict())
    x = torch.randn(3, 4)
    z = m._tracedac_zero
    log = GatherLog()
    try:
        for skip in (None, 2, 0):  # learns the order, then leaves it
            for mod in (m, ref):
                for p in mod.parameters():
                    p.grad = None
                mod(x, skip=skip).sum().backward()
            assert [g.name for g in z.all_groups if g.pending is not None] + z.state.inflight == []
            for a, b in zip(m.layers, ref.layers):
                if b.weight.grad is None:
                    assert a.weight.grad is None
                else:
                    torch.testing.assert_close(a.weight.grad.full_tensor(), b.weight.grad)
    finally:
        log.close()
    # 5 + 3 + 3 gathers: each forward's layers, and backward's again where a layer's input
    # needs a gradient (not the first layer to run: x needs none)
    assert sum(log.counts.values()) == 11, log.counts
    assert (log.prefetched, log.starts, log.bytes) == (0, 11, 0)


def test_one_rank_compiles_auto_mixed_precision_in_process_clips_and_reads_full_parameters(world1):
    """The quick loop's pass over what the spawned tests check at length: a sharded model under
    ``MixedPrecision("auto")`` compiled fullgraph in this process (the gather-cast, gather-tag and
    prefetch passes), its loss that of the eager model, ``clip_grad_norm_`` equal to torch's on the
    unsharded gradients, and ``full_parameters`` the unsharded values."""
    import torch._dynamo

    ref = zm.model(tie=False)
    m = zero.shard(zm.model(tie=False), mixed_precision=zero.MixedPrecision("auto"))
    x, y = zm.data(0)
    compiled_model = torch.compile(m, fullgraph=True, backend="aot_eager_decomp_partition")
    with torch.autocast("cpu", torch.bfloat16):
        eager = F.mse_loss(m(x), y)  # "auto" decides its dtypes from this first forward
        torch._dynamo.reset()
        compiled = F.mse_loss(compiled_model(x), y)
    torch._dynamo.reset()
    assert torch.equal(eager, compiled)
    compiled.backward()
    with torch.autocast("cpu", torch.bfloat16):
        F.mse_loss(ref(x), y).backward()
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    got = zero.clip_grad_norm_(m, 0.5)
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=0)  # bf16 matmuls on both sides
    with zero.full_parameters(m):
        assert all(torch.equal(a, b) for a, b in zip(m.parameters(), ref.parameters()))
