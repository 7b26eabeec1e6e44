"""How the segment table describes sources: merged dims, and the aligned fast variant."""

import torch

from tracedac.kernels.table import MAX_DIMS, collapse_dims, plan_for


def test_layouts_collapse_to_the_fewest_dims_that_address_them():
    """The kernel pays a division per dim per element for strided sources, and takes at most
    MAX_DIMS of them; merging keeps ordinary views (slices, transposes) well inside that."""
    x = torch.empty(4, 1, 6, 8)
    assert collapse_dims(x.shape, x.stride()) == [(192, 1)]
    assert collapse_dims(x[:, :, 2:5].shape, x[:, :, 2:5].stride()) == [(4, 48), (24, 1)]
    assert collapse_dims(x[1:3].shape, x[1:3].stride()) == [(96, 1)]
    t = torch.empty(5, 7).t()
    assert collapse_dims(t.shape, t.stride()) == [(7, 1), (5, 7)]
    assert collapse_dims(x[..., ::2].shape, x[..., ::2].stride()) == [(96, 2)]
    assert collapse_dims(torch.empty(1, 1).shape, (1, 1)) == []


def _offsets(size, stride) -> list:
    """Every element's storage offset, in row-major index order (the oracle: torch's as_strided)."""
    storage = torch.arange(1 + sum((n - 1) * s for n, s in zip(size, stride)))
    return storage.as_strided(size, stride).flatten().tolist() if size else [0]


def test_collapsed_dims_address_the_same_elements_in_the_same_order():
    x = torch.empty(3, 4, 5, 6)
    views = [
        x,
        x[:, 1:3],
        x[..., ::2],
        x.transpose(1, 3),
        x[1:, :, 2:4, 1:].permute(2, 0, 3, 1),
        x.expand(2, 3, 4, 5, 6),
        x[:, :, 0:1],
        torch.empty(5, 7).t()[::2],
    ]
    for v in views:
        dims = collapse_dims(v.shape, v.stride())
        assert len(dims) <= MAX_DIMS  # ordinary views stay within what the kernel takes
        assert _offsets([n for n, _ in dims], [s for _, s in dims]) == _offsets(v.shape, v.stride())


def test_only_aligned_contiguous_multiple_of_8_units_get_the_vector_variant():
    """The vector variant assumes 16-byte aligned addresses and whole vectors; anything else
    must take the scalar one, or loads would fault or read past a source."""
    buffer = torch.empty(4096, dtype=torch.bfloat16)
    srcs = [torch.empty(64), torch.empty(8)]
    assert plan_for(srcs, buffer[:72], block=1024).aligned
    assert not plan_for(srcs, buffer[1:73], block=1024).aligned  # dst slot misaligned
    assert not plan_for([torch.empty(65)[1:], torch.empty(8)], buffer[:72], block=1024).aligned
    assert not plan_for([torch.empty(60), torch.empty(12)], buffer[:72], block=1024).aligned
    assert not plan_for([torch.empty(8, 8).t(), torch.empty(8)], buffer[:72], block=1024).aligned
