"""The segment table: how one kernel launch finds every source without copying it first.

One int64 row per non-empty source: its data pointer, dtype, where it lands in ``dst``, its
element count, the first program that works on it, its layout (contiguous, or up to
``MAX_DIMS`` sizes and strides after merging dims) and its NaN rule. After the rows comes one
int64 per program: the row that program reads. The whole thing goes to the device in one
copy. The sources' pointers, dtypes, shapes and strides (with dst's dtype, device and
alignment) determine it entirely, so it is built once for a call and reused by every later call
with the same ones: ``cast.py`` keeps it with the rest of what a call's key determines, so
steady-state training steps (the same shards every step) upload nothing. ``plan_for`` is the
same with a cache of its own, for direct use.
"""

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from .bits import FORMATS, nan_rule

__all__ = ["COLS", "MAX_DIMS", "Plan", "build_plan", "collapse_dims", "plan_for"]

# Column indices of a row (the kernel reads them under the same names).
ADDR, KIND, DST_START, NUMEL, FIRST_BLOCK, CONTIGUOUS, NAN_CANONICAL, NAN_QUIET_BITS, NAN_PAYLOAD_MASK = (
    range(9)
)
MAX_DIMS = 4
SIZES = 9  # MAX_DIMS sizes, innermost first, padded with 1
STRIDES = SIZES + MAX_DIMS  # MAX_DIMS strides in elements, innermost first, padded with 0
COLS = STRIDES + MAX_DIMS

# Vector loads need 16-byte aligned addresses; the kernel is told so only when it is true.
_ALIGN_BYTES = 16
_CACHE_SIZE = 64


@dataclass(frozen=True)
class Plan:
    """Everything one launch needs besides ``dst``."""

    table: torch.Tensor  # int64 [rows * COLS + programs] on dst's device
    rows: int
    programs: int
    aligned: bool  # all contiguous, all addresses 16-byte aligned, all sizes multiples of 8
    keepalive: tuple[torch.Tensor, ...]  # contiguous copies made for sources with too many dims
    # The kernel's two table arguments: views of ``table``, made once rather than every launch.
    segment_table: torch.Tensor = field(init=False, repr=False, compare=False)
    block_rows: torch.Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "segment_table", self.table[: self.rows * COLS])
        object.__setattr__(self, "block_rows", self.table[self.rows * COLS :])


def collapse_dims(sizes, strides) -> list[tuple[int, int]]:
    """(size, stride) pairs, outermost first, with size-1 dims dropped and mergeable dims merged.

    A contiguous tensor collapses to at most one pair with stride 1; a transposed matrix keeps
    two. Dims merge when stepping over the outer one is the same as running off the inner one.
    """
    merged: list[tuple[int, int]] = []
    for size, stride in zip(sizes, strides):
        if size == 1:
            continue
        if merged and merged[-1][1] == stride * size:
            merged[-1] = (merged[-1][0] * size, stride)
        else:
            merged.append((size, stride))
    return merged


_cache: "OrderedDict[tuple, Plan]" = OrderedDict()
_cache_lock = threading.Lock()


def plan_for(srcs: list[torch.Tensor], dst: torch.Tensor, block: int) -> Plan:
    """The (cached) plan for casting ``srcs`` into ``dst`` in programs of ``block`` elements."""
    key = (
        dst.device,
        dst.dtype,
        dst.data_ptr() % _ALIGN_BYTES == 0,
        block,
        tuple((s.data_ptr(), s.dtype, tuple(s.shape), s.stride()) for s in srcs),
    )
    with _cache_lock:
        plan = _cache.get(key)
        if plan is not None:
            _cache.move_to_end(key)
            return plan
    plan = build_plan(srcs, dst, block)
    if not plan.keepalive:  # a plan pointing at temporary copies is useless next time
        with _cache_lock:
            _cache[key] = plan
            while len(_cache) > _CACHE_SIZE:
                _cache.popitem(last=False)
    return plan


def build_plan(srcs: list[torch.Tensor], dst: torch.Tensor, block: int) -> Plan:
    """A new plan, uncached (a plan with ``keepalive`` holds copies: keep it for one launch only)."""
    rows: list[list[int]] = []
    keepalive: list[torch.Tensor] = []
    block_rows: list[int] = []
    dst_size = dst.element_size()
    aligned = dst.data_ptr() % _ALIGN_BYTES == 0
    start = 0
    for src in srcs:
        numel = src.numel()
        if numel == 0:
            continue
        dims = collapse_dims(src.shape, src.stride())
        if len(dims) > MAX_DIMS:
            # Rare (a view with more than four unmergeable dims): pay one copy of this source.
            src = src.contiguous()
            keepalive.append(src)
            dims = collapse_dims(src.shape, src.stride())
        contiguous = len(dims) == 0 or (len(dims) == 1 and dims[0][1] == 1)
        inner_first = list(reversed(dims))
        sizes = [d[0] for d in inner_first] + [1] * (MAX_DIMS - len(dims))
        strides = [d[1] for d in inner_first] + [0] * (MAX_DIMS - len(dims))
        rule = nan_rule(dst.device, src.dtype, dst.dtype)
        programs = -(-numel // block)
        row = [
            src.data_ptr(),
            FORMATS[src.dtype].kind,
            start,
            numel,
            len(block_rows),
            int(contiguous),
            -1 if rule.canonical is None else rule.canonical,
            rule.quiet_bits(dst.dtype),
            rule.payload_mask(dst.dtype),
        ]
        rows.append(row + sizes + strides)
        block_rows.extend([len(rows) - 1] * programs)
        aligned = (
            aligned
            and contiguous
            and numel % 8 == 0
            and src.data_ptr() % _ALIGN_BYTES == 0
            and (start * dst_size) % _ALIGN_BYTES == 0
        )
        start += numel
    flat = [v for row in rows for v in row] + block_rows
    table = torch.tensor(flat, dtype=torch.int64)
    if dst.device.type != "cpu":
        table = table.pin_memory().to(dst.device, non_blocking=True)
    return Plan(table, len(rows), len(block_rows), aligned, tuple(keepalive))
