"""Rebuilding what backward needs from a region's graph: the plan (from which live tensors,
through which nodes), the pass that runs it, and a repeated pass as one compiled function."""
