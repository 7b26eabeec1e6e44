"""torchtitan's activation checkpointing under tracedac (``tracedac.integrations.torchtitan``):
torchtitan's own debug models, AC modes, optimizer container and MoE load-balancing hook,
compared with the same training run without checkpointing."""

import copy
import functools
import sys
import warnings
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

# torchtitan changes torch globally: importing torchtitan.distributed.compile wraps
# FakeTensorMode.__init__ in torch.compiler.disable, and applying any of its AC modes turns
# dynamo's LRU cache of compiled graphs off. Kept to this module's tests (``_torchtitans_torch``),
# so the rest of the suite runs on torch as installed.
_FAKE_INIT = FakeTensorMode.__init__

pytest.importorskip(
    "torchtitan",
    reason="torchtitan is not installed (pip install -e '.[titan]'; torchtitan 0.3 needs Python >= 3.11)",
)

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (  # noqa: E402
    CheckpointImpl,
    CheckpointWrapper,
    checkpoint_wrapper,
)
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torchtitan.components.checkpointer.utils import canonical_fqn  # noqa: E402
from torchtitan.components.loss import CrossEntropyLoss  # noqa: E402
from torchtitan.components.optimizer import default_adamw  # noqa: E402
from torchtitan.distributed import ParallelDims  # noqa: E402
from torchtitan.distributed import activation_checkpoint as titan_ac  # noqa: E402
from torchtitan.distributed.activation_checkpoint import FullAC, MemoryBudgetAC, SelectiveAC  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
from torchtitan.models.deepseek_v3 import model_registry as deepseek_v3  # noqa: E402
from torchtitan.models.llama3 import model_registry as llama3  # noqa: E402

import tracedac  # noqa: E402
from tracedac import CheckpointError, policies  # noqa: E402
from tracedac.integrations import torchtitan as titan  # noqa: E402

_TITAN_FAKE_INIT, FakeTensorMode.__init__ = FakeTensorMode.__init__, _FAKE_INIT

pytestmark = pytest.mark.filterwarnings("ignore:In CPU autocast:UserWarning")  # torchtitan's router

VOCAB = 2048  # the debug models' vocabulary
MODES = {"full": FullAC.Config, "selective": SelectiveAC.Config}


@pytest.fixture(autouse=True, scope="module")
def _torchtitans_torch():
    FakeTensorMode.__init__ = _TITAN_FAKE_INIT
    try:
        yield
    finally:
        FakeTensorMode.__init__ = _FAKE_INIT
        torch._C._dynamo.eval_frame._set_lru_cache(True)  # (torch's default; AC's apply sets False)
        # With the LRU cache off, dynamo's cache entries for the blocks compiled here keep the
        # constants of each model they compiled (torchtitan's 8 MiB rope tables) for the rest
        # of the process: dropped with the compiled code.
        torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _disabled():
    """Each test starts and ends with torchtitan as it was installed."""
    titan.disable()
    yield
    titan.disable()


def build(kind: str, n_layers: int = 3):
    """torchtitan's ``debugmodel`` of ``kind`` (llama3: dense; deepseek_v3: layer 0 dense, the
    others MoE with load balancing), its first ``n_layers`` layers, with torchtitan's SDPA
    attention in place of FlexAttention (which has no CPU backward), initialised by torchtitan
    on CPU from a fixed seed. Returns (model spec, model)."""
    spec = {"llama3": llama3, "deepseek_v3": deepseek_v3}[kind]("debugmodel")
    config = spec.model
    config.layers = config.layers[:n_layers]
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    model.init_weights(buffer_device=torch.device("cpu"))
    return spec, model


@dataclass
class Step:
    loss: torch.Tensor
    grads: dict  # canonical parameter name -> gradient after backward
    counts: dict  # canonical buffer name -> tokens_per_expert_E after backward, before the hook
    bias: dict  # canonical buffer name -> expert_bias_E after the optimizer step


