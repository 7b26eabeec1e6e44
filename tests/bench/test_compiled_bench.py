"""``--compile``'s step times in turns (benchmarks/compiled.py ``_in_turns``)."""

import functools

import pytest
import torch

from benchmarks import compiled
from benchmarks.model import GPT, make_batch

pytestmark = pytest.mark.slow  # the quick loop (pytest -m "not slow") leaves this file out


def test_step_times_in_turns_time_every_variant_without_a_recompile(monkeypatch):
    """Two variants alive at once, compiled (aot_eager here: inductor adds nothing to what
    this checks), stepped in turns: each gets every step, and no step compiles."""
    monkeypatch.setattr(compiled, "IN_TURNS", ("none", "tracedac_recompute_all", "tracedac_eager"))
    monkeypatch.setattr(
        torch, "compile", functools.partial(torch.compile, backend="aot_eager_decomp_partition")
    )
    cfg = compiled.QUICK
    said = []
    times = compiled._in_turns(GPT.seeded(cfg), make_batch(cfg), cfg, 3, said.append)
    assert sorted(times) == ["none", "tracedac_eager", "tracedac_recompute_all"]
    assert all(len(t) == 3 and min(t) > 0 for t in times.values())
    assert said[0] == "step times in turns: 3 variants compiled again"
