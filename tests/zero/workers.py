"""What each rank runs in the zero tests (imported by spawned processes, so top-level)."""

from __future__ import annotations

import collections
import os
import time
import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import tracedac
import tracedac.zero as zero
from tracedac.zero import group as zgroup
from tracedac.zero import inflight as zinflight

D = 16
BATCH = 12  # divides by world sizes 1 to 4


class Block(nn.Module):
    def __init__(self, d=D):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.lin1 = nn.Linear(d, 2 * d)
        self.lin2 = nn.Linear(2 * d, d)
        self.odd = nn.Parameter(torch.randn(7) * 0.1)  # 7 elements: divides by no world size > 1
        self.frozen = nn.Parameter(torch.randn(d) * 0.1, requires_grad=False)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.checkpoint_lin1 = False  # torch.utils.checkpoint around lin1, inside the unit
        self.odd_constant = False  # odd read detached: its group gets no gradient (ranks that diverge)

    def forward(self, x):  # [B, D]
        self.calls.add_(1)  # a side effect (an MoE router's counter): once per step
        h = self.norm(x)
        h = checkpoint(self.lin1, h, use_reentrant=False) if self.checkpoint_lin1 else self.lin1(h)
        h = self.lin2(F.gelu(h))
        odd = self.odd.detach() if self.odd_constant else self.odd
        return x + h.float() * (1 + odd.sum()) + self.frozen


class Model(nn.Module):
    def __init__(self, d=D, n=3, tie=True):
        super().__init__()
        self.embed = nn.Linear(d, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        if tie:
            self.blocks[1].lin2.weight = self.blocks[0].lin2.weight  # shared between two units
        self.head = nn.Linear(d, 1)
        self.checkpoint_blocks = False  # torch.utils.checkpoint around each block (a unit)
        self.skip = ()  # indices of blocks this rank's forward skips (ranks that diverge)

    def forward(self, x):
        h = self.embed(x)
        for i, b in enumerate(self.blocks):
            if i in self.skip:
                continue
            h = checkpoint(b, h, use_reentrant=False) if self.checkpoint_blocks else b(h)
        return self.head(h).float().squeeze(-1)


def data(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, D, generator=g), torch.randn(BATCH, generator=g)


def model(seed=0, **kw):
    torch.manual_seed(seed)
    return Model(**kw)


def rank_batch(step, rank, world):
    """This rank's slice of step ``step``'s batch: ``BATCH // world`` rows."""
    x, y = data(step)
    per = BATCH // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def train(m, rank, world, steps=3, clip=None, opt_cls=torch.optim.Adam):
    opt = opt_cls(m.parameters(), lr=1e-2)
    for step in range(steps):
        x, y = rank_batch(step, rank, world)
        loss = F.mse_loss(m(x), y)
        loss.backward()
        if clip is not None:
            sharded = hasattr(m, "_tracedac_zero")
            norm = (
                zero.clip_grad_norm_(m, clip) if sharded else nn.utils.clip_grad_norm_(m.parameters(), clip)
            )
        opt.step()
        opt.zero_grad()
    return norm if clip is not None else None


def max_diff(a: dict, b: dict) -> float:
    assert list(a) == list(b), (list(a), list(b))
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a.values(), b.values()))


def reference(steps=3, clip=None):
    m = model()
    norm = train(m, 0, 1, steps, clip)
    return m.state_dict(), norm


def with_checkpoint(m, where):
    if where == "wrap-before":
        return zero.shard(tracedac.wrap(m, Block))
    if where == "wrap-after":
        return tracedac.wrap(zero.shard(m), Block)
    if where == "inside-unit":  # regions around Linears inside the units: gathers happen outside them
        return tracedac.wrap(zero.shard(m), lambda name, mod: name.endswith(("lin1", "lin2")))
    return zero.shard(m)