def train(spec, model, steps: int = 3) -> list:
    """``steps`` training steps as torchtitan's Trainer takes them: its AdamW container (its
    default implementation), the model's post-optimizer hook (MoE load balancing, which reads and
    zeroes ``tokens_per_expert_E`` before each step), its cross-entropy loss."""
    optimizers = default_adamw(lr=8e-4).build(model_parts=[model])
    if spec.post_optimizer_build_fn is not None:
        dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
        spec.post_optimizer_build_fn(optimizers, [model], dims)
    loss_fn = CrossEntropyLoss.Config().build()
    gen = torch.Generator().manual_seed(1)
    record = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (2, 33), generator=gen)  # [B, L + 1]
        loss, _ = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        grads = {canonical_fqn(n): p.grad.clone() for n, p in model.named_parameters()}
        counts = {
            canonical_fqn(n): b.clone() for n, b in model.named_buffers() if n.endswith("tokens_per_expert_E")
        }
        optimizers.step()
        optimizers.zero_grad()
        bias = {canonical_fqn(n): b.clone() for n, b in model.named_buffers() if n.endswith("expert_bias_E")}
        record.append(Step(loss.detach(), grads, counts, bias))
    return record


def assert_bitwise(got: list, want: list, what=("loss", "grads", "counts", "bias")) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        for field in what:
            a, b = getattr(g, field), getattr(w, field)
            if isinstance(a, dict):
                assert a.keys() == b.keys(), f"step {i}: {field}"
                for k in a:
                    assert torch.equal(a[k], b[k]), (
                        f"step {i}: {field} {k}: max |diff| {(a[k] - b[k]).abs().max()}"
                    )
            else:
                assert torch.equal(a, b), f"step {i}: {field} {a} != {b}"


def count_calls(model, child: str) -> list:
    """A list that grows by one at each forward of ``child`` in every block."""
    calls = []
    for block in model.layers.values():
        block.get_submodule(child).register_forward_hook(lambda *_: calls.append(1))
    return calls


@pytest.fixture(scope="module")
def moe_world(tmp_path_factory):
    """torchtitan's load-balancing hook asks its ParallelDims for a mesh at each step: a world-1
    gloo group (file init) for this module's tests, destroyed after them."""
    init = tmp_path_factory.mktemp("titan_pg") / "init"
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def no_ac(moe_world):
    """The reference runs: each model trained without activation checkpointing."""
    return {kind: train(*build(kind)) for kind in ("llama3", "deepseek_v3")}


# --- enable(): every mode, exact -----------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_dense_model_under_each_mode_gives_no_checkpointings_loss_and_gradients_bit_for_bit(mode, no_ac):
    """torchtitan's own AC config, switched to tracedac by one call, must train the dense
    debug model exactly as without checkpointing: the loss and every gradient of 3 steps bit for
    bit, and each block's Python run once per step (torch's checkpoint runs it again in
    backward)."""
    titan.enable()
    spec, model = build("llama3")
    MODES[mode]().build().apply(model)
    assert not any(isinstance(b, CheckpointWrapper) for b in model.layers.values())
    assert all("_tracedac" in b.__dict__ for b in model.layers.values())
    calls = count_calls(model, "attention")
    got = train(spec, model)
    assert_bitwise(got, no_ac["llama3"], ("loss", "grads"))
    assert len(calls) == 3 * len(model.layers)


@pytest.mark.parametrize("mode", MODES)
def test_moe_token_counts_and_expert_bias_equal_no_checkpointing_after_three_steps(mode, no_ac, moe_world):
    """torchtitan's MoE load balancing (aux-loss-free: the expert bias moves by the sign of each
    expert's count against the mean) must see the true token counts. torch's checkpoint runs the
    router twice and torchtitan halves the count of any block whose ``checkpoint_impl`` is
    NO_REENTRANT; tracedac counts once, and its blocks must not be halved: the counts before
    each step, the expert bias after it, the loss and every gradient equal no checkpointing."""
    titan.enable()
    spec, model = build("deepseek_v3")
    MODES[mode]().build().apply(model)
    got = train(spec, model)
    assert_bitwise(got, no_ac["deepseek_v3"])
    assert got[0].counts and all(int(c.sum()) == 2 * 32 * 3 for c in got[0].counts.values())  # B*L*top-k


