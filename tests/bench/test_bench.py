"""The main benchmark in --quick mode: its figures are all there and say what tracedac promises."""

from __future__ import annotations

import collections
import copy
import json
import os
import subprocess
import sys

import pytest
import torch

import tracedac
from benchmarks import checkpointing, floors, probe
from benchmarks.__main__ import main
from benchmarks.child import ROOT, SETTLE_LIMIT, learning, settle
from benchmarks.model import GPT, make_batch
from tracedac.region import reporting

pytestmark = pytest.mark.slow  # the quick loop (pytest -m "not slow") leaves this file out

TRACEDAC = ("tracedac_recompute_all", "tracedac_save_matmuls")


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """One ``python -m benchmarks --quick --json`` run: its figures read back, and what it
    printed. Shared by the tests that read its figures and the test of the command itself.

    Its timings mean nothing, so it runs on one thread: on a loaded machine idle OpenMP
    workers spin and turn a tiny model's seconds into a minute.
    """
    path = tmp_path_factory.mktemp("quick") / "figures.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--json", str(path)],
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,  # benchmarks/ is not installed
    )
    assert done.returncode == 0, done.stderr
    return json.loads(path.read_text()), done


@pytest.fixture(scope="module")
def quick(cli):
    """The figures of the one --quick run."""
    return cli[0]


def rows(result) -> dict:
    return {r["key"]: r for r in result["variants"]}


def test_every_variant_reports_time_memory_gradient_difference_and_tokens(quick):
    assert [r["key"] for r in quick["variants"]] == [
        "none",
        "torch",
        "torch_sac",
        "torch_remat",
        *TRACEDAC,
    ]
    for row in quick["variants"]:
        if row["status"] != "ok":
            assert row["key"] == "torch_remat" and row["status"] == "not installed"
            continue
        assert len(row["step_times_s"]) == quick["steps"]
        assert row["step_s"] > 0 and row["step_vs_none"] > 0
        assert 0 < row["forward_s"] < max(row["step_times_s"])  # parts of the step
        assert 0 < row["backward_s"] < max(row["step_times_s"])
        assert row["bytes_held"] > 0
        assert row["tokens_counted"] > 0
    assert rows(quick)["none"]["step_vs_none"] == 1.0
    tracing = quick["tracing"]
    for key in ("plain", "empty_mode", "least_recorder", "traced"):
        times = tracing[f"{key}_times_s"]
        assert len(times) == tracing["forwards"] == quick["steps"]
        assert 0 < min(times) <= tracing[f"{key}_forward_s"] <= max(times)  # a statistic of its own forwards
    for key in ("empty_mode", "least_recorder", "traced"):
        ratio = tracing["ratio" if key == "traced" else f"{key}_ratio"]
        assert (ratio < 1) == (
            tracing[f"{key}_forward_s"] < tracing["plain_forward_s"]
        )  # over the plain forward


def test_the_untimed_steps_are_reported_and_only_tracedac_takes_more_than_one(quick):
    """How many untimed steps each variant ran before its timed ones (``child.settle``): one,
    and for tracedac's as many as its warm path took to settle (on the quick model's two MoE
    blocks the routing may repeat by chance, so how many is the model's business)."""
    assert all(r["untimed_steps"] == 1 for r in quick["variants"] if not r["tracedac"])
    assert all(1 <= rows(quick)[k]["untimed_steps"] <= 1 + SETTLE_LIMIT for k in TRACEDAC)
    assert 1 <= quick["tracing"]["untimed_traced"] <= 1 + SETTLE_LIMIT


class _Changing(torch.nn.Module):
    """A block whose structure changes at every call (a slice that grows), as an MoE block's
    does with its routing; its inputs' shapes stay, so every call finds its template. Blocks
    started at different ``calls`` never run alike in one step (blocks that did would share
    a template from one step to the next: tracedac's regions of one class share a key)."""

    def __init__(self, calls: int = 0):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.calls = calls

    def forward(self, x):  # [16, 8]
        self.calls += 1
        return self.lin(x)[: 1 + self.calls % 15].tanh().sum()


