"""``SavedReport`` and ``SavedRow``: what a region keeps for backward, as ``saved_report``
returns it, for eager regions (``inspect.py``) and compiled graphs (``compile/report.py``)
alike. A leaf both import."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from ..record.graph import human_bytes

__all__ = ["SavedReport", "SavedRow"]


@dataclass(frozen=True)
class SavedRow:
    """One storage a region holds after its forward."""

    region: str
    kind: str  # "activation", "input", "snapshot", "offloaded" (in host memory) or (compiled) "rng state"
    op: str  # the op that produced the value ("input" for one from outside)
    shape: tuple
    dtype: torch.dtype
    bytes: int  # of the whole storage: that is what stays allocated
    source: str | None  # the user's file:line that ran the op
    module: str | None
    label: str
    why: str


@dataclass
class SavedReport:
    """Every tensor kept for backward after one forward, and what replay will cost."""

    rows: list[SavedRow] = field(default_factory=list)
    replayed_bytes: int = 0  # saved by autograd, not kept: rebuilt in backward
    replay_flops: int = 0  # by torch's FLOP formulas (matmuls, attention, convolutions)
    replay_ops: int = 0

    @property
    def kept_bytes(self) -> int:
        """Bytes computed in the region and kept on the device (activations and copies of
        written inputs; not what was offloaded to host memory)."""
        return sum(r.bytes for r in self.rows if r.kind not in ("input", "offloaded"))

    @property
    def offloaded_bytes(self) -> int:
        """Bytes offloaded to host memory (``MUST_CPU_OFFLOAD``/``PREFER_CPU_OFFLOAD``): held on
        the host, not the device."""
        return sum(r.bytes for r in self.rows if r.kind == "offloaded")

    @property
    def input_bytes(self) -> int:
        """Bytes of inputs (arguments, parameters, buffers) the region keeps a reference to."""
        return sum(r.bytes for r in self.rows if r.kind == "input")

    def __repr__(self) -> str:
        host = f", offloaded {human_bytes(self.offloaded_bytes)}" if self.offloaded_bytes else ""
        return (
            f"SavedReport({len(self.rows)} rows, kept {human_bytes(self.kept_bytes)}{host}, "
            f"replayed {human_bytes(self.replayed_bytes)} in {self.replay_ops} ops)"
        )

    def __str__(self) -> str:
        headers = ("region", "kind", "op", "shape", "dtype", "bytes", "source", "module", "label", "why")
        table = [
            (
                r.region,
                r.kind,
                r.op,
                "x".join(map(str, r.shape)) or "scalar",
                str(r.dtype).removeprefix("torch."),
                human_bytes(r.bytes),
                _short(r.source),
                r.module or "",
                r.label,
                r.why,
            )
            for r in self.rows
        ]
        widths = [max([len(h)] + [len(row[i]) for row in table]) for i, h in enumerate(headers)]

        def line(cells):
            return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()

        out = [line(headers), line("-" * w for w in widths)]
        out += [line(row) for row in table]
        out.append("")
        host = f" | offloaded to host {human_bytes(self.offloaded_bytes)}" if self.offloaded_bytes else ""
        out.append(
            f"kept {human_bytes(self.kept_bytes)}{host} | "
            f"inputs referenced {human_bytes(self.input_bytes)} | "
            f"replayed in backward {human_bytes(self.replayed_bytes)} "
            f"({self.replay_ops} ops, {self.replay_flops / 1e9:.3f} GFLOP)"
        )
        return "\n".join(out)


def _short(source: str | None) -> str:
    if source is None:
        return ""
    path, _, line = source.rpartition(":")
    return f"{os.path.basename(path)}:{line}"
