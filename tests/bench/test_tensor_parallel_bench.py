"""``benchmarks.tensor_parallel`` on two ranks, tiny: its rows count what ran and keep what
results/history/benchmarks.md reads from them."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import tensor_parallel as tp
from tests.support.ranks import run_ranks

pytestmark = pytest.mark.slow  # the quick loop (pytest -m "not slow") leaves this file out


def _rows(rank, world):
    args = argparse.Namespace(layers=2, dim=32, tokens=64, steps=1)
    result = tp.rank_main(args)
    return result, tp.report(result, args, world)


@pytest.fixture(scope="module")
def run():
    return run_ranks(_rows, 2, timeout=120)[0]


def test_every_variant_of_both_blocks_is_reported_with_the_gradients_of_no_checkpointing(run):
    result, lines = run
    for kind in ("tp", "sp"):
        assert tuple(result[kind]) == tp.VARIANTS
        assert all(r["grad_diff"] == 0.0 for r in result[kind].values())
        assert all(r["held"] > 0 and r["step_s"] > 0 for r in result[kind].values())
    assert any(line.startswith("recompute_all") for line in lines)


def test_tracedac_issues_the_backward_collectives_of_no_checkpointing_and_torch_issues_more(run):
    result, _ = run
    for kind in ("tp", "sp"):
        rows = result[kind]
        for variant in ("recompute_all", "save_matmuls", "memory_budget(0.5)"):
            assert rows[variant]["backward"] == rows["none"]["backward"], (kind, variant)
            assert rows[variant]["forward"] == rows["none"]["forward"], (kind, variant)
    gathers = lambda row: sum(n for op, n in row["backward"].items() if "all_gather" in op)  # noqa: E731
    assert gathers(result["sp"]["torch checkpoint"]) > gathers(result["sp"]["none"])
    # replayed on request: gathered again, as torch's checkpoint does
    assert gathers(result["sp"]["replay_collectives(recompute_all)"]) > gathers(result["sp"]["none"])
