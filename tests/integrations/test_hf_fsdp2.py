"""Hugging Face's ``Trainer`` with FSDP2 (accelerate's FSDP2 plugin) and ``hf.enable``, on 2
gloo ranks: a tiny Llama trained three steps, against the same Trainer without checkpointing.

transformers (5.23 on) checkpoints a layer's ``forward``, not its ``__call__``, so FSDP2's
hooks (the all-gather before the layer, the free after it) stay outside the checkpoint, and
tracedac's region sees the gathered parameters as inputs, as with ``tracedac.checkpoint``
applied before ``fully_shard``.

The Trainer with FSDP2 (``fsdp=True``, ``fsdp_config={"version": 2}``: accelerate's FSDP2
plugin, which ``fully_shard``s each decoder layer, then the model). On CPU, accelerate (1.16)
keeps its FSDP plugin only for accelerator devices: with ``use_cpu=True`` or no GPU,
``AcceleratorState`` is ``MULTI_CPU`` and the plugin is dropped, so the Trainer wraps the
model in DDP, silently. ``CpuFsdpTrainer`` puts the plugin the Trainer built from its
arguments back on the accelerator's state, as accelerate sets it on a GPU; from there the
Trainer's own FSDP2 path runs (``accelerator.prepare`` -> ``fsdp2_prepare_model``), on gloo.

Each rank trains three SGD steps and checks, against the same Trainer without
checkpointing: the training loss and every full parameter bit for bit, each layer's Python
once a step, the regions recorded (named by layer) and the all-gathers as many
(tests/support/ranks.py).
"""

from __future__ import annotations

import os

import pytest
import torch

from ..support.collectives import CollectiveOps
from ..support.hf_models import batch, build, needs_switch
from ..support.ranks import check, run_parts

pytest.importorskip("accelerate", reason="the Trainer's FSDP2 runs through accelerate")
pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.slow, needs_switch]

STEPS = 3


def _trainer_class():
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from transformers import Trainer

    class CpuFsdpTrainer(Trainer):
        """The Trainer, with accelerate's FSDP plugin kept on CPU (see the module's docstring)."""

        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            if self.args.fsdp_plugin_args is not None and self.accelerator.device.type == "cpu":
                state = self.accelerator.state
                state.distributed_type = DistributedType.FSDP
                state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
                self.is_fsdp_enabled = True

    return CpuFsdpTrainer


def train(rank: int, world: int, tmp: str, *, enable: bool, trainer_ac: bool, fsdp_ac: bool, reshard: bool):
    """Three steps of the Trainer with FSDP2. ``enable``: ``hf.enable(model)`` first;
    ``trainer_ac``: ``TrainingArguments(activation_checkpointing=True)`` (the Trainer calls
    the model's ``activation_checkpointing_enable``); ``fsdp_ac``: ``fsdp_config``'s
    ``activation_checkpointing`` (accelerate wraps each layer in torch's
    ``checkpoint_wrapper``). Returns the loss, full parameters, each layer's calls, the
    regions recorded and the all-gathers counted."""
    from accelerate.state import AcceleratorState
    from transformers import TrainingArguments

    from tracedac.integrations import hf
    from tracedac.region import reporting

    # what torchrun sets, read by accelerate (the process group itself is already up)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world)
    )
    AcceleratorState._reset_state(reset_partial_state=True)  # each run builds its own
    model = build("llama")
    calls = [0] * len(model.model.layers)
    for i, layer in enumerate(model.model.layers):
        layer.mlp.register_forward_pre_hook(lambda m, a, i=i: calls.__setitem__(i, calls[i] + 1))
    if enable:
        hf.enable(model)
    args = TrainingArguments(
        output_dir=os.path.join(tmp, f"out{rank}"),
        activation_checkpointing=trainer_ac,
        fsdp=True,
        fsdp_config={"version": 2, "reshard_after_forward": reshard, "activation_checkpointing": fsdp_ac},
        max_steps=STEPS,
        per_device_train_batch_size=2,
        learning_rate=0.1,
        optim="sgd",
        lr_scheduler_type="constant",
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        dataloader_drop_last=True,
    )
    data = [{k: v[0] for k, v in batch(1, 16, seed=s).items()} for s in range(2 * world * STEPS)]
    trainer = _trainer_class()(model=model, args=args, train_dataset=data)
    with reporting() as regions, CollectiveOps() as collectives:
        loss = trainer.train().training_loss
    sharded = trainer.model
    assert type(sharded).__name__ == "FSDPLlamaForCausalLM", type(sharded)
    params = {
        n.replace("._checkpoint_wrapped_module", ""): p.full_tensor().detach().clone()
        for n, p in sharded.named_parameters()
    }
    return {
        "loss": loss,
        "params": params,
        "calls": calls,
        "regions": sorted({r.graph.name for r in regions}),
        "recorded": len(regions),
        "all_gathers": collectives.ops["c10d._allgather_base_"],
    }