def equivalence(rank, world, variants=("plain",)):
    """Max difference from single-process training on the combined batch, per variant."""
    ref, _ = reference()
    out = {}
    for where in variants:
        m = with_checkpoint(model(), where)
        train(m, rank, world)
        out[where] = max_diff(zero.full_state_dict(m), ref)
    return out


class GatherLog:
    """Counts gathers per flat group, the bytes of parameters all-gathered (sent to the process
    group: ``bytes``; handed to the model, which one rank gets without sending: ``gathered``),
    and keeps weak references to every gathered buffer."""

    def __init__(self):
        self.counts = collections.Counter()
        self.refs = []
        self.bytes = self.gathered = 0
        self._gather, self._all_gather = zgroup.FlatGroup.gather, zgroup._all_gather
        log = self

        self.prefetched = self.starts = 0
        self._start = zgroup.FlatGroup.start

        def start(flat, shard, dtype=None, together=()):
            log.starts += 1 + len(together)
            return log._start(flat, shard, dtype, together)

        def gather(flat, shard, dtype=None):
            log.prefetched += flat.pending is not None
            out = log._gather(flat, shard, dtype)
            log.counts[flat.key] += 1
            log.gathered += out.numel() * out.element_size()
            log.refs.append(weakref.ref(out))
            return out

        def all_gather(out, src, **kw):
            if out.dtype != torch.int64:  # not an order check's rows: parameters
                log.bytes += out.numel() * out.element_size()
            return log._all_gather(out, src, **kw)

        zgroup.FlatGroup.gather, zgroup.FlatGroup.start, zgroup._all_gather = gather, start, all_gather

    def alive(self):
        """Gathered buffers still alive. gloo's worker thread lets go of a finished
        all-gather's output a moment after ``wait()`` returns: give it up to a second."""
        for _ in range(100):
            n = sum(r() is not None for r in self.refs)
            if n == 0:
                break
            time.sleep(0.01)
        return n

    def close(self):
        zgroup.FlatGroup.gather, zgroup.FlatGroup.start, zgroup._all_gather = (
            self._gather,
            self._start,
            self._all_gather,
        )


def memory(rank, world):
    """After forward no gathered buffer is alive; backward gathers each group once per use;
    from the second step on, gathers are prefetched and none is wasted."""
    out = {}
    for where in ("plain", "wrap-before", "wrap-after", "inside-unit"):
        m = with_checkpoint(model(), where)
        z = m._tracedac_zero
        train(m, rank, world, steps=1)  # learns the order of gathers; the step changes the shards
        x, y = data(1)
        log = GatherLog()
        try:
            loss = F.mse_loss(m(x), y)
            alive_after_forward = log.alive()
            forward = dict(log.counts)
            log.counts.clear()
            loss.backward()
            backward = dict(log.counts)
        finally:
            log.close()
        # how many units gather each group: its owner, and units borrowing a shared parameter
        users = collections.Counter(g.key for u in z.all_units for g in u.groups)
        out[where] = dict(
            alive=alive_after_forward,
            forward=forward,
            backward=backward,
            users=dict(users),
            live=len(zgroup.LIVE),
            starts=log.starts,
            prefetched=log.prefetched,
            grads=all(p.grad is not None for p in m.parameters() if p.requires_grad),
        )
    return out


