"""Benchmarks of tracedac, run as ``python -m tracedac.bench`` (``--help`` lists the options).

``checkpointing`` compares tracedac with torch's checkpointing on the model in ``model``,
measuring memory with ``probe``; ``variants`` holds the ways of checkpointing it compares.
``kernels`` times the fused kernels (``--kernels``). ``zero`` compares ZeRO-3 implementations
on two ranks (``--zero``): ``zero_variants`` sets each up, ``collectives`` counts their all-gathers.
"""
