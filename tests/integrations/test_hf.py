"""Hugging Face transformers under tracedac: real models from tiny configs, checked against
no checkpointing and against torch's checkpoint as transformers itself runs it."""

import ctypes
import gc
import re
import tracemalloc

import pytest
import torch

import tracedac
from tracedac import CheckpointError, policies
from tracedac.integrations import hf
from tracedac.policies.plan_cache import plans
from tracedac.region import current_region, reporting

from ..support.hf_models import ARCHITECTURES, batch, build, loss, needs_switch
from ..support.probe import allocated_bytes

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers' deprecated aliases


def grads(model, inputs):
    return torch.autograd.grad(loss(model, inputs), [p for p in model.parameters() if p.requires_grad])


_libc = ctypes.CDLL(None)
_libc.malloc.restype, _libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
_libc.free.argtypes = [ctypes.c_void_p]


def allocated() -> int:
    """The allocator's bytes in use, with glibc's per-thread cache of small freed chunks
    (counted as in use) filled first, so that it holds as much before as after a forward
    (without this the same forward reads up to a KiB apart from run to run)."""
    chunks = [_libc.malloc(n) for n in range(8, 1040, 8) for _ in range(8)]
    for c in chunks:
        _libc.free(c)
    return allocated_bytes()


def held_after_forward(model, inputs, repeat: int = 3) -> int:
    """Bytes the allocator holds after a forward, beyond what it held before (the loss and
    everything backward will read): the least of ``repeat`` forwards, as what else the
    process allocates meanwhile only adds."""
    loss(model, inputs)  # first calls allocate caches once: keep them out
    held = []
    for _ in range(repeat):
        # every pass until one finds nothing: an earlier test's garbage may free in stages (a
        # refused dynamo trace's did, over two passes), and a stage freed after ``before`` would
        # read as bytes this forward did not hold
        for _ in range(10):
            if not gc.collect():
                break
        before = allocated()
        out = loss(model, inputs)
        gc.collect()
        held.append(allocated() - before)
        del out
    return min(held)


@needs_switch
@pytest.mark.slow
@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_each_architecture_gives_torch_checkpoints_gradients_and_holds_its_bytes(kind):
    """Gradients bitwise equal to torch's checkpoint run by transformers (which is itself
    equal to no checkpointing up to float32 rounding: GPT-2's tied embedding and T5's shared
    one add their gradients in another order once backward runs by layer), and the bytes
    held after the forward at most torch's + 5 % (one-sided: in a whole-suite run torch's own
    reading once came out 70 KiB above its usual, 356 against 285 KiB, tracedac's at 285)."""
    model, inputs = build(kind), batch(4, 64)
    plain = grads(model, inputs)
    model.activation_checkpointing_enable()
    torch_grads, torch_held = grads(model, inputs), held_after_forward(model, inputs)
    hf.enable(model)
    got, held = grads(model, inputs), held_after_forward(model, inputs)
    for a, b, c in zip(got, torch_grads, plain, strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c)
    if kind in ("llama", "mixtral", "qwen2_moe", "bert"):
        assert all(torch.equal(a, c) for a, c in zip(got, plain))
    assert held <= 1.05 * torch_held, (held, torch_held)


@needs_switch
@pytest.mark.slow
def test_a_planner_under_hf_plans_once_per_layer_structure_and_python_memory_stays_flat():
    """transformers calls the checkpoint function with a new partial each step: the plan is
    found through it (both layers share one), and nothing accumulates step after step (the
    cache held every partial with its tensors: 602 plans in 301 steps, +628 KiB in 20)."""
    model, inputs = build("llama"), batch()
    hf.enable(model, policy=policies.memory_budget(0.3))
    made, entries = plans.made, len(plans.entries)
    for step in range(30):
        grads(model, inputs)
    tracemalloc.start()  # traced from step 30 on: tracing all 50 would double the test's time
    try:
        for step in range(20):
            grads(model, inputs)
            if step == 4:
                gc.collect()
                at_35 = tracemalloc.get_traced_memory()[0]
        gc.collect()
        growth = tracemalloc.get_traced_memory()[0] - at_35
    finally:
        tracemalloc.stop()
    assert plans.made == made + 1, "one plan for two layers of one structure"
    assert len(plans.entries) <= entries + 1
    # Python and torch still warm up this far in (a few KiB, with or without checkpointing)
    assert growth < 48 * 1024, f"Python memory grew {growth} bytes over 15 steps"
    hf.disable(model)
    plain = grads(model, inputs)
    hf.enable(model, policy=policies.memory_budget(0.3))
    assert all(torch.equal(a, b) for a, b in zip(grads(model, inputs), plain))


