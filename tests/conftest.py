"""Fixtures shared by the test folders."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

# A child that crashes (a rank, a benchmark run) prints its Python stack before it dies, so a
# test that fails with a signal says where: every process the suite starts inherits this.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")
# Inductor compiles in the process that asks (no pool of compile workers): by default it starts
# a worker per core in every process that compiles, each importing torch, for the small graphs
# the tests compile. On the 16-core GPU machine (run 4, 2026-11-27) the suite under pytest-xdist
# had up to 13 workers each running tests/zero/test_tp.py's four compiling ranks (xdist's default
# scheduling hands a module's tests to several workers, each running its module fixture:
# tools/gpu_session.sh now passes --dist loadscope), each rank with a pool of one per core.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


@pytest.fixture
def host_copies(monkeypatch) -> list:
    """Every ``tracedac.offload.host.HostCopy`` made during the test, in order (``nbytes``: its size)."""
    from tracedac.offload import host as offload

    made = []
    init = offload.HostCopy.__init__

    def track(copy, *args):
        init(copy, *args)
        made.append(copy)

    monkeypatch.setattr(offload.HostCopy, "__init__", track)
    return made


@pytest.fixture
def world1(tmp_path):
    """A world-1 gloo process group in this process (file init), destroyed after the test."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