def test_torchs_checkpoint_doubles_the_counts_that_enable_gets_right(no_ac, moe_world):
    """The reason for the integration, measured on torchtitan itself: torchtitan's full AC with
    torch's checkpoint leaves every MoE layer's count at twice the true one (torchtitan halves it
    in its hook, so its bias is right but anything else reading the buffer is not)."""
    spec, model = build("deepseek_v3")
    FullAC.Config().build().apply(model)
    torch_run = train(spec, model, steps=1)
    for name, count in torch_run[0].counts.items():
        assert torch.equal(count, 2 * no_ac["deepseek_v3"][0].counts[name])


def test_memory_budget_mode_runs_tracedacs_planner_eager_with_no_checkpointings_results(no_ac, moe_world):
    """torchtitan's memory-budget mode only sets torch.compile's partitioner budget, so eager it
    checkpoints nothing. Under enable() each block is checkpointed eager by tracedac's planner at
    that budget, torch's global budget is left alone, and training equals no checkpointing."""
    titan.enable()
    before = torch._functorch.config.activation_memory_budget
    for kind in ("llama3", "deepseek_v3"):
        spec, model = build(kind)
        MemoryBudgetAC.Config(memory_budget=0.5).build().apply(model)
        assert {b._tracedac.policy for b in model.layers.values()} == {policies.memory_budget(0.5)}
        assert_bitwise(train(spec, model), no_ac[kind])
    assert torch._functorch.config.activation_memory_budget == before


def saved_activation_bytes(model, tokens) -> int:
    """Bytes autograd saves for backward in one forward, parameters and buffers (the rope
    table) left out: what a budget trades."""
    own = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    saved = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in own:
            saved.append(t.nbytes)
        # nothing kept (this forward has no backward): a saved output packed as itself would
        # hold its own graph node, a cycle through C++ that no collection frees
        return None

    def unpack(_):
        raise AssertionError("saved_activation_bytes' forward has no backward")

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        model(tokens)
    return sum(saved)


@pytest.mark.slow
def test_memory_budget_mode_compiled_as_torchtitan_compiles_plans_each_block():
    """Compiled as torchtitan's apply_compile does (each block, fullgraph), the mode's budget
    must reach tracedac's planner in the compiled graph: activations saved grow with the budget,
    0.0 below torch's own 0.5, and the gradients equal the model compiled without checkpointing."""
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))

    def run(budget, enable):
        (titan.enable if enable else titan.disable)()
        _, model = build("llama3")
        if budget is not None:
            MemoryBudgetAC.Config(memory_budget=budget).build().apply(model)
        for block in model.layers.values():
            block.compile(backend="aot_eager_decomp_partition", fullgraph=True)
        saved = saved_activation_bytes(model, tokens)
        model(tokens).float().pow(2).mean().backward()
        return saved, [p.grad for p in model.parameters()]

    # torchtitan's own mode sets torch's global budget: put back after the test
    with torch._functorch.config.patch(activation_memory_budget=1.0):
        plain_saved, plain = run(None, False)
        saved = {}
        for budget in (0.0, 0.5, 1.0):
            saved[budget], grads = run(budget, True)
            assert all(torch.equal(a, b) for a, b in zip(grads, plain, strict=True)), budget
        torch_saved, _ = run(0.5, False)  # torchtitan's own mode: torch's partitioner at 0.5
    assert saved[0.0] < saved[0.5] < saved[1.0] <= plain_saved
    assert saved[0.0] < torch_saved


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_moe_compiled_as_torchtitan_compiles_keeps_counts_and_expert_bias_exact(mode, moe_world):
    """Compiled (each block, fullgraph, as apply_compile does), the router's count runs once
    whatever checkpoints it, so torchtitan's halving of a NO_REENTRANT block is wrong even for
    torch's own checkpoint (its bias differs from no checkpointing's after one step, measured
    2026-12-07: docs/guide/torchtitan.md). Through enable() the blocks have no checkpoint_impl: two
    steps equal the model compiled without checkpointing, counts, bias, loss and gradients."""
    # what apply_compile sets for torchtitan's MoE, for this test only
    config = torch._dynamo.config.patch(
        capture_scalar_outputs=True, skip_fwd_side_effects_in_bwd_under_checkpoint=True
    )

    def run(config):
        spec, model = build("deepseek_v3")
        if config is not None:
            config().build().apply(model)
        for block in model.layers.values():
            block.compile(backend="aot_eager_decomp_partition", fullgraph=True)
        return train(spec, model, steps=2)

    with config:
        plain = run(None)
        titan.enable()
        assert_bitwise(run(MODES[mode]), plain)


class MatmulCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args, kwargs=None):
        self.n += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        return func(*args, **(kwargs or {}))


def test_selective_mode_keeps_torchtitans_save_list_rather_than_replaying_all():
    """SelectiveAC's context_fn (its save list, every second matmul recomputed) must reach
    tracedac as a policy, not be dropped for recompute-all: backward under it replays fewer
    matmuls than under FullAC, and no more than torch's selective checkpointing recomputes."""
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))

    def backward_matmuls(config, enable):
        (titan.enable if enable else titan.disable)()
        _, model = build("llama3")
        if config is not None:
            config().build().apply(model)
        loss = model(tokens).float().pow(2).mean()
        with MatmulCount() as count:
            loss.backward()
        return count.n

    plain = backward_matmuls(None, False)
    full, selective = backward_matmuls(FullAC.Config, True), backward_matmuls(SelectiveAC.Config, True)
    torch_selective = backward_matmuls(SelectiveAC.Config, False)
    assert plain < selective < full
    assert selective <= torch_selective


# --- the generic route: checkpoint_wrapper(block, checkpoint_fn=tracedac.checkpoint_call) ----


def generic_route(monkeypatch):
    """What a user does without enable(): torchtitan's wrapper given tracedac's function."""
    monkeypatch.setattr(
        titan_ac,
        "ptd_checkpoint_wrapper",
        functools.partial(checkpoint_wrapper, checkpoint_fn=tracedac.checkpoint_call),
    )


def test_checkpoint_fn_route_warns_once_per_moe_block_naming_enable(monkeypatch, no_ac, moe_world):
    """torch's wrapper reports NO_REENTRANT whatever its checkpoint_fn, so torchtitan halves
    tracedac's correct count and the expert bias goes wrong after one step. That must not be
    silent: one warning per MoE block (not per step) that names the fix, enable()."""
    generic_route(monkeypatch)
    spec, model = build("deepseek_v3")
    FullAC.Config().build().apply(model)
    with pytest.warns(UserWarning) as caught:
        got = train(spec, model, steps=2)
    ours = [w for w in caught if "tracedac.integrations.torchtitan.enable()" in str(w.message)]
    assert len(ours) == sum(b.moe_enabled for b in model.layers.values()) == 2
    assert "tokens_per_expert_E" in str(ours[0].message)
    # the warning is no false alarm: the bias this route gives is not no checkpointing's
    assert any(not torch.equal(got[0].bias[k], v) for k, v in no_ac["deepseek_v3"][0].bias.items())


