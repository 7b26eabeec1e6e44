"""Zero and expert parallelism composed (issue 29, item 4), on 2 gloo ranks.

The dense parts of an MoE model sharded over both ranks by ``zero.shard``, its experts
expert-parallel (each rank holds two of four, sharded over a group of their own), tokens sent
to their experts and back with uneven all-to-alls, every block a tracedac region: AdamW
training equals one process holding every expert, the routers' counts happen once, and a DCP
checkpoint resumes exactly (``ep_workers``).
"""

from __future__ import annotations

import pytest
import torch.distributed.checkpoint as dcp

from . import ep_workers as ew
from .spawn import run_ranks

pytestmark = pytest.mark.slow  # the quick loop (pytest -m "not slow") leaves this file out

POLICIES = tuple(ew.POLICIES)


@pytest.fixture(scope="module")
def reference():
    return ew.reference()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return tmp_path_factory.mktemp("ep")


@pytest.fixture(scope="module")
def ranks(saved):
    return run_ranks(ew.train, 2, str(saved), timeout=120)


@pytest.mark.parametrize("policy", POLICIES)
def test_losses_equal_one_process_holding_every_expert(ranks, reference, policy):
    """Dense gradients averaged by zero's reduce-scatter, experts' summed over the ranks whose
    tokens reached them and divided by the data-parallel size: the same updates as one process."""
    for r in ranks:
        losses = r[policy]["losses"]
        assert len(losses) == ew.STEPS
        assert max(abs(a - b) for a, b in zip(losses, reference["losses"])) <= 1e-5, (
            losses,
            reference["losses"],
        )


@pytest.mark.parametrize("policy", POLICIES)
def test_each_rank_trains_its_own_experts_and_the_shared_parameters_to_the_reference(
    ranks, reference, policy
):
    """Rank 0 holds experts 0 and 1 of every block, rank 1 experts 2 and 3; together they are
    the reference's parameters after the last step."""
    held = [r[policy]["experts"] for r in ranks]
    assert held == [["0", "1"], ["2", "3"]], held
    for r in ranks:
        params = r[policy]["params"]
        for key, value in params.items():
            assert (value - reference["params"][key]).abs().max() <= 1e-5, key
    every = set(ranks[0][policy]["params"]) | set(ranks[1][policy]["params"])
    assert every == set(reference["params"])


@pytest.mark.parametrize("policy", POLICIES)
def test_the_routers_count_each_token_once(ranks, reference, policy):
    """The count is a side effect of the region's forward: a checkpoint that re-ran the block
    would count every token twice."""
    for r in ranks:
        assert r[policy]["counts"] == reference["counts"]


@pytest.mark.parametrize("policy", POLICIES)
def test_a_dcp_checkpoint_names_every_expert_once_and_resumes_exactly(ranks, saved, policy):
    """Each expert is saved by the rank that holds it; a fresh model and optimizer loaded from
    the checkpoint take the same step the uninterrupted run took, to the bit."""
    keys = dcp.FileSystemReader(str(saved / policy)).read_metadata().state_dict_metadata
    experts = {
        k.split(".experts.")[1].split(".")[0] for k in keys if k.startswith("model.") and ".experts." in k
    }
    assert experts == {"0", "1", "2", "3"}
    for r in ranks:
        got = r[policy]
        assert got["resumed"] == got["losses"][ew.SAVE_AFTER :], (got["resumed"], got["losses"])
        for key, value in got["resumed_params"].items():
            assert value.equal(got["params"][key]), key
