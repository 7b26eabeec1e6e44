"""What test files in several folders share, and what the tests need of measuring code.

- ``ranks``: a function on N ranks of a real gloo process group (file init, hard timeouts),
  and checks that rank functions make where they compute (``check``, ``run_parts``).
- ``zero_model``, ``zero_logs``: the model the ZeRO-3 tests train and logs of what
  ``tracedac.zero`` sends to its process group.
- ``collective_blocks``, ``tp_block``: blocks that talk to other ranks inside a region
  (expert parallel all-to-alls, all-reduces, torch's tensor and sequence parallel).
- ``compiled_graphs``: the graphs AOTAutograd hands its compilers, and counts of tracedac's
  ops in them.
- ``moe_model``: an MoE with a load-balancing bias (the Llama 4 / DeepSeek case).
- ``decoders``: a small Llama and a small MoE GPT, whole models that train (tests/test_peak.py).
- ``hf_models``: tiny transformers models; ``probe``: bytes in use at glibc's allocator.

The dependencies run one way: tests -> tracedac, and tests/bench -> benchmarks -> tracedac.
No test outside tests/bench imports ``benchmarks`` (measuring code the tests need too, the
allocator probe and the HF builders, they hold a small copy of), and nothing in
``benchmarks/`` or ``tracedac/`` imports ``tests``.
"""
