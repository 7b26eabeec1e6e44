"""transformers models sharded by ``tracedac.zero`` (ZeRO-3) and checkpointed by ``hf.enable``,
on 2 gloo ranks, against the same model unsharded and uncheckpointed in one process (the
worker: ``hf_zero_workers``). Programs nobody here wrote: rotary buffers, tied embeddings, an
MoE's routing, transformers' own checkpointing switch on a model whose parameters are DTensors.
"""

import pytest
import torch

from ..support.hf_models import needs_switch
from ..zero.spawn import run_ranks
from . import hf_zero_workers as hw

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.slow, needs_switch]


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(hw.every_case, 2, timeout=400)


@pytest.mark.parametrize(
    "case",
    hw.CASES,
    ids=lambda c: (
        f"{c[0]}{'-tied' if c[1] else ''}-{'shard-then-enable' if c[2] else 'enable-then-shard'}"
        + ("-compiled" if c[3] else "")
    ),
)
def test_a_sharded_checkpointed_hf_model_trains_as_the_unsharded_one(ranks, case):
    """Three SGD steps: the loss of the whole batch and every entry of the full state dict
    (the model's keys, a tied weight once under each name) equal the unsharded model's; eager
    within float32's last bits of a two-rank reduction, compiled within what decompositions
    move (the model compiled without tracedac moves as much)."""
    kind, tied, _, compiled = case
    want = hw.reference(kind, tied, 2)
    tol = 1e-6 if compiled else 1e-7
    for r in ranks:
        got = r[case]
        assert max(abs(a - b) for a, b in zip(got["losses"], want["losses"], strict=True)) <= 10 * tol
        assert got["state"].keys() == want["state"].keys()
        for key, value in want["state"].items():
            assert torch.allclose(got["state"][key], value, rtol=0, atol=tol), key
