"""python -m benchmarks --profile: the breakdown names what tracedac adds to each half."""

from __future__ import annotations

import torch

from benchmarks import checkpointing, profile
from benchmarks.__main__ import main


def test_the_profile_separates_the_recorder_and_the_replay_passes(capsys):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        r = profile.run(checkpointing.QUICK)
    finally:
        torch.set_num_threads(threads)
    plain, traced = r["plain"], r["tracedac"]
    # the plain model runs no dispatch mode and no replay; tracedac's forward runs every
    # op of each block through its recorder, and its backward one replay pass per block
    assert plain["forward"]["mode_calls"] == plain["backward"]["replay_passes"] == 0
    assert traced["forward"]["mode_calls"] > 0 and traced["backward"]["mode_calls"] == 0
    assert traced["backward"]["replay_passes"] == checkpointing.QUICK.layers
    assert 0 < traced["backward"]["replay_s"] < traced["backward"]["wall_s"]
    for run in (plain, traced):
        for half in run.values():
            assert 0 < half["op_s"] < half["wall_s"]
            assert half["top"] and half["top"][0]["op"].startswith("aten::")
    text = profile.format_report(r)
    assert "| tracedac | backward |" in text and "ops with most self CPU time" in text
    # the floors: the forward alone under each way, timed (on the CPU host and wall coincide)
    assert [k for k, _, _ in profile.FLOORS] == list(r["floors"])
    for key, times in r["floors"].items():
        assert 0 < times["host_s"] <= times["wall_s"], key
    assert "| LeastRecorder (least a recorder in Python does) |" in text
    assert f"for each of its {traced['forward']['mode_calls']} recorded ops" in text


def test_the_cli_prints_the_llama_profile(capsys):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["--profile", "--llama", "--quick"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "| plain | forward |" in out and "'mlp_hidden': 64" in out  # the tiny Llama's config