@needs_switch
def test_regions_carry_the_layers_qualified_name_in_reports_and_errors():
    model, inputs = build("llama"), batch()
    hf.enable(model, policy=policies.save_matmuls())
    with reporting() as regions:
        out = loss(model, inputs)
    assert [r.graph.name for r in regions] == ["model.layers.0", "model.layers.1"]
    report = tracedac.saved_report(model, **inputs)
    assert {r.region for r in report.rows} == {"model.layers.0", "model.layers.1"}
    assert any(r.module == "model.layers.1.self_attn.q_proj" for r in report.rows)
    hf.enable(model)  # recompute_all: backward replays from the weights
    out = loss(model, inputs)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight.mul_(2)
    with pytest.raises(
        CheckpointError, match=r"parameter 'model.layers.1.mlp.up_proj.weight'.*region 'model.layers.1'"
    ):
        out.backward()


@needs_switch
def test_disable_and_unwrap_put_back_every_flag_function_hook_and_attribute():
    """After ``disable`` the model is as before ``enable``: the same attributes on every
    module, no hook left (transformers' input-embedding hook included), state_dict keys
    unchanged, a plain forward, and transformers' own switch giving torch's checkpoint."""

    def state(model):
        return (
            [
                (
                    n,
                    sorted(m.__dict__),
                    m.__dict__.get("gradient_checkpointing"),
                    m.__dict__.get("_gradient_checkpointing_func"),
                    len(m._forward_hooks),
                    len(m._forward_pre_hooks),
                )
                for n, m in model.named_modules()
            ],
            list(model.state_dict()),
        )

    for before_enable in ("fresh", "torch checkpoint on"):
        model, inputs = build("llama"), batch()
        if before_enable == "torch checkpoint on":
            model.activation_checkpointing_enable()
        before = state(model)
        expected = grads(model, inputs)
        for undo in (hf.disable, tracedac.unwrap):
            hf.enable(model, policy=policies.min_cut())
            model.activation_checkpointing_enable()  # what Trainer does: tracedac stays
            assert isinstance(model.model.layers[0]._gradient_checkpointing_func, hf._Checkpointing)
            assert tracedac.is_checkpointed(model) and tracedac.is_checkpointed(model.model.layers[0])
            assert undo(model) is model
            assert state(model) == before
            assert not tracedac.is_checkpointed(model)
            with reporting() as regions:
                got = grads(model, inputs)
            assert regions == [] and all(torch.equal(a, b) for a, b in zip(got, expected))
    model.activation_checkpointing_enable()
    assert model.model.layers[0]._gradient_checkpointing_func.func is torch.utils.checkpoint.checkpoint
    with pytest.raises(CheckpointError, match="not checkpointed by tracedac"):
        hf.disable(model)