def test_settle_runs_until_a_round_teaches_the_warm_path_nothing():
    """``settle`` stops at the first round that built no template and fell back from none: for
    blocks whose structure changes every call, once each records every call (later calls learn
    nothing either); for a block whose structure repeats, after its first round (it runs warm)."""
    x = torch.randn(16, 8)
    changing = [tracedac.checkpoint(_Changing(5 * i)) for i in range(3)]  # one class: one template first

    def step(key, i):
        for block in changing:
            block(x).backward()

    for block in changing:  # the first call, as the benchmark's one untimed step
        block(x).backward()
    assert 2 < settle(step, ["changing"]) < SETTLE_LIMIT
    before = learning()
    for i in range(4):
        step("changing", i)
    assert learning() == before

    repeating = tracedac.checkpoint(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()))
    repeating(x).sum().backward()
    assert settle(lambda key, i: repeating(x).sum().backward(), ["repeating"]) == 1
    fresh = tracedac.checkpoint(_Changing())
    fresh(x).backward()
    assert settle(lambda key, i: fresh(x).backward(), ["fresh"], limit=1) == 1  # never past the limit


def test_the_empty_mode_baseline_runs_the_blocks_ops_through_a_mode_and_changes_nothing(monkeypatch):
    cfg = checkpointing.QUICK
    model = GPT.seeded(cfg)
    batch = make_batch(cfg)
    torch.manual_seed(0)
    plain = model(*batch)
    seen = []
    run_op = floors.EmptyMode.__torch_dispatch__

    def counting(self, func, types, args=(), kwargs=None):
        seen.append(func)
        return run_op(self, func, types, args, kwargs)

    monkeypatch.setattr(floors.EmptyMode, "__torch_dispatch__", counting)
    model.checkpoint_fn = floors.under_empty_mode
    torch.manual_seed(0)
    assert torch.equal(model(*batch), plain)
    assert torch.ops.aten.mm.default in seen and torch.ops.aten.native_layer_norm.default in seen


def test_the_least_recorder_records_what_tracedac_records_of_a_block_and_changes_nothing(monkeypatch):
    """The floor must do the floor's work: every op tracedac records and every tensor
    autograd saves, each as a record that holds no tensor; and it must let go at the end."""
    cfg = checkpointing.QUICK
    block = GPT.seeded(cfg).blocks[0]
    x = torch.randn(cfg.batch, cfg.seq, cfg.dim, requires_grad=True)
    torch.manual_seed(0)
    plain = block(x)
    with reporting() as regions:  # report mode: the region's graph keeps every node
        torch.manual_seed(0)
        assert torch.equal(tracedac.checkpoint(copy.deepcopy(block))(x), plain)
    recorders = []
    monkeypatch.setattr(floors.LeastRecorder, "close", lambda recorder: recorders.append(recorder))
    torch.manual_seed(0)
    assert torch.equal(floors.under_least_recorder(block, x), plain)
    (recorder,), (region,) = recorders, regions
    recorded = collections.Counter(op for op, *_ in recorder.ops)
    assert recorded == collections.Counter(node.op for node in region.graph.nodes)
    assert len(recorder.saved) == len(region.handles) > 0
    records = [r for _, args, kwargs, outs in recorder.ops for r in [*args, *kwargs.values(), *outs]]
    assert not any(isinstance(r, torch.Tensor) for r in records + recorder.saved)
    monkeypatch.undo()
    recorder.close()
    assert recorder.pins == [] and recorder.storages == {}


def test_tracedac_gradients_equal_the_run_without_checkpointing(quick):
    """Dropout is on: replay must draw the forward's random numbers, or gradients drift."""
    for key in TRACEDAC:
        assert rows(quick)[key]["max_grad_diff"] <= 1e-6


def test_tracedac_counts_each_token_once_and_torch_checkpoint_counts_it_twice(quick):
    """The router's buffer update is Python in the forward; re-running the forward repeats it."""
    cfg = checkpointing.QUICK
    true = cfg.tokens * cfg.top_k * cfg.layers
    by = rows(quick)
    assert by["none"]["true_tokens"] == true
    assert by["none"]["tokens_counted"] == true
    for key in TRACEDAC:
        assert by[key]["tokens_counted"] == true
    assert by["torch"]["tokens_counted"] == 2 * true


def test_the_probe_sees_that_torch_checkpoint_holds_fewer_bytes_than_no_checkpoint(quick):
    """A probe that missed saved activations would make every memory figure meaningless.

    Only torch's is compared: on the quick model tracedac's recorded graph (Python objects,
    counted under PYTHONMALLOC=malloc) outweighs the few activations it saves.
    """
    by = rows(quick)
    assert by["torch"]["bytes_held"] < by["none"]["bytes_held"]


def _quiet(result: dict) -> dict:
    """``result`` as a quiet machine would have measured it: no load, no impossible figure."""
    result = copy.deepcopy(result)
    result["load_average_before"] = 0.0
    result["sanity"] = [{**s, "ok": True} for s in result["sanity"]]
    return result


