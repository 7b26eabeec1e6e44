"""``--compile``'s equal-bytes comparison (benchmarks/frontier.py)."""

import pytest

from benchmarks import frontier
from benchmarks.compiled import QUICK, _equal_bytes
from benchmarks.model import GPT, make_batch

pytestmark = pytest.mark.slow  # the quick loop (pytest -m "not slow") leaves this file out


def test_torchs_curve_is_read_at_the_same_bytes_on_its_lower_envelope():
    pts = [(0.0, 0, 100), (0.5, 50, 40), (0.6, 50, 60), (1.0, 100, 0)]
    assert frontier.at_bytes(pts, 25) == pytest.approx(70)  # halfway between 0 and 50 bytes
    assert frontier.at_bytes(pts, 50) == 40  # the better of two points at 50 bytes
    assert frontier.at_bytes(pts, 75) == pytest.approx(20)
    assert frontier.at_bytes(pts, 200) == 0
    assert frontier.at_bytes([(0.1, 10, 5)], 5) is None  # torch cannot get that low


def test_a_sweep_on_the_quick_model_spans_torchs_extremes_and_places_tracedacs_budget():
    base, batch = GPT.seeded(QUICK), make_batch(QUICK)
    curve = frontier.sweep(base, batch, budgets=(0.0, 1.0), tracedac_budgets=(0.5,))
    (_, none_bytes, none_flops), (_, all_bytes, all_flops) = curve["torch"]
    assert none_bytes < all_bytes and none_flops > all_flops == 0  # recompute all vs keep all
    for who in ("tracedac", "tracedac, one region"):
        ((_, ours_bytes, ours_flops),) = curve[who]
        assert none_bytes < ours_bytes <= 0.5 * all_bytes and ours_flops > 0
        assert _equal_bytes(curve, who) == pytest.approx(
            ours_flops / frontier.at_bytes(curve["torch"], ours_bytes)
        )
    assert _equal_bytes(curve) == _equal_bytes(
        curve, "tracedac, one region"
    )  # the target's point: same scope
    # the per-block point is read against its floor: what its plans replay by their own price
    # bounds the partition's replay, and the floor bounds the plans
    ((budget, planned, least),) = curve["floor"]
    assert budget == 0.5 and 0 < least <= planned and curve["tracedac"][0][2] <= planned


def test_a_compiled_budget_replays_no_more_than_its_plan_priced(monkeypatch):
    """The plan's exact price (the FLOPs of ``closure``'s nodes: what replay runs to rebuild
    what backward reads, given what the plan keeps) bounds what torch's partitioner replays.
    Priced on the values the untagged partition saves only, the plan missed a residual sum
    that the layer norm's backward reads:
    the tags make the partitioner rebuild it through the attention's output projection
    (priced 0.25 MFLOP, replayed 0.66)."""
    import copy

    import tracedac
    from tracedac.inspect.compiled import partition
    from tracedac.policies import planners

    priced = []
    choose = planners.MemoryBudget.choose

    def spy(self, p):
        keep = choose(self, p)
        run = planners.closure(p.graph, p.wanted, set(keep))  # what replay runs for this choice
        priced.append(sum(planners.node_cost(p.graph.nodes[i])[0] for i in run))
        return keep

    monkeypatch.setattr(planners.MemoryBudget, "choose", spy)
    model = copy.deepcopy(GPT.seeded(QUICK))
    model.blocks = model.blocks[:1]  # one region: nothing read across a boundary
    tracedac.checkpoint(model.blocks[0], policy=tracedac.policies.memory_budget(0.5))
    (part,) = partition(model, *make_batch(QUICK))
    assert len(priced) == 1 and priced[0] > 0
    assert part.replay_flops <= priced[0]
