"""What a compiled graph keeps for backward: ``saved_report`` on a ``torch.compile``d callable.

The callable's original code is compiled again with a backend that runs AOTAutograd with
torch's min-cut partitioner (as ``aot_eager_decomp_partition`` does, and inductor before
its own graph passes) and keeps the forward and backward graphs it makes. The saved values
are the backward graph's inputs other than the gradients; each row names the forward node
that produced it, its region, its decision (``meta["recompute"]``) and its module. Replay is
what the backward graph recomputes: its nodes that came from the forward.
"""

from __future__ import annotations

import re

import torch

from .._compat import graph_input_sources
from ..compile.fx_graph import _int, build
from ..compile.names import input_name, module_path
from ..compile.vocab import DECISION, LABELS, SPECS, region_key
from ..policies.held import describe_policy
from .report import SavedReport, SavedRow

__all__ = ["Partition", "compiled_target", "partition", "partition_backend", "report"]


def compiled_target(fn):
    """The original callable behind a ``torch.compile`` result, or None if ``fn`` is not one."""
    orig = getattr(fn, "_orig_mod", None)  # an OptimizedModule
    if orig is None:
        orig = getattr(fn, "_torchdynamo_orig_callable", None)
    return orig


class Partition:
    """The forward and backward graphs of one compiled graph, and what the forward saves."""

    def __init__(self, fw: torch.fx.GraphModule, bw: torch.fx.GraphModule, sources=()):
        self.fw, self.bw = fw, bw
        self.sources = list(sources)  # dynamo's source of each graph input, by position
        by_name = {n.name: n for n in fw.graph.nodes}
        self.saved = [
            by_name.get(p.name, p)
            for p in bw.graph.find_nodes(op="placeholder")
            if not p.name.startswith("tangents") and isinstance(p.meta.get("val"), torch.Tensor)
        ]
        self.replayed = [
            n
            for n in bw.graph.nodes
            if n.op == "call_function" and n.meta.get("partitioner_tag") == "is_forward"
        ]

    def input_name(self, n) -> str:
        """What the forward's input ``n`` is: a parameter's or buffer's qualified name, an argument."""
        idx = getattr(n.meta.get("desc"), "idx", None)
        source = self.sources[idx] if idx is not None and idx < len(self.sources) else None
        return input_name(source) if source else "a graph input"

    @property
    def saved_bytes(self) -> int:
        """Bytes of the saved values the forward computed (its inputs are alive anyway)."""
        return sum(_nbytes(n) for n in self.saved if n.op != "placeholder")

    @property
    def replay_flops(self) -> int:
        view = build("replay", None, self.replayed, {})
        return sum(node.flops for node in view.graph.nodes)


_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def _nbytes(n) -> int:
    val = n.meta["val"]
    return (
        _int(val.untyped_storage().nbytes())
        if n.op == "placeholder"
        else _int(val.numel()) * val.dtype.itemsize
    )


def partition_backend():
    """A ``torch.compile`` backend that partitions each graph as inductor does
    (``aot_eager_decomp_partition``: inductor's decompositions and min-cut partition, effect
    tokens unlifted) and generates no code, and the list each compile appends its ``Partition``
    to."""
    import torch._functorch.config as functorch_config
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.compile_fx import select_decomp_table

    made: list[Partition] = []
    sources: list = []  # of the graph being compiled now

    def partition_fn(joint, inputs, **kw):
        fw, bw = min_cut_rematerialization_partition(joint, inputs, compiler="inductor", **kw)
        made.append(Partition(fw, bw, sources))
        return fw, bw

    aot = aot_autograd(
        fw_compiler=boxed_nop,
        bw_compiler=boxed_nop,
        decompositions=select_decomp_table,
        partition_fn=partition_fn,
    )

    def backend(gm, example_inputs):
        sources[:] = graph_input_sources(gm)
        with functorch_config.patch(unlift_effect_tokens=True):
            return aot(gm, example_inputs)

    return backend, made


def partitioned(fn):
    """``fn`` compiled (fullgraph) the way inductor partitions it, with no code generated, and
    the list that each compile appends its ``Partition`` to: call it, and run its backward,
    as the model would be (``partition`` runs the forward once and returns the list)."""
    import torch._functorch.config as functorch_config

    backend, made = partition_backend()
    # (a new backend for the same code: dynamo compiles it again, beside the caller's own)
    compiled = torch.compile(fn, backend=backend, fullgraph=True)

    def run(*args, **kwargs):
        with functorch_config.patch(unlift_effect_tokens=True):
            return compiled(*args, **kwargs)

    return run, made


def partition(fn, *args, **kwargs) -> list[Partition]:
    """Compile ``fn`` (fullgraph) with the partitioner's graphs kept; run its forward once."""
    compiled, made = partitioned(fn)
    with torch.enable_grad():
        out = compiled(*args, **kwargs)
    del out
    return made


def report(fn, *args, **kwargs):
    """``SavedReport`` of a compiled callable's partition (``fn`` is the original code)."""
    result = SavedReport()
    for part in partition(fn, *args, **kwargs):
        for n in part.saved:
            val = n.meta["val"]
            key = region_key(n)
            region = SPECS[key][1] if key in SPECS else ""
            decision = n.meta.get(DECISION)
            if n.op == "placeholder" and n.name.startswith("rng_state"):
                # functionalized randomness: the generator state a random op drew from, so
                # backward replays its numbers (one per random op the partitioner recomputes)
                kind, op, why = (
                    "rng state",
                    "rng state",
                    "generator state: backward replays a random op's numbers",
                )
            elif n.op == "placeholder":
                kind, op, why = "input", "input", f"{part.input_name(n)}: a graph input backward reads"
            else:
                kind, op = "activation", str(n.target)
                why = "saved by torch's partitioner"
                if key in SPECS and decision is not None:
                    why = f"{describe_policy(SPECS[key][0])} -> {decision.name}"
                    if decision.name.endswith("RECOMPUTE"):
                        why += "; saved by torch's partitioner (a region's result the next region reads)"
            module = module_path(n)
            found = _FRAME.findall(n.meta.get("stack_trace") or "")
            source = f"{found[-1][0]}:{found[-1][1]}" if found else None
            result.rows.append(
                SavedRow(
                    region,
                    kind,
                    op,
                    tuple(_int(d) for d in val.shape),
                    val.dtype,
                    _nbytes(n),
                    source,
                    module,
                    ", ".join(sorted(n.meta.get(LABELS, ()))),
                    why,
                )
            )
        result.replay_ops += len(part.replayed)
        result.replay_flops += part.replay_flops
        result.replayed_bytes += sum(
            _nbytes(n) for n in part.replayed if isinstance(n.meta.get("val"), torch.Tensor)
        )
    return result
