"""transformers models sharded by ``tracedac.zero`` (ZeRO-3) and checkpointed by ``hf.enable``,
on 2 gloo ranks, against the same model unsharded and uncheckpointed in one process. Programs
nobody here wrote: rotary buffers, tied embeddings, an MoE's routing, transformers' own
checkpointing switch on a model whose parameters are DTensors.

Each rank trains the tiny model (tests/support/hf_models.py) on its half of every batch with
SGD, whose update is the gradient scaled, so the parameters show the gradients without an
optimizer's amplification of the last bits. The oracle, ``reference`` (computed by each rank):
the same model, unsharded and uncheckpointed, in one process, on the mean of the ranks'
losses. The rank function checks each case (tests/support/ranks.py).
"""

import pytest
import torch
import torch._dynamo
import torch.distributed as dist

import tracedac.zero as zero
from tracedac.integrations import hf

from ..support.hf_models import batch, build, needs_switch
from ..support.hf_models import loss as lm_loss
from ..support.ranks import check, run_parts

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.slow, needs_switch]

STEPS, ROWS, LR = 3, 4, 0.1

# (architecture, tied input and output embeddings, shard before enable, compiled)
CASES = (
    ("llama", False, True, False),
    ("llama", True, False, False),  # the tied weight: one parameter under two names, in one unit
    ("mixtral", False, True, False),
    ("llama", False, True, True),
)


def model(kind: str, tied: bool):
    m = build(kind)
    if tied:
        m.config.tie_word_embeddings = True
        m.tie_weights()
    return m


def data(step: int, rank: int, world: int) -> dict:
    per = ROWS // world
    return {k: v[rank * per : (rank + 1) * per] for k, v in batch(ROWS, 16, seed=10 + step).items()}


def reference(kind: str, tied: bool, world: int) -> dict:
    m = model(kind, tied)
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        loss = sum(lm_loss(m, data(step, r, world)) for r in range(world)) / world
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in m.state_dict().items()}}


def train(rank, world, kind, tied, shard_first, compiled) -> dict:
    """Three SGD steps of the case: the losses of the whole batch and the full state dict."""
    m = model(kind, tied)
    if shard_first:
        zero.shard(m)
        hf.enable(m)
    else:
        hf.enable(m)
        zero.shard(m)
    call = torch.compile(m, backend="aot_eager_decomp_partition") if compiled else m
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        loss = lm_loss(call, data(step, rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return {"losses": losses, "state": zero.full_state_dict(call)}


def case_id(case) -> str:
    kind, tied, shard_first, compiled = case
    return (
        f"{kind}{'-tied' if tied else ''}-{'shard-then-enable' if shard_first else 'enable-then-shard'}"
        + ("-compiled" if compiled else "")
    )


def every_case(rank, world):
    """Each case against the reference: the loss of the whole batch and every entry of the full
    state dict (check "<case>")."""
    for case in CASES:
        torch._dynamo.reset()
        got = train(rank, world, *case)
        kind, tied, _, compiled = case
        want = reference(kind, tied, world)
        tol = 1e-6 if compiled else 1e-7
        with check(case_id(case)):
            diff = max(abs(a - b) for a, b in zip(got["losses"], want["losses"], strict=True))
            assert diff <= 10 * tol, (got["losses"], want["losses"])
            assert got["state"].keys() == want["state"].keys(), got["state"].keys() ^ want["state"].keys()
            for key, value in want["state"].items():
                assert torch.allclose(got["state"][key], value, rtol=0, atol=tol), key


@pytest.fixture(scope="module")
def ranks():
    return run_parts(2, [(every_case,)], timeout=400)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_a_sharded_checkpointed_hf_model_trains_as_the_unsharded_one(ranks, case):
    """Three SGD steps: the loss of the whole batch and every entry of the full state dict
    (the model's keys, a tied weight once under each name) equal the unsharded model's; eager
    within float32's last bits of a two-rank reduction, compiled within what decompositions
    move (the model compiled without tracedac moves as much)."""
    ranks.passed(case_id(case))