def every_case(rank: int, world: int, tmp: str) -> None:
    """Each way to switch tracedac on under FSDP2 against the same Trainer without
    checkpointing (check "<case>, reshard_after_forward=<r>"); torch's checkpoint (transformers'
    own) beside it, which runs each layer's Python twice a step and records no region."""
    for reshard in (True, False):
        plain = train(rank, world, tmp, enable=False, trainer_ac=False, fsdp_ac=False, reshard=reshard)
        cases = {"tracedac": dict(enable=True, trainer_ac=True, fsdp_ac=False)}
        if reshard:
            # hf.enable, and accelerate's checkpoint_wrapper around each layer as well
            cases["tracedac inside fsdp_config's checkpointing"] = dict(
                enable=True, trainer_ac=False, fsdp_ac=True
            )
            cases["torch"] = dict(enable=False, trainer_ac=True, fsdp_ac=False)
        for name, how in cases.items():
            got = train(rank, world, tmp, reshard=reshard, **how)
            key = f"{name}, reshard_after_forward={reshard}"
            with check(key):
                different = [n for n, p in got["params"].items() if not torch.equal(p, plain["params"][n])]
                assert sorted(got["params"]) == sorted(plain["params"]), key
                assert not different and got["loss"] == plain["loss"], (
                    key,
                    different,
                    got["loss"],
                    plain["loss"],
                )
                if name == "torch":
                    assert got["calls"] == [2 * STEPS, 2 * STEPS], (key, got["calls"])
                    assert got["regions"] == [], (key, got["regions"])
                    continue
                assert got["calls"] == plain["calls"] == [STEPS, STEPS], (key, got["calls"])
                assert got["regions"] == ["model.layers.0", "model.layers.1"], (key, got["regions"])
                assert got["recorded"] == 2 * STEPS, (key, got["recorded"])
                assert got["all_gathers"] == plain["all_gathers"] > 0, (
                    key,
                    got["all_gathers"],
                    plain["all_gathers"],
                )


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("hf_fsdp2"))
    return run_parts(2, [(every_case, tmp)], timeout=600)


@pytest.mark.parametrize("reshard", [True, False], ids=lambda r: f"reshard_after_forward={r}")
def test_trainer_with_fsdp2_and_hf_enable_trains_as_without_checkpointing_running_each_layer_once(
    ranks, reshard
):
    """``hf.enable(model)`` then ``TrainingArguments(activation_checkpointing=True, fsdp=True,
    fsdp_config={"version": 2})``: the loss and every parameter after three steps bit for bit
    those of no checkpointing, each layer's Python once a step, a region per layer and step
    (named by layer), and the Trainer's all-gathers as many (the warning transformers prints
    about a redundant all-gather is about torch's checkpoint around the layer's hooks)."""
    ranks.passed(f"tracedac, reshard_after_forward={reshard}")


def test_hf_enable_inside_fsdp_configs_own_checkpointing_runs_each_layer_once(ranks):
    """With accelerate's ``fsdp_config["activation_checkpointing"]`` too (torch's
    ``checkpoint_wrapper`` around each layer), the tracedac region inside takes every tensor
    autograd saves: torch's checkpoint has nothing to recompute and never runs the layer again."""
    ranks.passed("tracedac inside fsdp_config's checkpointing, reshard_after_forward=True")


def test_torchs_checkpoint_under_the_same_trainer_runs_each_layer_twice(ranks):
    """What the counts above would read without tracedac: transformers' own checkpointing
    (torch's) runs each layer's Python again in backward."""
    ranks.passed("torch, reshard_after_forward=True")
