"""``--zero`` on two ranks in --quick mode: it runs, and its figures are there and agree.

The ranks are two processes started here with a file-based rendezvous in a temporary
directory (no port to collide with), each under a hard timeout so that a rank stuck in a
collective fails the test instead of hanging CI.
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
import time

import pytest

from benchmarks import zero
from benchmarks.__main__ import main
from benchmarks.child import ROOT

pytestmark = pytest.mark.slow  # the quick loop (pytest -m "not slow") leaves this file out

TIMEOUT_S = 120
ALWAYS = ("replicated", "tracedac_fp32", "fsdp2_fp32", "tracedac_bf16", "tracedac_auto", "fsdp2_bf16")


def _two_ranks(tmp, *flags, timeout=TIMEOUT_S):
    """``python -m benchmarks --zero --quick *flags`` on 2 ranks: (figures from --json,
    rank 0's and rank 1's stdout)."""
    figures = tmp / "figures.json"
    procs, logs = [], []
    for rank in range(2):
        # One thread per rank, as torchrun sets it: two ranks share this machine's cores.
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE="2",
            OMP_NUM_THREADS="1",
        )
        out, err = (
            open(tmp / f"rank{rank}.out", "w+"),
            open(tmp / f"rank{rank}.err", "w+"),
        )  # files: no pipe to fill
        logs.append((out, err))
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "benchmarks",
                    "--zero",
                    "--quick",
                    *flags,
                    "--init-method",
                    f"file://{tmp / 'init'}",
                    "--json",
                    str(figures),
                ],
                env=env,
                stdout=out,
                stderr=err,
                text=True,
                cwd=ROOT,  # benchmarks/ is not installed
            )
        )
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    texts = []
    for (out, err), p in zip(logs, procs):
        out.seek(0), err.seek(0)
        texts.append((out.read(), err.read()))
        out.close(), err.close()
    for rank, (p, (_, err)) in enumerate(zip(procs, texts)):
        assert p.returncode == 0, (
            f"rank {rank} exited with {p.returncode} (killed after {timeout} s if -9):\n{err[-3000:]}"
        )
    # A finished run removes its file rendezvous: torch leaves it behind, and a second run
    # given the same path would fail to connect (benchmarks.child.leave_ranks).
    assert not (tmp / "init").exists()
    return json.loads(figures.read_text()), texts[0][0], texts[1][0]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One ``--zero --quick`` run on 2 ranks."""
    return _two_ranks(tmp_path_factory.mktemp("zero"))


@pytest.fixture(scope="module")
def quick_compiled(tmp_path_factory):
    """One ``--zero --compile --quick`` run on 2 ranks (most of it torch.compile)."""
    return _two_ranks(tmp_path_factory.mktemp("zero_compiled"), "--compile", timeout=400)


def rows(figures) -> dict:
    return {r["key"]: r for r in figures["variants"]}


def test_rank_0_prints_the_table_and_the_other_rank_stays_quiet(quick):
    _, rank0, rank1 = quick
    assert ("goals (" in rank0 or "goals not scored" in rank0) and "FSDP2 bf16" in rank0
    assert rank1 == ""


def test_the_json_has_every_figure(quick):
    figures, _, _ = quick
    assert {
        "config",
        "steps",
        "world_size",
        "units",
        "variants",
        "targets",
        "wall_s",
        "torch",
    } <= figures.keys()
    assert figures["world_size"] == 2
    for row in figures["variants"]:
        assert {"key", "label", "library", "precision", "status"} <= row.keys()
        if row["status"] == "ok":
            assert {
                "step_s",
                "step_times_s",
                "step_vs_fsdp2",
                "bytes_held",
                "bytes_fixed",
                "full_unit_held",
                "all_gather_bytes",
                "all_gather_calls",
                "loss",
                "loss_diff",
            } <= row.keys()


def test_every_variant_runs_or_says_why_not_and_its_numbers_are_finite(quick):
    figures, _, _ = quick
    by = rows(figures)
    for key in ALWAYS:
        assert by[key]["status"] == "ok", (key, by[key]["status"])
    for row in figures["variants"]:
        if row["status"] != "ok":
            # DeepSpeed is optional; when absent or broken the row says so and the rest runs.
            assert row["library"] == "deepspeed" and row["status"].startswith(("not installed", "failed")), (
                row
            )
            continue
        assert len(row["step_times_s"]) == figures["steps"]
        for value in (row["step_s"], row["bytes_held"], row["bytes_fixed"], row["loss"], row["loss_diff"]):
            assert math.isfinite(value)
        assert row["step_s"] > 0 and row["bytes_held"] > 0
    assert by["fsdp2_fp32"]["step_vs_fsdp2"] == by["fsdp2_bf16"]["step_vs_fsdp2"] == 1.0


