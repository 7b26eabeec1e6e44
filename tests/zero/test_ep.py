"""Zero and expert parallelism composed (issue 29, item 4), on 2 gloo ranks.

An MoE model whose dense parts (embedding, norms, routers, head) are sharded by
``zero.shard`` over every rank while its experts are expert-parallel: ``E`` experts, each
held by one rank (``E // world`` per rank, in a ``ModuleDict`` keyed by the expert's global
index, so a checkpoint names every expert once, from the rank that holds it). Tokens go to
their expert's rank with ``all_to_all_single_autograd`` (uneven splits, different on every
rank) and come back the same way. The experts are sharded by ``zero.shard`` too, each rank's
over a process group of its own (their sub-mesh: one rank, as torchtitan's
``dp_shard_mod_ep`` is when expert and data parallel span the same ranks), before the model
is: the model's ``shard`` takes what they did not. Every block is a tracedac region: AdamW
training equals one process holding every expert, the routers' counts happen once, and a DCP
checkpoint resumes exactly.

The oracle (``reference``, computed by each rank): the same model with all experts in one
process, unsharded, uncheckpointed, on the whole batch. The rank function checks what it
computes (tests/support/ranks.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed import _functional_collectives as fc

import tracedac
import tracedac.zero as zero

from ..support.ranks import check, run_parts

pytestmark = pytest.mark.slow  # the quick loop (pytest -m "not slow") leaves this file out

D, H, E = 16, 24, 4  # width, expert hidden, experts (E divides by the world sizes used: 1, 2)
BATCH, STEPS, SAVE_AFTER = 16, 3, 2  # global batch; AdamW steps; the checkpoint's step


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, D)

    def forward(self, x):  # [n, D]
        return self.down(F.gelu(self.up(x)))


class Experts(nn.ModuleDict):
    """The experts this rank holds, keyed by global index from ``first``."""

    def __init__(self, first: int, count: int):
        super().__init__({str(first + i): Expert() for i in range(count)})
        self.first = first

    def forward(self, tokens, ids):  # [n, D], [n]: each token with its expert's global index
        order = ids.argsort(stable=True)
        counts = torch.bincount(ids - self.first, minlength=len(self)).tolist()
        outs = [expert(chunk) for expert, chunk in zip(self.values(), tokens[order].split(counts))]
        return torch.zeros_like(tokens).index_copy(0, order, torch.cat(outs))


class MoE(nn.Module):
    """Top-1 routing to ``E`` experts spread over ``world`` ranks (``group``'s); counts its
    tokens per expert (a router side effect: once per step)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.router = nn.Linear(D, E, bias=False)
        self.experts = Experts(0, E)
        # per-rank counts (each rank's own tokens): not in the checkpoint, as torchtitan's
        self.register_buffer("tokens_per_expert", torch.zeros(E, dtype=torch.long), persistent=False)
        self.group, self.world = None, 1

    def localize(self, group) -> None:
        """Keep only this rank's experts; route over ``group``."""
        self.group, self.world = group, dist.get_world_size(group)
        per, rank = E // self.world, dist.get_rank(group)
        kept = Experts(rank * per, per)
        for key in kept:
            kept[key] = self.experts[key]
        self.experts = kept

    def forward(self, x):  # [T, D]
        h = self.norm(x)
        weight, expert = self.router(h).softmax(-1).max(-1)  # [T], [T]
        self.tokens_per_expert.add_(torch.bincount(expert, minlength=E))
        order = expert.argsort(stable=True)
        ids, tokens = expert[order], h[order]  # grouped by expert, so by destination rank
        if self.world > 1:
            send = torch.bincount(ids // (E // self.world), minlength=self.world)
            recv = fc.all_to_all_single(send, None, None, self.group)
            send, recv = send.tolist(), recv.tolist()  # uneven, and not the same on every rank
            tokens = fc.all_to_all_single_autograd(tokens, recv, send, self.group)
            ids = fc.all_to_all_single(ids, recv, send, self.group)
        out = self.experts(tokens, ids)
        if self.world > 1:
            out = fc.all_to_all_single_autograd(out, send, recv, self.group)
        y = torch.zeros_like(out).index_copy(0, order, out)
        return x + y * weight.unsqueeze(-1)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.moe = MoE()
        self.norm = nn.LayerNorm(D)
        self.mlp = nn.Linear(D, D)

    def forward(self, x):
        x = self.moe(x)
        return x + self.mlp(self.norm(x))


class Model(nn.Module):
    def __init__(self, n=2):
        super().__init__()
        self.embed = nn.Linear(D, D)
        self.blocks = nn.ModuleList(Block() for _ in range(n))
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h).squeeze(-1)

    def experts(self) -> list[nn.Parameter]:
        return [p for b in self.blocks for p in b.moe.experts.parameters()]


def seeded() -> Model:
    torch.manual_seed(0)
    return Model()


def batch(step):
    g = torch.Generator().manual_seed(11 + step)
    return torch.randn(BATCH, D, generator=g), torch.randn(BATCH, generator=g)


def rank_batch(step, rank, world):
    per = BATCH // world
    return tuple(t[rank * per : (rank + 1) * per] for t in batch(step))


def optimizer(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def counts(model) -> list[list[int]]:
    return [b.moe.tokens_per_expert.tolist() for b in model.blocks]


def reference() -> dict:
    """The oracle: losses, token counts and final parameters of the unsharded model (every
    expert in this process), uncheckpointed, on the whole batch."""
    model = seeded()
    opt = optimizer(model)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    return {"losses": losses, "counts": counts(model), "params": params}


def build(rank, world, policy):
    """The EP model on this rank: experts kept and sharded over their one-rank group, the rest
    over the world, every block a tracedac region under ``policy``."""
    own = [dist.new_group([r]) for r in range(world)][rank]  # every rank makes every group
    model = seeded()
    for b in model.blocks:
        b.moe.localize(dist.group.WORLD)
        zero.shard(b.moe.experts, group=own)  # the experts' sub-mesh: this rank alone
    zero.shard(model)  # the dense parts, over every rank
    tracedac.wrap(model, Block, policy=policy)
    return model


def step(model, opt, rank, world, step_index) -> float:
    """One AdamW step on this rank's slice; returns the loss of the whole batch."""
    x, y = rank_batch(step_index, rank, world)
    loss = F.mse_loss(model(x), y)
    loss.backward()
    # zero's reduce-scatter averages the dense gradients over the ranks. An expert's gradient
    # already sums every rank's tokens (they came to it), and its group of one averages over
    # one: divide by the data-parallel ranks, as torchtitan's gradient_divide_factor does.
    with torch.no_grad():
        for p in model.experts():
            p.grad.div_(world)
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / world


POLICIES = {
    "recompute_all": tracedac.policies.recompute_all,
    "memory_budget(0.5)": lambda: tracedac.policies.memory_budget(0.5),
}


def _full(model) -> dict:
    """Every parameter this rank holds, as full tensors under the model's keys."""
    return {k: v.full_tensor().clone() for k, v in model.named_parameters()}


def train(rank, world, path):
    """Per policy: ``STEPS`` steps against the reference (checks "<policy> losses", "<policy>
    params": each rank its own experts and the shared parameters, "<policy> counts": the
    routers' counts summed over ranks), then the steps after ``SAVE_AFTER`` resumed from a DCP
    checkpoint saved there, into a freshly built model and optimizer ("<policy> resumed")."""
    ref = reference()
    for name, policy in POLICIES.items():
        model = build(rank, world, policy())
        opt = optimizer(model)
        losses = []
        for i in range(STEPS):
            losses.append(step(model, opt, rank, world, i))
            if i + 1 == SAVE_AFTER:
                zero.save_checkpoint(f"{path}/{name}", model, opt)
        summed = torch.tensor(counts(model))
        dist.all_reduce(summed)
        resumed_model = build(rank, world, policy())
        resumed_opt = optimizer(resumed_model)
        # each rank holds only its experts, and the checkpoint every rank's
        zero.load_checkpoint(f"{path}/{name}", resumed_model, resumed_opt)
        resumed = [step(resumed_model, resumed_opt, rank, world, i) for i in range(SAVE_AFTER, STEPS)]
        params, resumed_params = _full(model), _full(resumed_model)
        experts = sorted(
            {k.split(".experts.")[1].split(".")[0] for k in model.state_dict() if ".experts." in k}
        )
        held = [None] * world
        dist.all_gather_object(held, (experts, sorted(params)))
        with check(f"{name} losses"):
            assert len(losses) == STEPS, losses
            assert max(abs(a - b) for a, b in zip(losses, ref["losses"])) <= 1e-5, (losses, ref["losses"])
        with check(f"{name} params"):
            assert [e for e, _ in held] == [["0", "1"], ["2", "3"]], held
            for key, value in params.items():
                assert (value - ref["params"][key]).abs().max() <= 1e-5, key
            every = {k for _, keys in held for k in keys}
            assert every == set(ref["params"]), every ^ set(ref["params"])
        with check(f"{name} counts"):
            assert summed.tolist() == ref["counts"], (summed.tolist(), ref["counts"])
        with check(f"{name} resumed"):
            assert resumed == losses[SAVE_AFTER:], (resumed, losses)
            for key, value in resumed_params.items():
                assert value.equal(params[key]), key


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return tmp_path_factory.mktemp("ep")


@pytest.fixture(scope="module")
def ranks(saved):
    return run_parts(2, [(train, str(saved))], timeout=120)


@pytest.mark.parametrize("policy", POLICIES)
def test_losses_equal_one_process_holding_every_expert(ranks, policy):
    """Dense gradients averaged by zero's reduce-scatter, experts' summed over the ranks whose
    tokens reached them and divided by the data-parallel size: the same updates as one process."""
    ranks.passed(f"{policy} losses")


@pytest.mark.parametrize("policy", POLICIES)
def test_each_rank_trains_its_own_experts_and_the_shared_parameters_to_the_reference(ranks, policy):
    """Rank 0 holds experts 0 and 1 of every block, rank 1 experts 2 and 3; together they are
    the reference's parameters after the last step."""
    ranks.passed(f"{policy} params")


@pytest.mark.parametrize("policy", POLICIES)
def test_the_routers_count_each_token_once(ranks, policy):
    """The count is a side effect of the region's forward: a checkpoint that re-ran the block
    would count every token twice."""
    ranks.passed(f"{policy} counts")


@pytest.mark.parametrize("policy", POLICIES)
def test_a_dcp_checkpoint_names_every_expert_once_and_resumes_exactly(ranks, saved, policy):
    """Each expert is saved by the rank that holds it; a fresh model and optimizer loaded from
    the checkpoint take the same step the uninterrupted run took, to the bit."""
    ranks.passed(f"{policy} resumed")
    keys = dcp.FileSystemReader(str(saved / policy)).read_metadata().state_dict_metadata
    experts = {
        k.split(".experts.")[1].split(".")[0] for k in keys if k.startswith("model.") and ".experts." in k
    }
    assert experts == {"0", "1", "2", "3"}
