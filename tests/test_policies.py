"""Policy objects: values that compare, hash and print; factories that refuse bad input."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy

import tracedac
from tracedac import CheckpointError, checkpoint, policies
from tracedac.region import reporting

from .util import OpCounter, assert_same_grads

aten = torch.ops.aten


def test_policies_are_values_that_compare_hash_and_print_as_their_call():
    """Hashable policies can key a cache of plans; printing shows what was asked for."""
    assert policies.save_ops(aten.mm, aten.bmm) == policies.save_ops(aten.bmm, aten.mm)
    assert hash(policies.save_names("a", "b")) == hash(policies.save_names("b", "a"))
    assert policies.recompute_all() == policies.recompute_all() != policies.save_all()
    assert len({policies.save_matmuls(), policies.save_matmuls(), policies.recompute_all()}) == 2
    assert repr(policies.save_matmuls()) == "save_matmuls()"
    assert repr(policies.save_ops(aten.mm.default)) == "save_ops(aten.mm.default)"
    combined = policies.either(
        policies.save_matmuls(), policies.either(policies.save_names("x"), policies.save_all())
    )
    assert repr(combined) == "either(save_matmuls(), save_names('x'), save_all())"
    with pytest.raises(AttributeError):
        combined.policies = ()  # frozen


def test_equal_policies_are_one_object_and_a_copy_or_a_load_is_that_object():
    """Equal policies are one object (a compiled region's code is guarded on its policy's id:
    tests/test_compile.py); ``copy.deepcopy`` and ``pickle`` give the live equal one back,
    ops travelling by name (an aten op does not pickle). ``peak()`` keeps state: its own each."""
    import copy
    import pickle

    def made():
        return [
            policies.save_matmuls(),
            policies.save_ops(aten.mm, aten.bmm.default),
            policies.offload_ops(aten.addmm),
            policies.either(policies.save_names("h"), policies.memory_budget(0.5)),
            policies.offload_kept(policies.min_cut(replay_matmuls=True)),
            policies.offload_inputs(),
            policies.replay_collectives(policies.save_all()),
        ]

    for p, again in zip(made(), made(), strict=True):
        assert again is p and copy.deepcopy(p) is p and pickle.loads(pickle.dumps(p)) is p, p
    budget = policies.peak("1GiB")
    assert policies.peak("1GiB") is not budget and copy.deepcopy(budget) is not budget
    # a load in a process that lacks an op the policy names says which and what to do
    payload = pickle.dumps(policies.offload_ops(aten.addmm)).replace(b"aten.addmm", b"aten.nosop")
    with pytest.raises(RuntimeError, match=r"names the op aten\.nosop, which this process has not"):
        pickle.loads(payload)


def test_a_whole_model_checkpointed_with_ops_in_its_policy_saves_and_loads(tmp_path):
    """``torch.save(model)`` (the whole module, not its state_dict) of a model checkpointed with
    ``save_matmuls()`` failed inside pybind11: the policy's ops, and the region's reading of the
    policy, do not pickle. Loaded, the model runs its regions under the same policy."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    checkpoint(model, policy=policies.save_matmuls())
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert loaded._tracedac.policy is model._tracedac.policy
    x = torch.randn(4, 8)
    for m in (model, loaded):
        m(x).square().sum().backward()
    for a, b in zip(model.parameters(), loaded.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    report = tracedac.saved_report(loaded, x)
    kept = [r.op for r in report.rows if r.kind == "activation" and "save_matmuls() -> MUST_SAVE" in r.why]
    assert kept == ["aten.addmm.default"]  # the first layer's result: the second's feeds nothing saved


def test_every_matmul_op_comes_with_its_reason():
    assert {aten.mm, aten.bmm, aten.addmm, aten.baddbmm} <= set(policies.MATMUL_OPS)
    assert any("attention" in str(op) for op in policies.MATMUL_OPS)
    assert all(isinstance(reason, str) and len(reason) > 10 for reason in policies.MATMUL_OPS.values())


def test_factories_refuse_what_is_not_an_op_or_label_and_say_what_to_pass():
    with pytest.raises(TypeError, match=r"torch.ops.aten.mm \(every overload\)"):
        policies.save_ops("mm")
    with pytest.raises(TypeError, match="Python function; pass the aten op"):
        policies.save_ops(torch.mm)
    with pytest.raises(ValueError, match="at least one op"):
        policies.save_ops()
    with pytest.raises(TypeError, match="non-empty strings"):
        policies.save_names("")
    with pytest.raises(ValueError, match="at least one label"):
        policies.save_names()
    with pytest.raises(TypeError, match="policy is a callable"):
        policies.either(policies.save_all(), 3)


def test_save_ops_matches_a_packet_or_a_single_overload():
    def f(x, w):
        return (x @ w).relu().sum()

    x, w = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    for policy, replayed_mm in [
        (policies.save_ops(aten.mm), 0),
        (policies.save_ops(aten.mm.default), 0),
        (policies.save_ops(aten.mm.out), 1),
    ]:
        out = checkpoint(f, policy=policy)(x, w)
        with OpCounter() as ops:
            torch.autograd.grad(out, (x, w))
        assert ops.counts[aten.mm] == 2 + replayed_mm, policy


def test_save_names_keeps_what_name_labelled():
    def f(x):
        h = tracedac.name(x.exp().sigmoid(), "h")
        return (h.tanh() * h).sum()

    x = torch.randn(8, requires_grad=True)
    out = checkpoint(f, policy=policies.save_names("h"))(x)
    with OpCounter() as ops:
        torch.autograd.grad(out, x)
    assert ops.counts[aten.sigmoid] == 0, "h is kept"
    assert ops.counts[aten.tanh] == 1, "tanh(h) is not: replayed from the kept h"
    assert_same_grads(f, (x,), policy=policies.save_names("h"))


def test_either_keeps_what_any_keeps_and_must_beats_prefer():
    node = type(
        "N", (), {"op": aten.mm.default, "labels": frozenset({"x"}), "name": "aten.mm.default", "index": 0}
    )()
    assert (
        policies.either(policies.recompute_all(), policies.save_all())(node) == CheckpointPolicy.PREFER_SAVE
    )
    assert (
        policies.either(policies.save_all(), lambda n: CheckpointPolicy.MUST_RECOMPUTE)(node)
        == CheckpointPolicy.MUST_RECOMPUTE
    )
    assert policies.either(policies.save_names("x"), policies.save_all())(node) == CheckpointPolicy.MUST_SAVE
    with pytest.raises(CheckpointError, match="disagree on aten.mm.default.*MUST_SAVE.*MUST_RECOMPUTE"):
        policies.either(policies.save_matmuls(), lambda n: CheckpointPolicy.MUST_RECOMPUTE)(node)


def test_a_user_callable_sees_the_node_view():
    seen = []

    def policy(node):
        seen.append(
            (
                node.name,
                tuple(o.shape for o in node.outputs if o is not None),
                node.nbytes,
                node.flops,
                node.module_path,
                node.labels,
                node.is_random,
            )
        )
        return CheckpointPolicy.MUST_SAVE if node.flops > 0 else CheckpointPolicy.PREFER_RECOMPUTE

    lin = torch.nn.Linear(8, 16)
    x = torch.randn(4, 8, requires_grad=True)
    with reporting() as regions:
        out = checkpoint(lambda x: F.dropout(lin(x), 0.5).sum(), policy=policy)(x)
    addmm = next(s for s in seen if s[0] == "aten.addmm.default")
    assert addmm[1] == ((4, 16),) and addmm[2] == 4 * 16 * 4 and addmm[3] == 2 * 4 * 8 * 16
    assert addmm[4] == "Linear"
    assert any(s[6] for s in seen), "dropout is random"
    addmm_node = next(n for n in regions[0].graph.nodes if n.name == "aten.addmm.default")
    assert addmm_node.meta["recompute"] == CheckpointPolicy.MUST_SAVE  # where torch's nodes carry it
    out.backward()


def test_a_policy_that_returns_something_else_is_refused_with_the_fix():
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(CheckpointError, match="must return a torch.utils.checkpoint.CheckpointPolicy"):
        checkpoint(lambda x: x.exp().sum(), policy=lambda node: True)(x)


def test_a_write_to_node_meta_recompute_is_the_decision_and_other_keys_stay():
    """``node.meta`` must behave as torch's fx.Node.meta: a write is never silently lost."""
    from tracedac.record.graph import Node

    node = Node(0, torch.ops.aten.mm.default, (), {}, (), (), (), None, None, None)
    assert "recompute" not in node.meta and len(node.meta) == 0
    node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    node.meta["ac_graph_id"] = 3
    assert node.decision is CheckpointPolicy.MUST_SAVE
    assert dict(node.meta) == {"recompute": CheckpointPolicy.MUST_SAVE, "ac_graph_id": 3}


def test_policies_and_planners_import_no_cycle():
    """The decisions module is the leaf: planners never import the per-op policies or the
    package that gathers them (which imports the planners)."""
    import ast
    import pathlib

    import tracedac.policies.planners as planners

    tree = ast.parse(pathlib.Path(planners.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not imported & {"per_op", "wrappers", "spec", "..policies", None}, imported
    assert "record.decisions" in imported


def test_a_policy_made_every_step_is_not_kept_once_nothing_uses_it():
    """A training loop that writes ``policy=memory_budget(b)`` or a fresh function inside the
    step makes a policy a step; tracedac finds policies by id (compiled regions name them
    so) and must not keep each one for the process: a million steps would keep a million."""
    import gc
    import weakref

    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    made = []
    for step in range(4):

        def fresh(node, step=step):  # a new function object every step
            return policies.PREFER_RECOMPUTE

        for policy in (policies.memory_budget(0.25 + step / 100), fresh, policies.save_names(f"h{step}")):
            made.append(weakref.ref(policy))
            tracedac.checkpoint_call(lambda a: (a @ w).relu().sum(), x, policy=policy).backward()
        del policy, fresh
    gc.collect()
    kept = [r() for r in made if r() is not None]
    # only as part of a cached plan's key: the plan cache is bounded (least recently used out)
    from tracedac.policies.plan_cache import plans

    in_plans = [p for p in kept if any(p is k[0] for k in plans.entries)]
    assert len(kept) == len(in_plans) <= 4 and len(plans.entries) <= plans.size, kept


@pytest.mark.parametrize("factory", [policies.save_matmuls, policies.recompute_all, policies.memory_budget])
def test_an_uncalled_policy_factory_is_refused_where_it_is_given_with_the_call_to_make(factory):
    """``policy=policies.save_matmuls`` (the factory) once failed at the first forward with
    "save_matmuls() takes 0 positional arguments but 1 was given"."""
    block = torch.nn.Linear(4, 4)
    with pytest.raises(
        TypeError, match=rf"policy={factory.__name__} is the factory.*{factory.__name__}\(\.\.\.\)"
    ):
        tracedac.checkpoint(block, policy=factory)
    with pytest.raises(TypeError, match="is the factory"):
        tracedac.wrap(torch.nn.Sequential(block), torch.nn.Linear, policy=factory)
    with pytest.raises(TypeError, match="is the factory"):
        tracedac.checkpoint_call(block, torch.ones(4), policy=factory)
    assert not tracedac.is_checkpointed(block)


def test_a_label_no_result_carries_is_warned_about_once_per_region_and_policy():
    """``save_names("nope")`` with a label never set (or misspelt) kept nothing, silently."""
    import warnings

    def block(x):
        h = tracedac.name(torch.sin(x), "attn_out")
        return torch.cos(h).sum()

    x = torch.randn(4, requires_grad=True)
    typo = checkpoint(block, policy=policies.save_names("attn-out"))
    with pytest.warns(
        UserWarning, match=r"none of its results carries the label 'attn-out'.*seen here: 'attn_out'"
    ):
        typo(x).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # (offload on the CPU warns once per process: whether here depends on the tests before)
        warnings.filterwarnings("ignore", message="tracedac: a region offloads on the CPU")
        typo(x).backward()  # once
        checkpoint(block, policy=policies.save_names("attn_out"))(x).backward()  # a label that matches
        inside = policies.offload_kept(policies.either(policies.save_names("attn_out"), policies.save_all()))
        checkpoint(block, policy=inside)(x).backward()  # found inside wrappers and combinations
    with pytest.warns(UserWarning, match="'never'"):
        checkpoint(block, policy=policies.either(policies.save_names("attn_out", "never")))(x).backward()
