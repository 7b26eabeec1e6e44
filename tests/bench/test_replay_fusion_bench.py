"""python -m benchmarks.replay_fusion at a tiny size: every way steps, exact fusion and op-by-op
replay give no checkpointing's gradients bit for bit, fusing all within rounding."""

import pytest

from benchmarks import replay_fusion

pytestmark = pytest.mark.slow  # two inductor compiles


def test_each_way_steps_and_only_full_fusion_leaves_the_forwards_bits():
    r = replay_fusion.run(dim=32, layers=2, steps=2, progress=None)
    rows = {x["key"]: x for x in r["rows"]}
    assert list(rows) == ["none", "op_by_op", "exact", "all"]
    assert all(x["backward_s"] > 0 for x in rows.values())
    assert rows["op_by_op"]["max_grad_diff"] == 0 and rows["exact"]["max_grad_diff"] == 0
    assert 0 <= rows["all"]["max_grad_diff"] < 1e-5
    # one program per fusion, run for the second layer onward
    assert r["compiled_replay"]["compiled"] == 2 and r["compiled_replay"]["runs"] > 0
    text = replay_fusion.format_report(r)
    assert "exact fusion (the default)" in text and "exact / all:" in text
