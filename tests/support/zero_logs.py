"""Logs of what ``tracedac.zero`` sends, read where it meets the process group: the flat
groups' gathers and order checks, and the bytes each collective moves, by dtype.

Each log patches the module globals of ``tracedac.zero.group`` through which every
collective goes (``_all_gather``, ``_reduce_scatter``: ``torch.distributed``'s own functions)
until ``close``: the bytes counted are those the process group was handed.
"""

from __future__ import annotations

import collections
import time
import weakref

import torch
import torch.nn.functional as F

from tracedac.zero import group as zgroup
from tracedac.zero import inflight as zinflight

from .zero_model import rank_batch

__all__ = ["CheckLog", "GatherLog", "WireLog", "live_gathered", "train_logged"]


def live_gathered() -> int:
    """Gathered buffers a unit's forward registered and no ``release`` has let go of yet (none
    once a pass has ended; the compiled path registers none)."""
    return len(zgroup.LIVE)


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


class WireLog:
    """The bytes of every all-gather's output by dtype (``bytes``: the full tensor, ``world``
    times what each rank sends; an order check's rows are int64), as the process group sees
    them, eager or compiled, while open (``with WireLog() as log``). One rank sends nothing:
    its gathers are casts, and the log stays empty."""

    def __init__(self):
        self.bytes: collections.Counter = collections.Counter()
        self._real = zgroup._all_gather

    def __enter__(self):
        real, log = self._real, self

        def all_gather(out, src, **kw):
            log.bytes[str(out.dtype).removeprefix("torch.")] += out.numel() * out.element_size()
            return real(out, src, **kw)

        zgroup._all_gather = all_gather
        return self

    def __exit__(self, *exc):
        zgroup._all_gather = self._real


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


def train_logged(m, rank, world, steps=3, log=GatherLog, read=lambda log: (log.bytes, log.gathered)):
    """Losses and, per step, what ``read`` finds in a ``log`` open over forward and backward
    (default: all-gather bytes sent and gathered); each forward under bf16 autocast."""
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    losses, logged = [], []
    for step in range(steps):
        x, y = rank_batch(step, rank, world)
        opened = log()
        try:
            with torch.autocast("cpu", torch.bfloat16):
                loss = F.mse_loss(m(x).float(), y)
            loss.backward()
        finally:
            opened.close()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        logged.append(read(opened))
    return losses, logged
