"""Benchmarks of tracedac, run from a clone's root as ``python -m benchmarks`` (``--help`` lists
the options). Not part of the installed package: tracedac's wheel holds ``tracedac*`` only.

``checkpointing`` compares tracedac with torch's checkpointing on the model in ``model``,
measuring memory with ``probe``; ``variants`` holds the ways of checkpointing it compares.
``kernels`` times the fused kernels (``--kernels``). ``zero`` compares ZeRO-3 implementations
on two ranks (``--zero``): ``zero_variants`` sets each up, ``collectives`` counts their all-gathers.
``ep`` checkpoints an expert-parallel MoE on ranks it starts (``--ep``), ``collectives``
counting its all-to-alls.
"""
