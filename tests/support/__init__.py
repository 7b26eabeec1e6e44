"""Fixtures shared by test files in different folders, that no benchmark uses.

The dependency runs one way: tests -> benchmarks -> tracedac. Measurement tools and models
of the benchmarks (``benchmarks.probe``, ``benchmarks.model``, ``benchmarks.collectives``,
the HF builders of ``benchmarks.hf``) stay in ``benchmarks/`` and tests import them from
there; what only tests use (e.g. ``hf_models``: the HF builders at the tests' tiny sizes)
lives here. Nothing in ``benchmarks/`` or ``tracedac/`` imports ``tests``.
"""
