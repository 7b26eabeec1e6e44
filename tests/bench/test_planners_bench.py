"""The planner benchmark in --quick mode: its figures are all there and say what memory_budget promises."""

from __future__ import annotations

import pytest
import torch

from benchmarks import planners
from benchmarks.__main__ import main

pytestmark = pytest.mark.slow  # the quick loop (pytest -m "not slow") leaves this file out


@pytest.fixture(scope="module")
def quick():
    """One --quick run without torch.compile, shared by the tests that read its figures.

    torch.compile's side is tested on its own below: its compiles take most of a quick run.
    One thread: on a loaded machine idle OpenMP workers spin and stretch seconds into minutes.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # system_malloc: leave glibc as it is for the rest of the test process
        yield planners.run(quick=True, steps=1, progress=None, system_malloc=True, compare_torch=False)
    finally:
        torch.set_num_threads(threads)


def budget_rows(result) -> list[dict]:
    return [r for r in result["tracedac_rows"] if r["budget"] is not None]


def test_every_row_reports_bytes_kept_replay_flops_and_step_time(quick):
    assert [r["key"] for r in quick["tracedac_rows"]] == [
        "none",
        "save_all",
        "recompute_all",
        *(f"budget_{b:.2f}" for b in planners.QUICK_BUDGETS),
    ]
    for row in quick["tracedac_rows"]:
        assert row["status"] == "ok", row["status"]
        assert row["bytes_kept"] > 0 and row["tensor_bytes"] >= 0 and row["python_bytes"] >= 0
        assert row["replay_flops"] >= 0
        assert len(row["step_times_s"]) == quick["steps"] and row["step_s"] > 0
    by = {r["key"]: r for r in quick["tracedac_rows"]}
    assert by["none"]["replay_flops"] == by["save_all"]["replay_flops"] == 0
    assert by["recompute_all"]["replay_flops"] > 0


def test_each_budget_row_keeps_no_more_tensor_bytes_than_its_budget(quick):
    """The promise of memory_budget(b): at most b x what the regions keep without checkpointing."""
    slack = planners.TENSOR_SLACK_PER_REGION * planners.QUICK.layers
    for row in budget_rows(quick):
        assert row["tensor_bytes"] <= row["budget"] * row["full_tensor_bytes"] + slack, row["label"]


def test_each_budget_row_keeps_no_more_allocator_bytes_than_its_budget_and_the_bookkeeping_slack(quick):
    slack = planners.SLACK_PER_REGION * planners.QUICK.layers
    for row in budget_rows(quick):
        assert row["bytes_kept"] <= row["budget_bytes"] + slack, row["label"]


def test_replay_flops_counted_from_outside_equal_the_library_s_own(quick):
    """trade_off's replay_flops is what a user plans with; FlopCounterMode is what backward ran."""
    for row in budget_rows(quick):
        assert row["replay_flops"] == row["lib_replay_flops"], row["label"]


def test_more_budget_never_means_more_replay_flops(quick):
    rows = sorted(budget_rows(quick), key=lambda r: r["budget"])
    flops = [r["replay_flops"] for r in rows]
    assert flops == sorted(flops, reverse=True)
    assert rows[-1]["replay_flops"] == 0  # budget 1.0 keeps what no checkpoint keeps


def test_from_the_second_step_the_forward_peak_is_below_the_no_checkpoint_peak(quick):
    """Plans are cached by the graph's structure: later steps decide at record time."""
    peaks = quick["peaks"]
    assert len(peaks["budget"]["peaks"]) >= 2
    assert max(peaks["budget"]["peaks"][1:]) < min(peaks["none"]["peaks"])
    assert peaks["check"]["passed"] is True


def test_the_figures_have_every_key_and_the_report_marks_every_check(quick):
    assert {
        "config",
        "budgets",
        "planner",
        "library",
        "probe",
        "torch_backend",
        "tracedac_rows",
        "torch_rows",
        "peaks",
        "checks",
        "slack_per_region",
        "tensor_slack_per_region",
        "wall_s",
    } <= quick.keys()
    assert quick["torch_rows"] == "not asked for (compare_torch=False)"
    text = planners.format_report(quick)
    assert text.count("  met  ") + text.count("  missed  ") + text.count("  n/a  ") == len(quick["checks"])
    decided = [c["passed"] for c in quick["checks"] if c["passed"] is not None]
    assert f"overall: {sum(decided)} of {len(decided)} goals met" in text
    assert "not run: not asked for" in text


def test_torch_compile_saves_what_the_profiler_sees_and_recomputes_more_at_a_lower_budget():
    """Two independent measures of torch's bytes (saved_tensors_hooks, allocation events) agree."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = planners._measure_torch(planners.QUICK, (0.0, 1.0), 1, torch.device("cpu"), lambda _: None)
    finally:
        torch.set_num_threads(threads)
    low, high = rows["0.00"], rows["1.00"]
    for row in (low, high):
        assert row["bytes_saved"] == row["tensor_bytes"]
        assert len(row["step_times_s"]) == 1
    assert low["bytes_saved"] < high["bytes_saved"]
    assert low["recomputed_ops"] > high["recomputed_ops"]
    assert low["recompute_flops"] > high["recompute_flops"] == 0


def test_the_cli_refuses_a_run_without_timed_steps(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--planners", "--steps", "0"])
    assert exit.value.code == 2
    assert "steps must be at least 1" in capsys.readouterr().err


def test_torch_is_compared_with_tracedac_at_its_own_bytes_and_tracedac_must_keep_no_more():
    """The target: no more replay FLOPs than torch at equal or fewer bytes kept."""
    slack = planners.TENSOR_SLACK_PER_REGION * planners.QUICK.layers
    torch_rows = [{"budget": 0.5, "tensor_bytes": 10 << 20, "recompute_flops": 100}]

    def verdict(tensor_bytes, replay_flops):
        row = {
            "key": "match_0.50",
            "label": "memory_budget(5242880) [torch 0.5]",
            "status": "ok",
            "tensor_bytes": tensor_bytes,
            "replay_flops": replay_flops,
        }
        (check,) = planners._checks(planners.QUICK, [row], torch_rows)
        return check["passed"]

    assert verdict(10 << 20, 100)
    assert verdict((10 << 20) + slack, 0)
    assert not verdict((10 << 20) + slack + 1, 0)  # fewer FLOPs, but more bytes than torch
    assert not verdict(5 << 20, 101)