def test_losses_agree_with_the_replicated_run(quick):
    """Sharding must not change the training: fp32 ZeRO-3 is the replicated run up to
    reduction order; bf16 (and DeepSpeed, whose optimizer wrapper differs) stay close."""
    by = rows(quick[0])
    for key in ("tracedac_fp32", "fsdp2_fp32"):
        assert by[key]["loss_diff"] <= 1e-4, key
    for row in quick[0]["variants"]:
        if row["status"] == "ok":
            assert row["loss_diff"] <= 0.05, row["key"]


def test_the_all_gathers_of_every_sharded_variant_are_counted_including_inside_custom_ops(quick):
    """tracedac's all-gathers run inside torch.library ops, which a dispatch mode does not
    enter by itself; every parameter is gathered at least once per step."""
    figures = quick[0]
    param_bytes = 4 * sum(figures["units"].values())
    by = rows(figures)
    assert by["replicated"]["all_gather_bytes"] == {}
    for key in ("tracedac_fp32", "fsdp2_fp32"):
        assert by[key]["all_gather_bytes"]["float32"] >= param_bytes, key


def test_bf16_all_gathers_move_at_most_0_55x_the_bytes_of_fp32(quick):
    by = rows(quick[0])
    for library in ("tracedac", "fsdp2"):
        fp32 = by[f"{library}_fp32"]["all_gather_bytes_total"]
        assert by[f"{library}_bf16"]["all_gather_bytes_total"] <= 0.55 * fp32, library
    target = next(t for t in quick[0]["targets"] if "bf16 / fp32" in t["name"])
    assert target["passed"] is True


def test_each_target_is_reported_with_its_value_and_verdict(quick):
    figures = {**quick[0], "load_average_before": 0.0}  # as a quiet machine: scored
    text = zero.format_report(figures)
    verdicts = [line for line in text.splitlines() if line.startswith(("  met ", "  missed ", "  n/a "))]
    assert len(verdicts) == len(figures["targets"])
    for target in figures["targets"]:
        (line,) = [line for line in verdicts if f"{target['name']}:" in line]
        assert line.startswith({True: "  met ", False: "  missed ", None: "  n/a "}[target["passed"]]), line