class Skipping(nn.Module):
    """Three Linears, one of which a forward may skip (the order of gathers changes)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])

    def forward(self, x, skip=None):
        for i, layer in enumerate(self.layers):
            if i != skip:
                x = layer(x)
        return x


def unconsumed(rank, world):
    """The order changes (a layer skipped, on every rank): the gather prefetched for it is
    waited for and dropped when the forward (root post-hook) or the backward (engine callback)
    ends, not left in flight until the next pass. Per pass: (prefetched, in flight after it),
    and the largest gradient difference from the unsharded model on the same batch."""
    torch.manual_seed(0)
    ref = Skipping()
    m = zero.shard(Skipping())
    zero.load_full_state_dict(m, ref.state_dict())
    x = torch.randn(3, 4)  # every rank the same batch: gradients average to the same
    z = m._tracedac_zero
    m(x).sum().backward()  # learns the orders: forward 0, 1, 2; backward 2, 1 (0's input x needs no grad)

    def in_flight():
        return [g.name for g in z.all_groups if g.pending is not None] + [g.name for g in z.state.inflight]

    out = []
    log = GatherLog()
    try:
        with torch.no_grad():
            m(x, skip=2)  # layer 1's gather prefetches layer 2's, never used
        out.append((log.starts - sum(log.counts.values()), in_flight()))
        for p in m.parameters():
            p.grad = None
        log.starts, log.counts = 0, collections.Counter()
        m(x, skip=0).sum().backward()  # backward: 2 prefetches 1, which now reads x: never used
        out.append((log.starts - sum(log.counts.values()), in_flight()))
    finally:
        log.close()
    ref(x, skip=0).sum().backward()
    diff = (m.layers[1].weight.grad.full_tensor() - ref.layers[1].weight.grad).abs().max().item()
    return dict(passes=out, diff=diff, skipped_grad=m.layers[0].weight.grad is None)


def full_grads(m) -> torch.Tensor:
    """The gradient of every trainable parameter, full (DTensor ``full_tensor``), by name, flat."""
    return torch.cat(
        [p.grad.full_tensor().flatten() for _, p in sorted(m.named_parameters()) if p.grad is not None]
    )


def flat_grads(m) -> torch.Tensor:
    """An unsharded model's gradients in the order of ``full_grads`` (by name), flat."""
    return torch.cat([p.grad.flatten() for _, p in sorted(m.named_parameters()) if p.grad is not None])


def mixed(rank, world):
    """bf16 gradients are within 2% of fp32 ones (relative norm); all-gathers move <= 0.55x the bytes."""
    ref = model()
    x, y = data(0)
    F.mse_loss(ref(x), y).backward()
    ref_grads = flat_grads(ref)
    x, y = rank_batch(0, rank, world)
    res = {}
    for name, mp in (
        ("fp32", None),
        ("bf16", zero.MixedPrecision()),
        ("bf16-reduce", zero.MixedPrecision(reduce_dtype=torch.bfloat16)),
    ):
        m = zero.shard(model(), mixed_precision=mp)
        log = GatherLog()
        try:
            F.mse_loss(m(x), y).backward()
        finally:
            log.close()
        error = ((full_grads(m) - ref_grads).norm() / ref_grads.norm()).item()
        res[name] = (error, log.bytes)
    return res


def state_dicts(rank, world, tmp):
    """Full, rank-0-only and DCP round trips; clip_grad_norm_ equals torch's."""
    import torch.distributed.checkpoint as dcp

    out = {}
    ref_sd, ref_norm = reference(steps=2, clip=0.05)
    m = zero.shard(model())
    norm = train(m, rank, world, steps=2, clip=0.05)
    out["clip"] = (abs(norm.item() - ref_norm.item()), max_diff(zero.full_state_dict(m), ref_sd))

    full = zero.full_state_dict(m)
    out["keys"] = list(full) == list(model().state_dict())
    out["rank0_only"] = len(zero.full_state_dict(m, rank0_only=True))
    fresh = zero.shard(model(seed=1))
    zero.load_full_state_dict(fresh, full)
    out["full_roundtrip"] = max_diff(zero.full_state_dict(fresh), full)

    dcp.save(m.state_dict(), checkpoint_id=tmp)  # the model's own DTensors: DCP as is
    other = zero.shard(model(seed=2))
    sd = other.state_dict()
    dcp.load(sd, checkpoint_id=tmp)
    other.load_state_dict(sd)
    out["dcp_roundtrip"] = max_diff(zero.full_state_dict(other), full)
    # the loaded model trains on exactly as the saved one
    train(m, rank, world, steps=1)
    train(other, rank, world, steps=1)
    out["after_step"] = max_diff(zero.full_state_dict(other), zero.full_state_dict(m))
    n_shard = sum(p.to_local().numel() for p in m.parameters())
    out["numel"] = (n_shard, sum(p.numel() for p in {id(p): p for p in model().parameters()}.values()))
    out["saved"] = full  # what the DCP checkpoint in tmp holds, for a load on another world size
    return out