def test_checkpoint_fn_route_on_a_dense_model_does_not_warn(monkeypatch):
    """A block with no MoE has no count to halve: the generic route is exact there, and quiet."""
    generic_route(monkeypatch)
    spec, model = build("llama3", n_layers=2)
    FullAC.Config().build().apply(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(spec, model, steps=1)


# --- enable() and disable() themselves -------------------------------------------------------


def test_enable_and_disable_are_idempotent_and_put_back_exactly_what_was_there():
    """enable() patches torchtitan's module; disable() must leave it as installed (the same
    objects), however often either is called, and torchtitan then checkpoints with torch again."""
    wrapper, apply = titan_ac.ptd_checkpoint_wrapper, MemoryBudgetAC.__dict__["apply"]
    titan.enable()
    titan.enable()
    assert titan.is_enabled() and titan_ac.ptd_checkpoint_wrapper is not wrapper
    titan.disable()
    titan.disable()
    assert not titan.is_enabled()
    assert titan_ac.ptd_checkpoint_wrapper is wrapper and MemoryBudgetAC.__dict__["apply"] is apply
    _, model = build("llama3", n_layers=1)
    FullAC.Config().build().apply(model)
    assert isinstance(model.layers["0"], CheckpointWrapper)


def test_blocks_keep_their_names_and_unwrap_makes_them_plain():
    """A block checkpointed by enable() stays itself: parameter names as without checkpointing
    (no _checkpoint_wrapped_module), and tracedac.unwrap(model) removes the region."""
    titan.enable()
    _, model = build("llama3", n_layers=2)
    names = [n for n, _ in model.named_parameters()]
    SelectiveAC.Config().build().apply(model)
    assert [n for n, _ in model.named_parameters()] == names
    assert model.layers["1"]._tracedac.name == "layers.1"  # (the region's name, in reports and errors)
    tracedac.unwrap(model)
    assert not any({"_tracedac", "forward"} & b.__dict__.keys() for b in model.layers.values())


def test_a_deep_copy_of_an_enabled_model_is_checkpointed_on_its_own():
    """torchtitan and its users copy models (pipeline stages, EMA): the copy's blocks must run
    their own regions, and unwrapping the copy must leave the original checkpointed."""
    titan.enable()
    _, model = build("llama3", n_layers=2)
    FullAC.Config().build().apply(model)
    twin = copy.deepcopy(model)
    assert twin.layers["0"]._tracedac.module is twin.layers["0"]
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    calls = count_calls(twin, "attention")
    assert torch.equal(twin(tokens), model(tokens)) and len(calls) == 2
    tracedac.unwrap(twin)
    assert all("_tracedac" in b.__dict__ for b in model.layers.values())
    assert not any("_tracedac" in b.__dict__ for b in twin.layers.values())


def test_a_block_already_checkpointed_by_tracedac_is_refused():
    titan.enable()
    _, model = build("llama3", n_layers=1)
    tracedac.checkpoint(model.layers["0"])
    with pytest.raises(CheckpointError, match="already checkpointed by tracedac"):
        FullAC.Config().build().apply(model)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"checkpoint_fn": torch.utils.checkpoint.checkpoint}, "disable"),
        ({"checkpoint_impl": CheckpointImpl.REENTRANT}, "reentrant"),
        ({"offload": True}, "not torch.utils.checkpoint options"),
    ],
)
def test_what_enable_cannot_honour_is_refused_saying_what_to_do(kwargs, match):
    """torchtitan's wrapper name, while enabled, takes what torch's wrapper takes; what tracedac
    would not do as asked is refused by name rather than dropped."""
    titan.enable()
    _, model = build("llama3", n_layers=1)
    with pytest.raises(CheckpointError, match=match):
        titan_ac.ptd_checkpoint_wrapper(model.layers["0"], **kwargs)


def test_enable_without_torchtitans_ac_classes_says_which_torchtitan_it_needs(monkeypatch):
    monkeypatch.delattr(titan_ac, "MemoryBudgetAC")
    with pytest.raises(CheckpointError, match=r"torchtitan 0\.3\.x"):
        titan.enable()
    assert not titan.is_enabled()


def test_enable_without_torchtitan_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchtitan.distributed.activation_checkpoint", None)
    with pytest.raises(ModuleNotFoundError, match="pip install"):
        titan.enable()
