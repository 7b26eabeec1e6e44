"""``--fsdp2 --quick`` on two ranks: it runs, and its rows say what they claim.

The benchmark starts its own two rank processes (a file rendezvous in a temporary directory,
a timeout on the launch); quick, once, checks and timing in the same ranks. One run serves
every test.
"""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest
import torch

from benchmarks import fsdp2
from benchmarks.__main__ import main

pytestmark = pytest.mark.slow  # the quick loop (pytest -m "not slow") leaves this file out


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """(figures from --json, the printed report) of one ``--fsdp2 --quick --steps 1`` run."""
    path = tmp_path_factory.mktemp("fsdp2") / "figures.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["--fsdp2", "--quick", "--quiet", "--steps", "1", "--json", str(path)]) == 0
    return json.loads(path.read_text()), out.getvalue()


def rows(figures) -> dict:
    return {r["key"]: r for r in figures["variants"]}


def test_every_variant_has_a_row_with_finite_figures_and_ratios_to_its_torch_row(quick):
    figures, text = quick
    assert [r["key"] for r in figures["variants"]] == [v.key for v in fsdp2.VARIANTS]
    assert figures["world_size"] == 2
    for row in figures["variants"]:
        assert row["label"] in text
        assert len(row["step_times_s"]) == figures["steps"] == 1
        assert math.isfinite(row["step_s"]) and row["step_s"] > 0
        assert row["bytes_held"] > 0 and len(row["bytes_held_per_rank"]) == 2
        assert row["block_bytes"] > 0
        if row["key"].startswith("tracedac"):
            assert row["held_vs_torch"] > 0 and row["step_vs_torch"] > 0, row
            assert f"{row['held_vs_torch']:.2f}x" in text


def test_tracedac_rows_give_the_gradients_of_no_checkpoint_and_count_each_token_once(quick):
    """The router counts its tokens in a buffer: once a step under tracedac (and without
    checkpointing), twice under torch's checkpoint, which runs each block's Python again;
    dropout replays the same numbers, so the gradients are those of no checkpoint."""
    by = rows(quick[0])
    for key, row in by.items():
        expected = 2.0 if key.startswith("torch") else 1.0
        assert row["router_counts_per_routed"] == expected, (key, row["router_counts_per_routed"])
        if key.startswith("tracedac"):
            assert row["max_grad_diff"] == 0.0, (key, row["max_grad_diff"])


def test_each_goal_is_printed_with_its_verdict(quick):
    figures, text = quick
    if "goals not scored" in text:  # a loaded machine: the figures printed unscored, each marked unsure
        for t in figures["targets"]:
            (line,) = [line for line in text.splitlines() if f"{t['name']}:" in line]
            assert line.startswith("  unsure "), line
        figures = {**figures, "load_average_before": 0.0, "sanity": []}
        text = fsdp2.format_report(figures)
    assert len(figures["targets"]) == 3
    for t in figures["targets"]:
        (line,) = [line for line in text.splitlines() if f"{t['name']}:" in line]
        assert line.startswith({True: "  met ", False: "  missed ", None: "  n/a "}[t["passed"]]), line


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--fsdp2", "--quick", "--ranks", "1"], "at least 2 for FSDP2 to shard anything"),
        (["--fsdp2", "--batch", "3"], "do not split into 2 ranks' equal shares"),
        (["--ranks", "2"], "--ranks is for --ep and --fsdp2"),
        pytest.param(
            ["--fsdp2", "--quick", "--device", "cuda"],
            "no CUDA device is visible here",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible"),
        ),
    ],
)
def test_settings_that_cannot_run_are_refused_before_any_rank_starts(capsys, argv, message):
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    assert message in capsys.readouterr().err
