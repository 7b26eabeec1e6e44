"""Issue 17: what FSDP2 users do, on a sharded model, on 1 (in process), 2 and 3 ranks.

The training loops people write: every rank function below trains a sharded model and the same
unsharded model on the same data (the tests' model, tests/support/zero_model.py) and checks
the global losses (the mean over ranks of per-rank mean losses, which equal the unsharded loss
on the combined batch) and full parameters. One spawned group per world size runs every one
(tests/support/ranks.py); each test reports its check.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import tracedac.zero as zero
from tracedac.zero import group as zgroup

from ..support.ranks import Checks, message_of, run_parts, run_parts_here
from ..support.zero_logs import GatherLog
from ..support.zero_model import (
    data,
    flat_grads,
    full_grads,
    global_loss,
    max_diff,
    model,
    param_groups,
    rank_batch,
)

pytestmark = pytest.mark.slow  # the quick loop (pytest -m "not slow") leaves this file out


def _close(a, b, tol=1e-5):
    assert len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b)), (a, b)


def run(m, rank, world, steps=3, clip=None, micro=1, sync=None):
    """Train with AdamW on two parameter groups; ``micro`` micro-batches per step, gradient
    sync only on the last when ``sync`` (the model's set_requires_gradient_sync) is given."""
    opt = torch.optim.AdamW(param_groups(m), lr=1e-2)
    losses = []
    for step in range(steps):
        x, y = rank_batch(step, rank, world)
        xs, ys = x.chunk(micro), y.chunk(micro)
        total = 0.0
        for i in range(micro):
            if sync is not None:
                sync(i == micro - 1)
            loss = F.mse_loss(m(xs[i]), ys[i]) / micro
            loss.backward()
            total += global_loss(loss, world)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(list(m.parameters()), clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def full(m) -> dict:
    return (
        zero.full_state_dict(m)
        if hasattr(m, "_tracedac_zero")
        else {k: v.clone() for k, v in m.state_dict().items()}
    )


def nesting(rank, world):
    """shard(block) for each block, then shard(model): FSDP2's pattern; clipped with torch's
    own clip_grad_norm_ on the DTensor gradients; every trainable parameter moves."""
    ref = model(tie=False)
    ref_losses = run(ref, 0, 1, clip=0.05)
    m = model(tie=False)
    for b in m.blocks:
        zero.shard(b)
    zero.shard(m)
    before = full(m)
    losses = run(m, rank, world, clip=0.05)
    after = full(m)
    trainable = [n for n, p in m.named_parameters() if p.requires_grad]
    unchanged = [n for n in trainable if torch.equal(before[n], after[n])]
    twice = message_of(zero.ZeroError, zero.shard, m.blocks[0])
    _close(losses, ref_losses)
    diff = max_diff(after, full(ref))
    assert diff < 1e-5 and unchanged == [] and len(trainable) == 25, (diff, unchanged, trainable)
    assert "already sharded" in twice, twice


def outside(rank, world):
    """Parameters read outside forward are DTensor shards; full_parameters() is writable."""
    from torch.distributed.tensor import DTensor

    ref = model()
    run(ref, 0, 1, steps=1)
    m = zero.shard(model())
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, y = rank_batch(0, rank, world)
    F.mse_loss(m(x), y).backward()
    opt.step()
    opt.zero_grad()
    weight = m.blocks[1].lin1.weight
    out = dict(is_dtensor=isinstance(weight, DTensor), device=str(weight.device))
    with zero.full_parameters(m):
        inside = m.blocks[1].lin1.weight
        out["inside"] = (type(inside).__name__, tuple(inside.shape))
        with torch.no_grad():
            inside.mul_(0).add_(0.5)  # writable, in place
            m.head.bias.fill_(3.0)
        try:
            m(x)
        except zero.ZeroError as e:
            out["forward_inside"] = str(e)
    out["same_object"] = m.blocks[1].lin1.weight is weight
    sd = zero.full_state_dict(m)
    out["written"] = bool((sd["blocks.1.lin1.weight"] == 0.5).all()) and bool((sd["head.bias"] == 3.0).all())
    F.mse_loss(m(x), y).backward()  # the optimizer built before goes on with the same parameters
    opt.step()
    out["moved"] = not bool((zero.full_state_dict(m)["blocks.1.lin1.weight"] == 0.5).all())
    assert out["is_dtensor"] and out["device"] == "cpu", out
    assert out["inside"] == ("Parameter", (32, 16)), out
    assert out["written"] and out["same_object"] and out["moved"], out
    assert "full_parameters" in out.get("forward_inside", ""), out


class AliveBytes(TorchDispatchMode):
    """Bytes of the tensors produced by aten ops that are still alive: measured from outside."""

    def __init__(self):
        super().__init__()
        self.refs = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (list, tuple)) else [out]:
            if isinstance(t, torch.Tensor) and not t._is_view() and t.device.type != "meta":
                self.refs[t.untyped_storage().data_ptr()] = (
                    torch.utils.weak.WeakRef(t),
                    t.untyped_storage().nbytes(),
                )
        return out

    def alive(self) -> int:
        return sum(n for ref, n in self.refs.values() if ref() is not None)


def torch_checkpoint(rank, world):
    """torch.utils.checkpoint inside a unit (around a Linear) and around units (whole blocks):
    gradients equal the unsharded model's; held bytes after forward drop; backward re-gathers."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    def wrap_blocks(m):  # FSDP2's recipe: checkpoint_wrapper around each block
        for i, b in enumerate(m.blocks):
            m.blocks[i] = checkpoint_wrapper(b)

    out = {}
    for where in ("none", "inside", "around", "wrapper-before", "wrapper-after"):
        results = []
        for sharded in (False, True):
            m = model()
            m.checkpoint_blocks = where == "around"
            for b in m.blocks:
                b.checkpoint_lin1 = where == "inside"
            if where == "wrapper-before" or (where == "wrapper-after" and not sharded):
                wrap_blocks(m)
            if sharded:
                zero.shard(m)
                if where == "wrapper-after":
                    wrap_blocks(m)
            x, y = rank_batch(0, rank, world) if sharded else data(0)
            log = GatherLog() if sharded else None
            mode = AliveBytes()
            try:
                with mode:
                    loss = F.mse_loss(m(x), y)
                held = mode.alive()
                forward = sum(log.counts.values()) if log else 0
                loss.backward()
                backward = sum(log.counts.values()) - forward if log else 0
            finally:
                if log:
                    log.close()
            grads = full_grads(m) if sharded else flat_grads(m)
            results.append(dict(held=held, grads=grads, forward=forward, backward=backward))
        ref, sh = results
        out[where] = dict(
            grad_diff=(ref["grads"] - sh["grads"]).abs().max().item(),
            held=sh["held"],
            forward=sh["forward"],
            backward=sh["backward"],
        )
    r = out
    for where in ("none", "inside", "around", "wrapper-before", "wrapper-after"):
        assert r[where]["grad_diff"] < 1e-5, (where, r)
    # around whole units (in forward, or checkpoint_wrapper before or after shard): the
    # blocks' activations are not held, gathers run again in backward
    for where in ("around", "wrapper-before", "wrapper-after"):
        assert r[where]["held"] < 0.5 * r["none"]["held"], (where, r)
        assert r[where]["backward"] >= r[where]["forward"] - 3, (where, r)  # all but the 3 frozen groups
    # inside a unit: re-running the Linear in backward gathers its unit again
    assert r["inside"]["backward"] > r["none"]["backward"], r


def no_sync(rank, world):
    """set_requires_gradient_sync(False) on all micro-batches but the last: no reduce-scatter
    for them, and training equals the unsharded model's with the summed gradients."""
    ref_losses = run(model(), 0, 1, micro=2)
    m = zero.shard(model())
    calls = []
    real = zgroup._reduce_scatter

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    zgroup._reduce_scatter = counting
    try:
        losses = run(m, rank, world, micro=2, sync=m.set_requires_gradient_sync)
        without = len(calls)
        run(zero.shard(model()), rank, world, micro=2)
    finally:
        zgroup._reduce_scatter = real
    _close(losses, ref_losses)
    diff = max_diff(full(m), full_ref(micro=2))
    assert diff < 1e-5, diff
    assert without * 2 == len(calls) - without, (without, len(calls) - without)


def full_ref(**kw):
    ref = model()
    run(ref, 0, 1, **kw)
    return full(ref)


def meta_init(rank, world):
    """Built on meta, sharded, to_empty; then loaded (every rank, or rank 0 by broadcast)
    or initialized with reset_parameters."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    ref = model()
    ref_sd = {k: v.clone() for k, v in ref.state_dict().items()}
    ref_losses = run(ref, 0, 1)
    out = {}
    for how in ("full", "broadcast", "reset"):
        with torch.device("meta"):
            m = model()
        zero.shard(m)
        on_meta = m.blocks[0].lin1.weight.device.type
        m.to_empty(device="cpu")
        if how == "full":
            zero.load_full_state_dict(m, ref_sd)
        elif how == "broadcast":
            set_model_state_dict(
                m,
                ref_sd if rank == 0 else {},
                options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
            )
        else:
            for mod in m.modules():
                if hasattr(mod, "reset_parameters"):
                    mod.reset_parameters()
            sd = zero.full_state_dict(m)
            out[how] = dict(
                on_meta=on_meta,
                finite=all(bool(v.isfinite().all()) for v in sd.values()),
                weight_std=sd["blocks.0.lin1.weight"].std().item(),
            )
            continue
        out[how] = dict(on_meta=on_meta, losses=run(m, rank, world), ref=ref_losses)
    for how in ("full", "broadcast"):
        assert out[how]["on_meta"] == "meta", out[how]
        _close(out[how]["losses"], out[how]["ref"])
    assert out["reset"]["finite"] and out["reset"]["weight_std"] > 0.01, out["reset"]


def dtype_change(rank, world):
    """model.to(dtype) / .half() after sharding raise at the call and change nothing."""
    m = zero.shard(model())
    before = full(m)
    errors = []
    for call in (
        lambda: m.to(torch.bfloat16),
        lambda: m.half(),
        lambda: m.double(),
        lambda: m.blocks[0].half(),
    ):
        try:
            call()
            errors.append(None)
        except zero.ZeroError as e:
            errors.append(str(e))
    m.to("cpu")
    m.float()
    unchanged, losses = max_diff(full(m), before), run(m, rank, world, steps=1)
    assert all(e is not None and "MixedPrecision" in e for e in errors), errors
    assert unchanged == 0.0, unchanged
    assert len(losses) == 1, losses


def llama(rank, world):
    """A transformers Llama (tiny config) built on meta, sharded per decoder layer then whole,
    loaded from rank 0's full state dict by broadcast, 3 AdamW steps with two parameter
    groups: losses equal the unsharded model's."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    ref = LlamaForCausalLM(config)
    sd = {k: v.clone() for k, v in ref.state_dict().items()}
    with torch.device("meta"):
        m = LlamaForCausalLM(config)
    for layer in m.model.layers:
        zero.shard(layer)
    zero.shard(m)
    m.to_empty(device="cpu")
    set_model_state_dict(
        m, sd if rank == 0 else {}, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
    with torch.no_grad():  # non-persistent buffers (rotary inv_freq) are in no state dict: initialize
        for name, buf in ref.named_buffers():
            m.get_buffer(name).copy_(buf)
    tokens = torch.randint(0, 64, (3, 4, 8), generator=torch.Generator().manual_seed(1))  # [steps, B, T]

    def train(model, rows):
        decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
        rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 5e-3}],
            lr=1e-2,
        )
        losses = []
        for step in range(3):
            ids = tokens[step, rows]
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(global_loss(loss, world if model is m else 1))
        return losses

    per = 4 // world
    losses, want = train(m, slice(rank * per, (rank + 1) * per)), train(ref, slice(0, 4))
    assert [n for n, _ in m.named_parameters()] == [n for n, _ in ref.named_parameters()]
    _close(losses, want)