def mismatched(rank, world):
    m = Model(d=D + 4 * rank)
    try:
        zero.shard(m)
    except zero.ZeroError as e:
        return str(e)
    return None


def dead_rank(rank, world):
    m = zero.shard(model(), timeout=3)
    if rank == 1:
        os._exit(0)  # dies before the step's first all-gather
    x, y = data(0)
    start = time.monotonic()
    try:
        m(x).sum().backward()
    except zero.ZeroError as e:
        return time.monotonic() - start, str(e)
    return time.monotonic() - start, None


def diverge(rank, world, learned=False):
    """Rank 1 skips block 1: every rank raises ZeroError at the first collective that differs.
    ``learned``: both ranks train a step first (the order of gathers is learned: a unit's
    groups then start together after one check, and the next unit's are prefetched).
    Returns (seconds, message, gathered buffers a unit still holds)."""
    m = zero.shard(model(tie=False), timeout=20)
    if learned:
        train(m, rank, world, steps=1)
    m.skip = (1,) if rank == 1 else ()
    x, y = rank_batch(int(learned), rank, world)
    start = time.monotonic()
    try:
        F.mse_loss(m(x), y).backward()
    except zero.ZeroError as e:
        return time.monotonic() - start, str(e), len(zgroup.LIVE)
    return time.monotonic() - start, None, len(zgroup.LIVE)


def diverge_in_backward(rank, world):
    """Under "auto" (three groups a block), after a step has taught the order in which a
    unit's groups reduce together: rank 1's block 2 reads its own parameter detached, so that
    group gets no gradient there. Every rank raises ZeroError at the first collective that
    differs. Returns (seconds, message)."""
    m = zero.shard(model(tie=False), mixed_precision=zero.MixedPrecision("auto"), timeout=20)
    train(m, rank, world, steps=1)
    m.blocks[2].odd_constant = rank == 1
    x, y = rank_batch(1, rank, world)
    start = time.monotonic()
    try:
        F.mse_loss(m(x), y).backward()
    except zero.ZeroError as e:
        return time.monotonic() - start, str(e)
    return time.monotonic() - start, None


def twin_checks(rank, world):
    """The ranks' agreements through a gloo twin of the process group, as on NCCL (the group
    reported as NCCL to ``host_group``): "auto" trains as with its checks on the group itself,
    every order check's rows go through the twin and none through the group, and ranks that
    diverge after a step still all raise. Returns those losses, routes and messages."""
    from tracedac import agreements as hg

    from .auto_workers import _train

    want, _ = _train(zero.shard(model(tie=False), mixed_precision=zero.MixedPrecision("auto")), rank, world)
    real_backend, real_gather, routes = hg._backend, zgroup._all_gather, collections.Counter()
    group = zero.shard(model(tie=False))._tracedac_zero.all_groups[0].group  # the model's

    def gather(out, src, **kw):
        if out.dtype == torch.int64:  # an order check's rows
            routes["group" if kw["group"] is group else "twin"] += 1
        return real_gather(out, src, **kw)

    hg._backend = lambda g: "nccl" if g is group else real_backend(g)
    zgroup._all_gather = gather
    try:
        m = zero.shard(model(tie=False), mixed_precision=zero.MixedPrecision("auto"))
        losses, _ = _train(m, rank, world)
        _, message, _ = diverge(rank, world, learned=True)
    finally:
        hg._backend, zgroup._all_gather = real_backend, real_gather
    return dict(want=want, losses=losses, routes=dict(routes), message=message)


