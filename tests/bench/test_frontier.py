"""``--compile``'s equal-bytes comparison (tracedac/bench/frontier.py)."""

import pytest

from tracedac.bench import frontier
from tracedac.bench.compiled import QUICK, _equal_bytes
from tracedac.bench.model import GPT, make_batch


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
    (_, ours_bytes, ours_flops), = curve["tracedac"]
    assert none_bytes < ours_bytes <= 0.5 * all_bytes and ours_flops > 0
    ratio = _equal_bytes(curve)
    assert ratio == pytest.approx(ours_flops / frontier.at_bytes(curve["torch"], ours_bytes))
