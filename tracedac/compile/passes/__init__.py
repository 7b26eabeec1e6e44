"""The joint-graph passes, one per module, in the order ``install.py`` runs them on every
joint graph, before the partitioner (each module's docstring says what it requires of the
graph and what it provides):

1. ``gather_cast.fuse_gather_casts``: autocast's downcast of a gathered parameter moved into
   ZeRO-3's gather (before the regions are tagged: the casts it removes are never tagged);
2. ``tag_regions.tag_regions``: each region's policy or planner, as the partitioner's tags;
3. ``gather_prefetch.prefetch_gathers``: each unit's all-gather split in two, its start
   moved to while the unit before it computes (after the tags: both halves copy them);
4. ``zero_tags.tag_gathers``: ZeRO-3's gathers, and what is computed from them alone,
   recomputed in backward (last: it tags the gathers in their final form, and leaves the
   regions' tags alone).

From the rest of compile/ a pass imports ``vocab.py`` (and ``tag_regions`` the region graph
builder, ``fx_graph.py``), never another pass. Every file here is part of inductor's cache
key (``install.TagRegions.uuid``).
"""

from __future__ import annotations

from . import gather_cast, gather_prefetch, tag_regions, zero_tags

__all__ = ["PASSES", "run"]

# (module, its pass): the function is looked up when a graph comes, so a test may patch it
PASSES = (
    (gather_cast, "fuse_gather_casts"),
    (tag_regions, "tag_regions"),
    (gather_prefetch, "prefetch_gathers"),
    (zero_tags, "tag_gathers"),
)


def run(gm):
    """Every pass of ``PASSES`` on joint graph ``gm``, in order; the graph module they leave."""
    for module, name in PASSES:
        gm = getattr(module, name)(gm)
    return gm
