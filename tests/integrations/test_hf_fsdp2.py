"""Hugging Face's ``Trainer`` with FSDP2 (accelerate's FSDP2 plugin) and ``hf.enable``, on 2
gloo ranks: a tiny Llama trained three steps, against the same Trainer without checkpointing
(the worker: ``hf_fsdp2_workers``, which asserts on each rank).

transformers (5.23 on) checkpoints a layer's ``forward``, not its ``__call__``, so FSDP2's
hooks (the all-gather before the layer, the free after it) stay outside the checkpoint, and
tracedac's region sees the gathered parameters as inputs, as with ``tracedac.checkpoint``
applied before ``fully_shard``.
"""

import pytest

from ..support.hf_models import needs_switch
from ..zero.spawn import run_ranks
from . import hf_fsdp2_workers as hw

pytest.importorskip("accelerate", reason="the Trainer's FSDP2 runs through accelerate")
pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.slow, needs_switch]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("hf_fsdp2"))
    return run_ranks(hw.every_case, 2, tmp, timeout=600)


def case(ranks, name):
    return [r[name] for r in ranks]


@pytest.mark.parametrize("reshard", [True, False], ids=lambda r: f"reshard_after_forward={r}")
def test_trainer_with_fsdp2_and_hf_enable_trains_as_without_checkpointing_running_each_layer_once(
    ranks, reshard
):
    """``hf.enable(model)`` then ``TrainingArguments(activation_checkpointing=True, fsdp=True,
    fsdp_config={"version": 2})``: the loss and every parameter after three steps bit for bit
    those of no checkpointing, each layer's Python once a step, a region per layer and step
    (named by layer), and the Trainer's all-gathers as many (the warning transformers prints
    about a redundant all-gather is about torch's checkpoint around the layer's hooks)."""
    for r in case(ranks, f"tracedac, reshard_after_forward={reshard}"):
        assert r["calls"] == [hw.STEPS, hw.STEPS] and r["recorded"] == 2 * hw.STEPS, r
        assert r["loss"] == r["plain"]["loss"]
        assert r["all_gathers"] == r["plain"]["all_gathers"]


def test_hf_enable_inside_fsdp_configs_own_checkpointing_runs_each_layer_once(ranks):
    """With accelerate's ``fsdp_config["activation_checkpointing"]`` too (torch's
    ``checkpoint_wrapper`` around each layer), the tracedac region inside takes every tensor
    autograd saves: torch's checkpoint has nothing to recompute and never runs the layer again."""
    for r in case(ranks, "tracedac inside fsdp_config's checkpointing, reshard_after_forward=True"):
        assert r["calls"] == [hw.STEPS, hw.STEPS] and r["recorded"] == 2 * hw.STEPS, r


def test_torchs_checkpoint_under_the_same_trainer_runs_each_layer_twice(ranks):
    """What the counts above would read without tracedac: transformers' own checkpointing
    (torch's) runs each layer's Python again in backward."""
    for r in case(ranks, "torch, reshard_after_forward=True"):
        assert r["calls"] == [2 * hw.STEPS, 2 * hw.STEPS], r
        assert r["regions"] == [], r
