"""The allocator probe and the allocator setting the timings run with."""

import subprocess
import sys

import torch

from benchmarks import probe
from benchmarks.child import ROOT


def test_the_probe_sees_a_tensor_come_and_go():
    before = probe.allocated_bytes()
    t = torch.empty(1 << 20)  # 4 MiB
    during = probe.allocated_bytes()
    del t
    assert 4 << 20 <= during - before < (4 << 20) + 65536
    assert probe.allocated_bytes() - before < 65536


def test_keeping_freed_memory_serves_big_tensors_from_the_heap_and_the_probe_still_counts_them():
    """In a child: the setting lasts for the rest of the process that asks for it."""
    code = (
        "import torch, ctypes\n"
        "from benchmarks import probe\n"
        "assert probe.keep_freed_memory()\n"
        "mmapped = probe._mallinfo2()().hblkhd  # what import torch mapped before the setting\n"
        "b = probe.allocated_bytes(); t = torch.empty(1 << 22); d = probe.allocated_bytes() - b\n"
        "assert probe._mallinfo2()().hblkhd == mmapped  # the new 16 MiB came from the heap\n"
        "assert 16 << 20 <= d < (16 << 20) + 65536, d\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