@pytest.mark.parametrize(
    "options, match",
    [
        ({"activation_checkpointing_kwargs": {"use_reentrant": True}}, "use_reentrant=True"),
        (
            {"activation_checkpointing_kwargs": {"context_fn": lambda: None}},
            "not a pair",
        ),
        (
            {"activation_checkpointing_kwargs": {"use_reentrant": False, "prserve_rng_state": True}},
            "prserve_rng_state",
        ),
    ],
)
@needs_switch
def test_options_tracedac_would_not_honour_are_refused_and_point_to_the_documented_way(options, match):
    """Each refusal names ``enable``/``disable``, never ``gradient_checkpointing_enable``,
    which would silently put torch's checkpoint back; and the refused call changes nothing."""
    model = build("llama")
    hf.enable(model)
    with pytest.raises(CheckpointError, match=match) as e:
        model.activation_checkpointing_enable(**options)
    assert "tracedac.integrations.hf.enable(model" in str(e.value)
    assert "gradient_checkpointing_enable(" not in str(e.value)
    assert isinstance(model.model.layers[0]._gradient_checkpointing_func, hf._Checkpointing)
    with pytest.raises(CheckpointError, match="use_reentrant=True"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(CheckpointError, match="tracedac.integrations.hf.enable"):
        tracedac.checkpoint_call(torch.sin, torch.ones(1, requires_grad=True), use_reentrant=True)


@needs_switch
@pytest.mark.parametrize("policy", [policies.save_matmuls(), policies.save_all()])
def test_offload_true_offloads_what_the_policy_keeps_with_the_same_gradients(policy):
    """transformers' ``offload=True`` (``save_on_cpu`` around torch's checkpoint) becomes
    ``offload_inputs(offload_kept(policy))`` for a policy that is no planner: what it would keep
    on the device goes to host memory instead, and so does each layer's input (what
    transformers' own offload moves), the gradients unchanged bit for bit. A later call without
    it keeps again."""
    model, inputs = build("llama"), batch()
    hf.enable(model, policy=policy)
    want = grads(model, inputs)
    kept = tracedac.saved_report(model, **inputs)
    model.activation_checkpointing_enable(offload=True)
    assert model.model.layers[0]._gradient_checkpointing_func.policy == policies.offload_inputs(
        policies.offload_kept(policy)
    )
    assert all(torch.equal(a, b) for a, b in zip(grads(model, inputs), want, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(grads(model, inputs), want, strict=True))  # (a cached plan)
    moved = tracedac.saved_report(model, **inputs)
    layer_inputs = [r for r in kept.rows if r.kind == "input" and r.why.startswith("argument 0 ")]
    assert len(layer_inputs) == len(model.model.layers)  # the hidden states each layer is called with
    assert kept.kept_bytes > 0 and moved.kept_bytes == 0
    assert moved.offloaded_bytes == kept.kept_bytes + sum(r.bytes for r in layer_inputs)
    assert not [r for r in moved.rows if r.kind == "input" and r.why.startswith("argument 0 ")]
    model.activation_checkpointing_enable()
    assert model.model.layers[0]._gradient_checkpointing_func.policy == policy


@needs_switch
def test_offload_true_makes_a_planner_choose_among_keep_offload_and_replay_itself():
    """With a planner, ``offload=True`` keeps the user's budget as the device's and lets the
    planner weigh offloading (the link measured): ``memory_budget(b, offload=True)``, also inside
    ``either``, each layer's input offloaded; the gradients are unchanged bit for bit, and a
    later call without it plans as before."""
    model, inputs = build("llama"), batch()
    budget = policies.memory_budget(0.3)
    hf.enable(model, policy=budget)
    want = grads(model, inputs)
    model.activation_checkpointing_enable(offload=True)
    assert model.model.layers[0]._gradient_checkpointing_func.policy == policies.offload_inputs(
        policies.memory_budget(0.3, offload=True)
    )
    assert all(torch.equal(a, b) for a, b in zip(grads(model, inputs), want, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(grads(model, inputs), want, strict=True))  # (a cached plan)
    model.activation_checkpointing_enable()
    assert model.model.layers[0]._gradient_checkpointing_func.policy == budget
    named = policies.either(policies.save_names("attn_out"), policies.min_cut())
    hf.enable(model, policy=named)
    model.activation_checkpointing_enable(offload=True)
    assert model.model.layers[0]._gradient_checkpointing_func.policy == policies.offload_inputs(
        policies.either(policies.save_names("attn_out"), policies.min_cut(offload=True))
    )


def test_enable_refuses_a_model_without_transformers_switch():
    with pytest.raises(CheckpointError, match=r"transformers >= 5\.23\).*tracedac.wrap\(model, LayerClass"):
        hf.enable(torch.nn.Linear(2, 2))


def test_enable_on_a_transformers_older_than_its_switch_names_the_version_to_install(monkeypatch):
    """A transformers model of a release without ``activation_checkpointing_enable`` (before
    5.23: 5.17, say) is refused naming the installed release and the first with the switch; on
    a newer transformers the switch is taken away to see the same."""
    import transformers

    monkeypatch.delattr(transformers.PreTrainedModel, "activation_checkpointing_enable", raising=False)
    model = build("llama")
    assert hf.TRANSFORMERS_MIN == "5.23"
    installed = re.escape(transformers.__version__)
    with pytest.raises(
        CheckpointError,
        match=rf"LlamaForCausalLM is a transformers model, and transformers {installed} "
        r"has no activation_checkpointing_enable: it came in transformers 5\.23\..*"
        r"pip install 'transformers>=5\.23'.*tracedac.wrap\(model, LayerClass",
    ):
        hf.enable(model)


@needs_switch
@pytest.mark.slow
def test_trainer_with_gradient_checkpointing_trains_with_tracedac_running_each_layer_once(tmp_path):
    """``TrainingArguments(activation_checkpointing=True)`` (transformers 5's name; the
    deprecated ``gradient_checkpointing=True`` does the same) makes the Trainer call the model's
    ``activation_checkpointing_enable``: tracedac stays (regions recorded, named by layer),
    Python in each layer runs once per step (torch's checkpoint would count two), and the
    weights after three steps are those of a run without checkpointing."""
    from torch.utils.checkpoint import CheckpointPolicy
    from transformers import Trainer, TrainingArguments

    def train(enable: bool):
        model = build("llama")
        counts = [0] * len(model.model.layers)
        for i, layer in enumerate(model.model.layers):
            layer.mlp.register_forward_pre_hook(lambda m, a, i=i: counts.__setitem__(i, counts[i] + 1))
        paths = set()

        def recording(node):  # a policy that notes where it was asked: tracedac recorded
            paths.add(current_region().graph.name)
            return CheckpointPolicy.PREFER_RECOMPUTE

        if enable:
            hf.enable(model, policy=recording)
        args = TrainingArguments(
            output_dir=str(tmp_path / "out"),
            activation_checkpointing=enable,
            activation_checkpointing_kwargs={"use_reentrant": False},
            max_steps=3,
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
        data = [{k: v[0] for k, v in batch(1, 16, seed=s).items()} for s in range(6)]
        Trainer(model=model, args=args, train_dataset=data).train()
        return model, counts, paths

    model, counts, paths = train(enable=True)
    assert isinstance(model.model.layers[0]._gradient_checkpointing_func, hf._Checkpointing)
    assert counts == [3, 3], "each layer's Python ran once per step"
    assert paths == {"model.layers.0", "model.layers.1"}
    plain, plain_counts, _ = train(enable=False)
    assert plain_counts == [3, 3]
    for (n, a), b in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b), n
    assert not any(p.name != "out" for p in tmp_path.iterdir())


@needs_switch
@pytest.mark.slow
def test_a_lora_model_trains_its_adapters_as_without_checkpointing_holding_no_more_than_torch():
    """PEFT's LoRA on a frozen Llama: adapter gradients equal to no checkpointing; after the
    forward, recompute_all holds no more than torch's checkpoint, and save_all (which keeps
    what autograd saves) no more than autograd itself: nothing is saved for a frozen weight
    that autograd would not save."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        build("llama"),
        LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "up_proj"]),
    )
    inputs = batch(4, 64)
    # The allocator also counts what tracedac's recorded graphs hold in glibc until backward
    # (Python lists and dicts over 512 bytes: 0.3 to 4.5 KiB over torch's here, depending on
    # what ran before) and the noise of glibc's thread cache: SLACK. A hidden state kept
    # besides (4 x 64 x 32 floats, 32 KiB) would exceed it four times over.
    SLACK = 8 << 10
    assert 0 < sum(p.requires_grad for p in model.parameters()) < len(list(model.parameters()))
    model.enable_input_require_grads()  # as transformers' switch does for PEFT models: the same graph
    plain, plain_held = grads(model, inputs), held_after_forward(model, inputs)
    model.disable_input_require_grads()
    model.activation_checkpointing_enable()
    torch_held = held_after_forward(model, inputs)
    hf.enable(model)
    with reporting() as regions:
        loss(model, inputs)
    assert [r.graph.name for r in regions] == [
        "base_model.model.model.layers.0",
        "base_model.model.model.layers.1",
    ]
    assert all(torch.equal(a, b) for a, b in zip(grads(model, inputs), plain, strict=True))
    held = held_after_forward(model, inputs)
    assert held <= torch_held + SLACK, (held, torch_held)
    hf.enable(model, policy=policies.save_all())
    assert all(torch.equal(a, b) for a, b in zip(grads(model, inputs), plain, strict=True))
    held = held_after_forward(model, inputs)
    assert held <= plain_held + SLACK, (held, plain_held)


@needs_switch
def test_every_n_layers_is_transformers_choice_of_layers():
    model, inputs = build("llama", layers=4), batch()
    hf.enable(model, every_n_layers=2)
    with reporting() as regions:
        loss(model, inputs)
    assert [r.graph.name for r in regions] == ["model.layers.0", "model.layers.2"]
    model.activation_checkpointing_enable(every_n_layers=3)  # as the Trainer passes it
    with reporting() as regions:
        loss(model, inputs)
    assert [r.graph.name for r in regions] == ["model.layers.0", "model.layers.3"]