def test_each_target_is_reported_with_its_value_limit_and_verdict(quick):
    names = [t["name"] for t in quick["targets"]]
    assert len(names) == 5
    text = checkpointing.format_report(_quiet(quick))
    lines = text.splitlines()
    for target in quick["targets"]:
        assert target["value"] > 0
        (line,) = [line for line in lines if f"{target['name']}:" in line]
        assert line.startswith("  met " if target["passed"] else "  missed "), line
        assert f"{target['value']:.3f}" in line and f"<= {target['limit']:.2f}" in line
    assert "FAIL" not in text and "PASS" not in text  # goals of one run, not a broken install
    assert "a missed goal is a figure, not an error" in text


def test_a_loaded_run_or_an_impossible_figure_leaves_the_goals_unscored(quick):
    """A user's first run on a loaded 2-core machine scored met/missed from timings where torch's
    selective checkpointing ran 0.82x no checkpointing and an empty dispatch mode 0.78x plain:
    figures no quiet machine gives. Such a run prints its figures and says why, unscored."""
    loaded = _quiet(quick)
    loaded["load_average_before"] = 1.5 * loaded["cpus"]
    impossible = _quiet(quick)
    impossible["sanity"] = checkpointing._sanity(
        [
            {"key": "none", "step_s": 1.0},
            {"key": "torch", "step_s": 1.2},
            {"key": "torch_sac", "step_s": 0.82},
        ],
        {"empty_mode_forward_s": 0.78, "plain_forward_s": 1.0},
    )
    for result, why in (
        (loaded, "load average"),
        (impossible, "torch selective step / no checkpoint: 0.82x"),
    ):
        text = checkpointing.format_report(result)
        assert "goals not scored: this run's timings are unreliable" in text and why in text, text
        goal_lines = [
            line for line in text.splitlines() if any(f"{t['name']}:" in line for t in quick["targets"])
        ]
        assert len(goal_lines) == 5 and all(line.startswith("  unsure ") for line in goal_lines), goal_lines
    assert "0.78x" in checkpointing.format_report(impossible)  # the empty mode's too
    assert "goals (" in checkpointing.format_report(_quiet(quick))


def test_targets_are_judged_from_the_rows_they_name():
    """Made-up rows with known ratios: tracedac 1.5x torch's step (fails <= 1.00), 3x no
    checkpoint (fails <= 1.40), the same bytes as torch's selective (passes <= 1.00), half
    its step time, and a traced forward 1.05x the plain one (passes <= 1.10)."""
    made_up = [
        {"key": "none", "step_s": 1.0},
        {"key": "torch", "step_s": 2.0},
        {"key": "torch_sac", "step_s": 1.0, "bytes_held": 100},
        {"key": "tracedac_recompute_all", "step_s": 3.0},
        {"key": "tracedac_save_matmuls", "step_s": 0.5, "bytes_held": 100},
    ]
    judged = [(t["value"], t["passed"]) for t in checkpointing._targets(made_up, {"dim": 64, "ratio": 1.05})]
    assert judged == [(1.5, False), (3.0, False), (1.0, True), (0.5, True), (1.05, True)]


def test_a_missing_torch_remat_shows_as_not_installed_and_the_rest_still_reports(quick):
    result = copy.deepcopy(quick)
    for i, row in enumerate(result["variants"]):
        if row["key"] == "torch_remat":
            result["variants"][i] = {k: row[k] for k in ("key", "label", "tracedac", "true_tokens")}
            result["variants"][i]["status"] = "not installed"
    text = checkpointing.format_report(result)
    assert "torch_remat" in text and "not installed" in text
    assert "tracedac save_matmuls" in text


def test_the_probe_sees_a_4_mib_tensor_at_the_allocator():
    before = probe.allocated_bytes()
    t = torch.ones(1 << 20)  # [1M] fp32: 4 MiB
    grown = probe.allocated_bytes() - before
    del t
    assert 4 << 20 <= grown < 5 << 20


def test_the_cli_writes_every_figure_as_json(cli):
    figures, done = cli
    assert {"config", "variants", "tracing", "targets", "wall_s"} <= figures.keys()
    scored = "goals (" in done.stdout and "a missed goal is a figure, not an error" in done.stdout
    assert scored or "goals not scored: this run's timings are unreliable" in done.stdout
    assert "[1/6]" in done.stderr  # progress goes to stderr


def test_the_cli_refuses_sizes_that_cannot_build_a_model(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--dim", "30", "--heads", "4"])
    assert exit.value.code == 2
    assert "dim=30 does not split into heads=4" in capsys.readouterr().err
