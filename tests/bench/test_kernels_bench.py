"""The kernel benchmark runs on CPU and reports figures that make sense."""

import json
import math

import pytest
import torch

from benchmarks.kernels import (
    QUICK_SWEEP_HIDDEN,
    SWEEP_HIDDEN,
    block_shapes,
    format_table,
    intermediate_for,
    run,
    sweep_hidden,
)


@pytest.fixture(scope="module")
def quick_result():
    """One quick run (a few seconds) for every test here."""
    return run(quick=True)


def test_quick_kernel_benchmark_reports_every_way_with_sane_figures(quick_result):
    """CI runs the quick variant; the figures must be present, positive, consistent with each
    other, JSON-able, and the three ways must agree bit for bit."""
    result = quick_result
    json.dumps(result)
    unit = result["unit"]
    assert unit["elements"] == sum(math.prod(s) for s in block_shapes(unit["hidden"], unit["intermediate"]))
    # the cast reads each fp32 element once and writes it once as bf16
    assert unit["bytes_moved"] == unit["elements"] * (torch.float32.itemsize + torch.bfloat16.itemsize)
    assert result["bit_identical"] is True
    methods = result["methods"]
    assert set(methods) == {"pack_cast", "to + cat", "FSDP2"}
    assert all(figures["median_ms"] > 0 for figures in methods.values())
    # the same bytes for every way: the faster way has the higher bandwidth
    by_time = sorted(methods, key=lambda m: methods[m]["median_ms"])
    by_bandwidth = sorted(methods, key=lambda m: -methods[m]["gb_per_s"])
    assert by_time == by_bandwidth
    assert methods["pack_cast"]["time_vs_pack_cast"] == 1.0
    if torch.cuda.is_available():
        assert result["backend"] == "triton" and result["pack_cast_kernels_per_call"] == 1
    else:
        assert result["backend"] == "torch" and result["pack_cast_kernels_per_call"] is None
    out = format_table(result)
    assert "GB/s" in out and "FSDP2" in out


def test_quick_kernel_benchmark_sweeps_sizes_and_checks_every_one(quick_result):
    """The size sweeps (pack_cast against FSDP2's copy-in and a copy of the same bytes;
    accumulate_ against add_) report every figure at every size, checked bit for bit, and the
    fixed cost per call; on CPU the Triton goals are undecided, not missed."""
    result = quick_result
    sweep = result["sweep"]
    json.dumps(sweep)
    hiddens = [u["hidden"] for u in sweep["pack_cast"]]
    assert tuple(hiddens) == QUICK_SWEEP_HIDDEN
    assert [u["elements"] for u in sweep["accumulate_"]] == [u["elements"] for u in sweep["pack_cast"]]
    for u in sweep["pack_cast"]:
        assert u["intermediate"] == intermediate_for(u["hidden"])
        assert u["elements"] == sum(math.prod(s) for s in block_shapes(u["hidden"], u["intermediate"]))
        assert u["bytes_moved"] == u["elements"] * 6
        assert u["bit_identical"] is True
        assert set(u["methods"]) == {"pack_cast", "FSDP2", "copy"}
        assert u["methods"]["pack_cast"]["time_vs_pack_cast"] == 1.0
    for u in sweep["accumulate_"]:
        assert u["bytes_moved"] == u["elements"] * (4 + 2 + 4)  # fp32 read and written, bf16 read
        assert u["bit_identical"] is True
        assert set(u["methods"]) == {"accumulate_", "add_"}
        assert u["methods"]["accumulate_"]["time_vs_accumulate_"] == 1.0
    for u in sweep["pack_cast"] + sweep["accumulate_"]:
        for m in u["methods"].values():
            assert m["median_ms"] > 0 and m["gb_per_s"] > 0
            assert math.isclose(m["gb_per_s"], u["bytes_moved"] / (m["median_ms"] / 1e3) / 1e9)
            if torch.cuda.is_available():
                assert m["fraction_of_copy_bandwidth"] > 0
            else:
                assert m["fraction_of_copy_bandwidth"] is None
    fixed = sweep["fixed_cost"]
    assert fixed["elements"] == sweep["pack_cast"][0]["elements"]
    assert fixed["pack_cast_ms"] == sweep["pack_cast"][0]["methods"]["pack_cast"]["median_ms"]
    assert set(fixed["host_us_per_call"]) == {"pack_cast", "FSDP2", "copy", "accumulate_", "add_"}
    assert all(us > 0 for us in fixed["host_us_per_call"].values())
    assert len(result["targets"]) == 2
    if torch.cuda.is_available():
        assert result["accumulate_kernels_per_call"] == 1
        assert result["targets"][0]["passed"] in (True, False)
        assert result["targets"][1]["passed"] is None  # no quick unit is of 64 MiB
    else:
        assert result["accumulate_kernels_per_call"] is None
        assert all(t["passed"] is None for t in result["targets"])
    out = format_table(result)
    assert "size sweep" in out and "accumulate_ sweep" in out and "fixed cost per call" in out


def test_sweep_sizes_span_half_a_million_to_a_hundred_million_elements():
    """Llama-style blocks of about 0.5M, 2M, 8M, 25M, 50M (the hidden-2048 block) and 100M
    elements; on CPU only the small ones run, and the run says so."""
    assert intermediate_for(2048) == 5632
    elements = [sum(math.prod(s) for s in block_shapes(h, intermediate_for(h))) for h in SWEEP_HIDDEN]
    for n, about in zip(elements, [0.5e6, 2e6, 8e6, 25e6, 50e6, 100e6]):
        assert 0.85 * about <= n <= 1.15 * about
    assert sweep_hidden(quick=False, on_gpu=True) == (SWEEP_HIDDEN, None)
    assert sweep_hidden(quick=True, on_gpu=True) == (QUICK_SWEEP_HIDDEN, None)
    kept, note = sweep_hidden(quick=False, on_gpu=False)
    assert kept == SWEEP_HIDDEN[:3] and "CUDA" in note