def diverge_after_a_step(rank, world):
    return diverge(rank, world, learned=True)


class CheckLog:
    """Counts order checks, the groups each covers by kind, the collectives that move
    parameters or gradients ("sent all-gather", "sent reduce-scatter"), and the groups'
    outputs a unit's one all-gather had allocated before its wait ("allocated in flight"),
    until ``close``."""

    def __init__(self):
        self.counted = collections.Counter()
        self._real = real = (
            zgroup.FlatGroup.agree,
            zgroup._all_gather,
            zgroup._reduce_scatter,
            zinflight.Joint.wait,
        )
        log = self

        def wait(joint, timeout=None):
            if joint.out is not None:  # the first wait: the one that copies the groups out
                log.counted["allocated in flight"] += sum(o is not None for o in joint.outs)
            return real[3](joint, timeout)

        def agree(flat, what, dtype, together=()):
            log.counted["checks"] += 1
            log.counted[what] += 1 + len(together)
            return real[0](flat, what, dtype, together)

        def sent(what, collective):
            def run(out, src, **kw):
                if out.dtype != torch.int64:  # not an order check's rows
                    log.counted[f"sent {what}"] += 1
                return collective(out, src, **kw)

            return run

        zgroup.FlatGroup.agree = agree
        zgroup._all_gather = sent("all-gather", real[1])
        zgroup._reduce_scatter = sent("reduce-scatter", real[2])
        zinflight.Joint.wait = wait

    def close(self):
        zgroup.FlatGroup.agree, zgroup._all_gather, zgroup._reduce_scatter, zinflight.Joint.wait = self._real


def checks(rank, world):
    """Order checks, groups gathered and reduced, and collectives sent per step under "auto"
    (three groups per block), with prefetching (a unit's groups start together and reduce
    together) and without (each checked and sent alone), and under the module list; the
    losses of each, and the parameters after. The fourth of five steps skips block 1 on every
    rank: the order learned from the third no longer holds, and the fifth's was learned from
    the fourth."""
    from .auto_workers import _train

    out, params = {}, {}
    for name, mp, prefetch in (
        ("listed", zero.MixedPrecision(), True),
        ("auto", zero.MixedPrecision("auto"), True),
        ("auto-alone", zero.MixedPrecision("auto"), False),
    ):
        m = zero.shard(model(tie=False), mixed_precision=mp, prefetch=prefetch)

        def read(log, m=m):
            m.skip = (1,) if len(m.logged) == 2 else ()  # for the next step
            m.logged.append(None)
            return dict(log.counted)

        m.logged = []
        losses, counts = _train(m, rank, world, steps=5, log=CheckLog, read=read)
        params[name] = zero.full_state_dict(m)
        out[name] = dict(
            losses=losses, counts=counts, groups=len({g.key for g in m._tracedac_zero.all_groups})
        )
    out["params"] = max_diff(params["auto"], params["auto-alone"])
    return out


def several(rank, world, parts, where=None):
    """Run several of the workers above in one spawn (starting a rank costs seconds):
    ``parts`` is ``[(name, args)]``; returns ``{name: ("ok", result) or ("error", traceback)}``."""
    import traceback

    out = {}
    for name, args in parts:
        try:
            out[name] = ("ok", (where or globals())[name](rank, world, *args))
        except Exception:
            out[name] = ("error", traceback.format_exc())
    return out


def absent_rank(rank, world):
    """Rank 1 never calls shard(): rank 0 raises within shard's timeout."""
    if rank == 1:
        time.sleep(4)  # alive, but elsewhere, past rank 0's timeout
        os._exit(0)
    start = time.monotonic()
    try:
        zero.shard(model(), timeout=2)
    except zero.ZeroError as e:
        return time.monotonic() - start, str(e)
    return time.monotonic() - start, None
