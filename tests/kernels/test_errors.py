"""Wrong calls fail before anything is written, saying what happened, why, and what to do."""

import pytest
import torch

from tracedac.kernels import launch as launch_module
from tracedac.ops import accumulate_, pack_cast


def test_an_unknown_backend_is_refused_with_the_valid_names():
    """A typo must not silently fall back to another backend."""
    with pytest.raises(ValueError, match=r"backend='cuda'.*'auto', 'triton', 'torch'"):
        pack_cast([torch.ones(2)], torch.empty(2), backend="cuda")
    with pytest.raises(ValueError, match=r"backend='Torch'"):
        accumulate_(torch.ones(2), torch.ones(2), backend="Torch")


def test_mismatched_sizes_say_both_counts_and_how_to_slice():
    """dst must be filled exactly: a short or long dst means a layout bug upstream."""
    with pytest.raises(ValueError, match=r"hold 5 elements in all but dst has 6.*buffer\[start:start \+ 5\]"):
        pack_cast([torch.ones(2), torch.ones(3)], torch.empty(6))
    with pytest.raises(ValueError, match=r"does not broadcast.*src.view\(dst.shape\)"):
        accumulate_(torch.zeros(2, 3), torch.ones(3))


@pytest.mark.parametrize(
    "srcs, dst, message",
    [
        (
            [torch.ones(2, dtype=torch.float64)],
            torch.empty(2),
            r"srcs\[0\] is torch.float64.*srcs\[0\].float\(\)",
        ),
        ([torch.ones(2)], torch.empty(2, dtype=torch.int32), r"dst is torch.int32"),
        ([torch.ones(2)], torch.empty(2, dtype=torch.float64), r"dst is torch.float64"),
    ],
)
def test_unsupported_dtypes_are_named(srcs, dst, message):
    """Only fp32/bf16/fp16 have a rounding routine; anything else must not be reinterpreted."""
    with pytest.raises(TypeError, match=message):
        pack_cast(srcs, dst)


def test_accumulate_refuses_a_low_precision_dst_and_an_integer_src():
    """The op exists to add into fp32 master gradients."""
    with pytest.raises(TypeError, match=r"float32 dst.*dst is torch.bfloat16"):
        accumulate_(torch.zeros(2, dtype=torch.bfloat16), torch.ones(2))
    with pytest.raises(TypeError, match=r"src is torch.int64"):
        accumulate_(torch.zeros(2), torch.ones(2, dtype=torch.int64))


def test_sources_on_another_device_are_refused():
    """The kernel reads sources where they live; a CPU pointer on a GPU would crash it."""
    with pytest.raises(ValueError, match=r"srcs\[1\] is on meta but dst is on cpu.*\.to\(dst.device\)"):
        pack_cast([torch.ones(2), torch.ones(2, device="meta")], torch.empty(4))
    with pytest.raises(ValueError, match=r"src is on meta"):
        accumulate_(torch.zeros(2), torch.ones(2, device="meta"))


def test_dst_must_be_flat_and_contiguous():
    """Sources are written back to back into one run of memory."""
    with pytest.raises(ValueError, match=r"flat \(1-D\) dst.*shape \(2, 3\).*dst.view\(-1\)"):
        pack_cast([torch.ones(6)], torch.empty(2, 3))
    with pytest.raises(ValueError, match=r"stride 2.*buffer\[start:stop\]"):
        pack_cast([torch.ones(3)], torch.empty(6)[::2])
    with pytest.raises(ValueError, match=r"contiguous dst.*strides \(1, 2\)"):
        accumulate_(torch.zeros(3, 2).t(), torch.ones(2, 3))


def test_srcs_must_be_a_list_not_a_tensor():
    """Iterating a tensor would pack its rows; say how to pass one tensor instead."""
    with pytest.raises(TypeError, match=r"got Tensor.*pack_cast\(\[t\], dst\)"):
        pack_cast(torch.ones(4), torch.empty(4))
    with pytest.raises(TypeError, match=r"srcs\[0\] to be a torch.Tensor, got list"):
        pack_cast([[1.0, 2.0]], torch.empty(2))


def test_a_source_overlapping_dst_is_refused(backend):
    """The kernel would read values it has already overwritten."""
    buffer = torch.ones(10)
    with pytest.raises(ValueError, match=r"source 0 overlaps dst.*clone\(\)"):
        pack_cast([buffer[2:6]], buffer[4:8], backend=backend)
    with pytest.raises(ValueError, match=r"source 0 overlaps dst"):
        accumulate_(buffer[:4], buffer[1:5], backend=backend)


def test_triton_on_cpu_without_the_interpreter_says_how_to_enable_it(monkeypatch):
    """Running the interpreter by accident would be thousands of times slower than torch."""
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match=r"TRITON_INTERPRET=1.*backend='torch'"):
        pack_cast([torch.ones(2)], torch.empty(2), backend="triton")


def test_triton_backend_without_triton_says_how_to_install_it(monkeypatch):
    """Triton is optional; asking for it explicitly must say it is missing, while 'auto'
    quietly uses torch."""
    monkeypatch.setattr(launch_module, "triton_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"needs the triton package.*pip install triton"):
        pack_cast([torch.ones(2)], torch.empty(2), backend="triton")
    dst = torch.empty(2, dtype=torch.bfloat16)
    pack_cast([torch.ones(2)], dst, backend="auto")
    assert dst.tolist() == [1.0, 1.0]


def test_importing_tracedac_kernels_does_not_import_triton():
    """Triton is optional and heavy: importing the package must not load it."""
    import subprocess
    import sys

    code = "import sys, tracedac.kernels; print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_sparse_tensors_are_refused_saying_to_pass_them_dense():
    dense = torch.ones(4)
    with pytest.raises(TypeError, match=r"srcs\[0\] is torch.sparse_coo.*to_dense"):
        pack_cast([dense.to_sparse()], torch.empty(4, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match=r"src is torch.sparse_coo.*to_dense"):
        accumulate_(torch.zeros(4), dense.to(torch.bfloat16).to_sparse())