ALL = (nesting, outside, torch_checkpoint, no_sync, meta_init, dtype_change, llama)
WORLDS = {1: ALL, 2: ALL, 3: (nesting, outside, meta_init)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """{world: its checks}: world 1 in this process, 2 and 3 spawned."""
    import torch.distributed as dist

    tmp = tmp_path_factory.mktemp("world1")
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=0, world_size=1)
    try:
        out = {1: Checks([run_parts_here(0, 1, [(fn,) for fn in WORLDS[1]])])}
    finally:
        dist.destroy_process_group()
    for world in (2, 3):
        out[world] = run_parts(world, [(fn,) for fn in WORLDS[world]], timeout=300)
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_blocks_sharded_then_the_model_train_as_unsharded_and_every_parameter_moves(ranks, world):
    """Parameter groups chosen by name (decay on matrices), torch's clip_grad_norm_ on DTensors."""
    ranks[world].passed("nesting")


@pytest.mark.parametrize("world", [1, 2, 3])
def test_parameters_outside_forward_are_dtensor_shards_and_full_parameters_is_writable(ranks, world):
    ranks[world].passed("outside")


@pytest.mark.parametrize("world", [1, 2])
def test_torch_checkpoint_inside_and_around_units_gives_the_gradients_and_backward_gathers_again(
    ranks, world
):
    ranks[world].passed("torch_checkpoint")


@pytest.mark.parametrize("world", [1, 2])
def test_gradient_accumulation_without_sync_reduces_only_the_last_micro_batch(ranks, world):
    ranks[world].passed("no_sync")


@pytest.mark.parametrize("world", [1, 2, 3])
def test_built_on_meta_then_loaded_or_broadcast_from_rank0_trains_as_unsharded(ranks, world):
    ranks[world].passed("meta_init")


@pytest.mark.parametrize("world", [1, 2])
def test_changing_the_dtype_after_sharding_raises_at_the_call_and_changes_nothing(ranks, world):
    ranks[world].passed("dtype_change")


@pytest.mark.parametrize("world", [1, 2])
def test_a_transformers_llama_built_on_meta_sharded_per_layer_trains_as_unsharded(ranks, world):
    ranks[world].passed("llama")
