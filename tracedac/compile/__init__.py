"""The compile path: checkpointed regions inside one ``torch.compile`` graph.

When dynamo traces a region (``checkpoint`` on a function or module, ``checkpoint_call``,
``wrap``) no recorder runs: the region's body is traced inline inside
``torch.fx.traceback.annotate({"tracedac_region": key})`` (``entry.py``), so Python side
effects, hooks and buffer updates happen once, as in the rest of the compiled graph, and
AOTAutograd's functionalization handles mutation. The key names the region's policy in a
process registry (``registry.py``).

AOTAutograd copies the annotation onto every node of the joint graph the region produced.
Before torch's min-cut partitioner runs, a joint-graph pass (``tag_regions.py``) builds
each region's forward nodes into the graph the policies and planners already read
(``fx_graph.py``), asks the region's policy or planner, and writes ``node.meta["recompute"]``
and ``node.meta["ac_graph_id"]``, which the partitioner honours. The pass is registered,
the first time a region is traced, as inductor's ``joint_custom_pre_pass`` (a
``CustomGraphPass`` whose ``uuid`` is part of inductor's cache key) and as AOTAutograd's
``joint_custom_pass`` (which the other backends run; see ``install.py``).

``tracedac.name(t, label)`` is an identity op under compile (``name_op.py``): the pass
moves its label onto the node that produced ``t`` and removes it.
"""

from .entry import traced_region
from .name_op import name_op

__all__ = ["name_op", "traced_region"]
