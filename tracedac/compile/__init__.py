"""The compile path: checkpointed regions inside one ``torch.compile`` graph.

When dynamo traces a region (``checkpoint`` on a function or module, ``checkpoint_call``,
``wrap``) no recorder runs: the region's body is traced inline inside
``torch.fx.traceback.annotate({"tracedac_region": key})`` (``entry.py``), so Python side
effects, hooks and buffer updates happen once, as in the rest of the compiled graph, and
AOTAutograd's functionalization handles mutation. The key names the region's policy in a
process registry (``registry.py``).

AOTAutograd copies the annotation onto every node of the joint graph the region produced.
Before torch's min-cut partitioner runs, a joint-graph pass (``passes/tag_regions.py``)
builds each region's forward nodes into the graph the policies and planners already read
(``fx_graph.py``), asks the region's policy or planner, and writes ``node.meta["recompute"]``
and ``node.meta["ac_graph_id"]``, which the partitioner honours. The passes are registered,
the first time a region is traced, as inductor's ``joint_custom_pre_pass`` (a
``CustomGraphPass`` whose ``uuid`` is part of inductor's cache key) and as AOTAutograd's
``joint_custom_pass`` (which the other backends run; see ``install.py``).

The other passes in ``passes/`` (all run by that one hook, in the order of
``passes.PASSES``; registered by whichever is traced first, a region or a ``tracedac.zero``
gather) serve ZeRO-3: one moves autocast's cast of a gathered parameter into the gather
(``gather_cast.py``), one starts each unit's gather while the unit before it computes
(``gather_prefetch.py``), and one tags the gathers, and what is computed from gathered
parameters alone, to be recomputed: backward gathers again (``zero_tags.py``).

``tracedac.name(t, label)`` is an identity op under compile (``name_op.py``): the pass
moves its label onto the node that produced ``t`` and removes it.

The modules import one another without a circle: ``vocab.py`` (what they share: the
annotation key, the mark op, the spec table, the meta keys, ``backward_nodes``, ``zero_op``)
imports none of them; ``entry -> registry -> vocab``; ``install -> passes/* -> fx_graph ->
names``; ``report -> fx_graph``. Only ``registry.install_traced`` imports ``install`` inside
a function, so that importing tracedac imports no inductor module.
"""

from ..ops.marks import name_op
from .entry import traced_region

__all__ = ["name_op", "traced_region"]
