"""What compile's modules share: the marks a traced region leaves in a graph, and what the
joint-graph passes read and write there. A leaf: it imports nothing else of ``tracedac.compile``.

- ``ANNOTATION``: the key under ``node.meta["custom"]`` whose value names the node's region
  (``torch.fx.traceback.annotate``, ``entry.py``); ``region_key(n)`` reads it.
- ``SPECS``: what such a value means, region key -> ``(policy, region name)`` (filled by
  ``registry.key_for``).
- ``MARK``: ``tracedac::region(key)`` (defined in ``tracedac/ops/marks.py``), an op that does
  nothing: the region's key in the graph's code (why: ``entry.py``). ``passes/tag_regions.py``
  removes it.
- ``LABELS``, ``DECISION``: the ``node.meta`` keys ``passes/tag_regions.py`` writes (a
  node's ``tracedac.name`` labels; the region's decision, kept beside ``"recompute"``,
  which the partitioner may change). ``report.py`` reads them.
- ``backward_nodes(graph)``: which nodes of a joint graph are its backward.
- ``zero_op(name)``: one of ``tracedac.zero``'s ops, for the ZeRO-3 passes.
"""

from __future__ import annotations

import torch

from ..ops.marks import MARK

__all__ = ["ANNOTATION", "DECISION", "LABELS", "MARK", "SPECS", "backward_nodes", "region_key", "zero_op"]

ANNOTATION = "tracedac_region"
LABELS = "tracedac_labels"
DECISION = "tracedac_decision"  # ours, kept beside "recompute" (which the partitioner may change)

# key -> (policy, region name)
SPECS: dict[str, tuple] = {}


def region_key(n: torch.fx.Node) -> str | None:
    """The key of the region that traced ``n`` (its ``ANNOTATION``), or None."""
    custom = n.meta.get("custom")
    return custom.get(ANNOTATION) if isinstance(custom, dict) else None


def backward_nodes(graph: torch.fx.Graph) -> set:
    """Nodes of the backward: partitioner-tagged, else everything that reads a tangent."""
    tagged = {n for n in graph.nodes if n.meta.get("partitioner_tag") == "is_backward"}
    if tagged:
        return tagged
    backward = set()
    for n in graph.nodes:
        if (n.op == "placeholder" and "tangent" in n.name) or any(a in backward for a in n.all_input_nodes):
            backward.add(n)
    return backward


def zero_op(name: str):
    """``torch.ops.tracedac.<name>.default`` (``tracedac/ops/zero.py``), for the ZeRO-3 graph passes."""
    return getattr(torch.ops.tracedac, name).default
