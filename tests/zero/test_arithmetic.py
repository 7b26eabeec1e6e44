"""The arithmetic of ZeRO-3 on two ranks, in the quick loop: what the ranks add up is what one
process computes, and each rank holds its own rows.

On one rank a reduce-scatter that forgot its division by the world size, or divided twice, is
the identity, and Adam's update barely changes when every gradient doubles (it divides by the
gradient's own scale): both bugs passed every test that ran one rank or trained with Adam
(issue 44). Here two ranks check, where they compute them (tests/support/ranks.py):

- the gradients of one backward (each rank's half of the batch, loss averaged over it, the
  gradient averaged over ranks as DDP and FSDP do) against one process's on the whole batch,
  a group alone and a unit's groups reduced in one collective (the order learned);
- parameters after SGD, whose update scales with the gradient, and after Adam;
- each rank's rows of every parameter, after each way a value reaches them (``shard``,
  ``load_full_state_dict``, ``load_state_dict(assign=True)``, writes inside
  ``full_parameters``, a checkpoint), for shapes whose rows split evenly over the ranks and
  shapes whose rows do not (a rank's last chunk shorter, or empty).

One spawn of two ranks runs both rank functions: a few seconds.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracedac.zero as zero
from tracedac.zero.layout import Slice

from ..support import zero_model as zm
from ..support.ranks import check, run_parts, together
from ..support.zero_logs import CheckLog

# --- gradients and updates ----------------------------------------------------------------------


def _close(got: dict, want: dict, what: str) -> None:
    assert list(got) == list(want), (what, list(got), list(want))
    for k in want:
        torch.testing.assert_close(
            got[k], want[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{what} {k}: {m}"
        )


def _grads(m) -> dict:
    """Every trainable parameter's full gradient by name (a DTensor's gathered)."""
    return {
        n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        for n, p in m.named_parameters()
        if p.grad is not None
    }


def _backward(m, x, y) -> dict:
    for p in m.parameters():
        p.grad = None
    F.mse_loss(m(x), y).backward()
    return _grads(m)


def _joint(mine) -> tuple:
    """Two backwards of a model sharded with three groups a unit ("auto" without autocast: every
    group fp32, one per module class), whose gradients reduce in one collective a unit once the
    first backward has taught their order: both gradients, and whether the second's groups went
    together (fewer reduce-scatters sent than groups reduced)."""
    m = zero.shard(zm.model(), mixed_precision=zero.MixedPrecision("auto"))
    first = _backward(m, *mine)
    log = CheckLog()
    try:
        second = _backward(m, *mine)
    finally:
        log.close()
    return (
        first,
        second,
        log.counted["sent reduce-scatter"] < log.counted["reduce-scatter"],
        dict(log.counted),
    )


def _trained(opt, rank, world) -> tuple[dict, dict]:
    """Two steps of ``opt``: one process on the whole batch, and the sharded model here."""
    ref = zm.model()
    zm.train(ref, 0, 1, steps=2, opt_cls=opt)
    m = zero.shard(zm.model())
    zm.train(m, rank, world, steps=2, opt_cls=opt)
    return ref.state_dict(), zero.full_state_dict(m)


def gradients(rank, world):
    """Checks "one backward" (each group reduce-scattered alone, as before any order is
    learned), "joint backward" (a unit's groups reduced in one collective), "sgd" and "adam"
    (two steps' parameters). Each step runs ``together``: a rank that fails it fails that check
    alone, on every rank."""
    x, y = zm.data(0)
    want = _backward(zm.model(), x, y)  # one process, the whole batch
    mine = zm.rank_batch(0, rank, world)

    with check("one backward"):
        got = together(lambda: _backward(zero.shard(zm.model()), *mine))
        _close(got, want, "gradient")

    with check("joint backward"):
        first, second, joint, counted = together(_joint, mine)
        _close(first, want, "first gradient")
        _close(second, want, "gradient reduced with its unit's")
        assert joint, counted  # the unit's groups went in one reduce-scatter

    for name, opt in (("sgd", torch.optim.SGD), ("adam", torch.optim.Adam)):
        with check(name):
            ref, got = together(_trained, opt, rank, world)
            _close(got, ref, f"{name}: parameter after two steps")


# --- rows ----------------------------------------------------------------------------------------


SHAPES = {
    "even": {"a": (8, 3), "b": (4, 2), "c": (6,)},  # every rank the same number of rows
    "uneven": {"a": (7, 3), "b": (1, 3), "c": (5,)},  # 4 and 3 rows, 1 and none, 3 and 2
}


class Rows(nn.Module):
    """One parameter per shape of ``SHAPES[split]``."""

    def __init__(self, split: str):
        super().__init__()
        for name, shape in SHAPES[split].items():
            self.register_parameter(name, nn.Parameter(torch.zeros(shape)))


def _values(split: str, seed: int) -> dict:
    """A full value for every parameter, each element different (a wrong row shows)."""
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=g) for n, shape in SHAPES[split].items()}


def _by_shard(split, values, tmp):
    m = Rows(split)
    m.load_state_dict(values)
    return zero.shard(m)


def _by_load_full_state_dict(split, values, tmp):
    m = zero.shard(Rows(split))
    zero.load_full_state_dict(m, values)
    return m


def _by_load_state_dict(split, values, tmp):
    m = zero.shard(Rows(split))
    m.load_state_dict(values, assign=True)
    return m


def _by_full_parameters(split, values, tmp):
    m = zero.shard(Rows(split))
    with zero.full_parameters(m), torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(values[name])
    return m


def _by_checkpoint(split, values, tmp):
    saved = zero.shard(Rows(split))
    zero.load_full_state_dict(saved, values)
    zero.save_checkpoint(f"{tmp}/{split}", saved)
    m = zero.shard(Rows(split))
    zero.load_checkpoint(f"{tmp}/{split}", m)
    return m


PATHS = {
    "shard": _by_shard,
    "load_full_state_dict": _by_load_full_state_dict,
    "load_state_dict": _by_load_state_dict,
    "full_parameters": _by_full_parameters,
    "checkpoint": _by_checkpoint,
}


def rows(rank, world, tmp):
    """Check "<path> <split>" for each way a value reaches the ranks' rows and each split of
    ``SHAPES``: this rank holds ``torch.chunk``'s piece of each value (none past the last
    piece), and the ranks' rows gathered are the value."""
    for seed, (path, load) in enumerate(PATHS.items()):
        for split in SHAPES:
            values = _values(split, seed)
            with check(f"{path} {split}"):
                # a load that crashes on one rank (rows that do not fit) fails this check alone,
                # on every rank: no rank goes on to the gather below without the others
                m = together(load, split, values, tmp)
                full = zero.full_state_dict(m)  # a collective: before any assert
                for name, p in m.named_parameters():
                    chunks = values[name].chunk(world)
                    want = chunks[rank] if rank < len(chunks) else values[name][:0]
                    got = p.to_local()
                    assert got.shape == want.shape, (name, tuple(got.shape), tuple(want.shape))
                    assert torch.equal(got, want), (name, got, want)
                    assert torch.equal(full[name], values[name]), name


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_parts(2, [(gradients,), (rows, str(tmp_path_factory.mktemp("rows")))], timeout=180)


def test_one_backward_on_two_ranks_gives_the_gradient_of_one_process(two_ranks):
    """Each rank's half of the batch, gradients averaged by the reduce-scatter: one process's
    gradient on the whole batch (to float rounding). Without the division by the world size it
    is twice that; divided twice, half."""
    two_ranks.passed("one backward")


def test_a_units_groups_reduced_in_one_collective_give_the_gradient_of_one_process(two_ranks):
    """The joint reduce-scatter of a unit's groups (from the second backward on) divides too."""
    two_ranks.passed("joint backward")


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_two_ranks_train_with_sgd_and_adam_to_the_parameters_of_one_process(two_ranks, optimizer):
    """SGD's update is the gradient scaled: a gradient off by any factor moves the parameters
    off. Adam's barely shows it (it divides by the gradient's own scale), which is why it does
    not stand alone."""
    two_ranks.passed(optimizer)


@pytest.mark.parametrize("split", SHAPES)
@pytest.mark.parametrize("path", PATHS)
def test_each_rank_holds_its_own_rows_of_even_and_uneven_parameters(two_ranks, path, split):
    """Rows for the wrong rank are silent where every rank holds as many rows ("even"), and a
    crash only where they do not ("uneven": 7 rows, 1 row, 5 elements): both are checked, row
    by row, on each rank."""
    two_ranks.passed(f"{path} {split}")


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("shape", [(8, 3), (7, 3), (1, 3), (5,), (3, 2, 2)])
def test_a_slices_rows_of_each_rank_are_torch_chunks_piece(world, shape):
    """``Slice.rows_of`` and ``local_shape``: what every load path copies into a rank's buffer.
    Rank ``r`` of ``world`` holds ``torch.chunk``'s piece ``r`` (DTensor's ``Shard(0)``), or
    no row past the last piece; the pieces of all ranks are the value."""
    value = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
    chunks = value.chunk(world)
    pieces = []
    for rank in range(world):
        s = Slice("p", torch.Size(shape), world, rank, 0)
        got = s.rows_of(value, rank, world)
        want = chunks[rank] if rank < len(chunks) else value[:0]
        assert got.shape == want.shape == s.local_shape, (rank, got.shape, want.shape, s.local_shape)
        assert torch.equal(got, want), rank
        pieces.append(got)
    assert torch.equal(torch.cat(pieces), value)