def test_without_torchrun_the_cli_says_how_to_run_it(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as exit:
        main(["--zero", "--quick"])
    assert exit.value.code == 2
    assert "torchrun --nproc-per-node 2 -m benchmarks --zero" in capsys.readouterr().err


def test_a_missing_deepspeed_shows_as_not_installed_and_the_rest_still_reports(quick):
    figures = copy.deepcopy(quick[0])
    for i, row in enumerate(figures["variants"]):
        if row["library"] == "deepspeed":
            figures["variants"][i] = {k: row[k] for k in ("key", "label", "library", "precision")}
            figures["variants"][i]["status"] = "not installed (pip install deepspeed)"
    figures["load_average_before"] = 0.0  # as a quiet machine: scored
    text = zero.format_report(figures)
    line = next(line for line in text.splitlines() if line.startswith("DeepSpeed ZeRO-3 bf16"))
    assert "not installed" in line
    assert "tracedac.zero bf16" in text and "goals (" in text


def test_zero_compile_runs_tracedac_and_fsdp2_compiled_with_no_graph_break_and_equal_losses(quick_compiled):
    figures, rank0, _ = quick_compiled
    by = rows(figures)
    assert figures["compiled"] and "vs FSDP2 compiled" in rank0
    assert list(by) == [
        "replicated",
        "tracedac_fp32",
        "tracedacc_fp32",
        "fsdp2c_fp32",
        "tracedac_bf16",
        "tracedacc_bf16",
        "fsdp2ca_bf16",
        "fsdp2c_bf16",
        "tracedacc_bf16_unchecked",
    ]
    assert all(r["status"] == "ok" for r in by.values()), {k: r["status"] for k, r in by.items()}
    assert by["tracedacc_fp32"]["graph_breaks"] == 0 and by["tracedacc_bf16"]["graph_breaks"] == 0
    # no dropout in this mode: every fp32 row trains the replicated run's losses
    for key in ("tracedac_fp32", "tracedacc_fp32", "fsdp2c_fp32"):
        assert by[key]["loss_diff"] < 1e-4, (key, by[key]["loss_diff"])
    # the bytes are counted from the process group's calls inside the compiled graphs too
    assert (
        by["tracedacc_fp32"]["all_gather_bytes"]["float32"]
        == by["tracedac_fp32"]["all_gather_bytes"]["float32"]
    )
    assert by["fsdp2c_bf16"]["all_gather_bytes"].get("bfloat16", 0) > 0
    # the bf16 "auto" rows are measured against FSDP2 under the same autocast: same gathers as
    # FSDP2's all-bf16 row, a computation closer to tracedac's (its loss nearer the bf16 auto one)
    assert by["fsdp2ca_bf16"]["all_gather_bytes"] == by["fsdp2c_bf16"]["all_gather_bytes"]
    for key in ("tracedac_bf16", "tracedacc_bf16", "tracedacc_bf16_unchecked"):
        assert by[key]["step_vs_fsdp2"] == pytest.approx(by[key]["step_s"] / by["fsdp2ca_bf16"]["step_s"])
    # "auto", compiled: the gather-cast pass puts the Linear and expert weights on the wire in
    # bf16, about half the fp32 row's bytes (with two ranks a unit's groups go as one all-gather
    # of bytes, its dtypes unseen from outside: the total says it)
    auto = by["tracedacc_bf16"]["all_gather_bytes"]
    wire = {k: v for k, v in auto.items() if k != "int64"}
    assert sum(wire.values()) < 0.55 * by["tracedacc_fp32"]["all_gather_bytes"]["float32"], auto
    # the measurement row: the same gathers, none of the order checks' int64 rows
    unchecked = by["tracedacc_bf16_unchecked"]["all_gather_bytes"]
    assert auto.get("int64", 0) > 0 and "int64" not in unchecked, (auto, unchecked)
    assert unchecked == wire
    # no doubled-batch reading for compiled rows (a new shape compiles new graphs): "-", "n/a"
    assert by["tracedacc_fp32"]["bytes_fixed"] is None and by["tracedacc_fp32"]["full_unit_held"] is None
    assert by["tracedac_fp32"]["bytes_fixed"] is not None
    names = [t["name"] for t in figures["targets"]]
    assert "tracedac.zero compiled fp32 step / FSDP2 compiled fp32" in names
    assert "graph breaks, tracedac.zero compiled (checkpointed MoE)" in names


# --- --device cuda: what can be checked without a GPU (the GPU run itself is by hand) ---


def test_zero_cuda_without_a_gpu_says_none_is_visible(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as exit:
        main(["--zero", "--quick", "--device", "cuda"])
    assert exit.value.code == 2
    assert zero.NO_CUDA in capsys.readouterr().err


def test_zero_cuda_picks_the_rank_s_device(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert zero.rank_device("cuda") == torch.device("cuda", 0)
    assert zero.rank_device("cuda:1") == torch.device("cuda", 1)
    assert zero.rank_device("cuda:0", 1) == torch.device("cuda", 1)  # under torchrun: LOCAL_RANK
    assert zero.rank_device("cpu", 1) == torch.device("cpu")
    for args in (("cuda:2",), ("cuda", 2), ("mps",), ("gpu",)):
        with pytest.raises(ValueError):
            zero.rank_device(*args)


def test_zero_cuda_runs_a_world_of_one_on_nccl_bound_to_the_device(monkeypatch):
    import torch
    import torch.distributed as dist

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    zero.check_settings(zero.QUICK, 1, "cuda:0", 1)  # one rank: fine on CUDA
    with pytest.raises(ValueError, match="shards nothing"):
        zero.check_settings(zero.QUICK, 1, "cpu", 1)  # and still refused on CPU
    got = {}
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: got.update(current=d))
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: got.update(backend=a[0], **k))
    rendezvous = zero.one_process_rendezvous()
    try:
        assert rendezvous.startswith("file://") and os.path.getsize(rendezvous[len("file://") :]) == 0
        assert zero.init(rendezvous, device=torch.device("cuda", 0), rank=0, world=1) == 0
    finally:
        os.unlink(rendezvous[len("file://") :])
    cuda0 = torch.device("cuda", 0)
    assert got["backend"] == "nccl" and got["device_id"] == cuda0 and got["current"] == cuda0
    assert (got["rank"], got["world_size"], got["init_method"]) == (0, 1, rendezvous)


def test_a_cuda_run_reports_its_device_and_each_row_s_peak(quick):
    figures = copy.deepcopy(quick[0])
    figures.update(world_size=1, backend="nccl", device="cuda:0", device_name="NVIDIA H100", cuda="13.0")
    for i, row in enumerate(figures["variants"]):
        if row["status"] == "ok":
            row.update(peak_bytes=2**30, peak_step_bytes=(i + 1) << 20)
    text = zero.format_report(figures)
    assert "1 rank (nccl, NVIDIA H100)" in text and "cuda 13.0" in text
    header = next(line for line in text.splitlines() if line.startswith("variant"))
    assert "held after fwd" in header and "peak over step" in header
    assert "2.00 MiB" in next(line for line in text.splitlines() if line.startswith("tracedac.zero fp32"))
    assert "peak over step" not in zero.format_report(quick[0])  # CPU: the table as before
