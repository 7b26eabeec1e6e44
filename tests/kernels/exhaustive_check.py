"""Every fp32 bit pattern through bits.py and the Triton kernel, against torch's cast.

Not collected by pytest (15 minutes for bf16, 35 for fp16 on a 2-core CPU); the tests check
a dense sample of the same ground. Run from the repository root:

    python -m tests.kernels.exhaustive_check bf16     # or fp16; add --chunks N for a partial run

Prints progress every 16 chunks of 2**24 patterns and exits non-zero on any mismatch.
"""

import argparse
import os
import sys
import time

import torch

TARGETS = {"bf16": torch.bfloat16, "fp16": torch.float16}
CHUNK = 1 << 24


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", choices=sorted(TARGETS))
    parser.add_argument("--chunks", type=int, default=1 << 8, help="chunks of 2**24 patterns (256: all)")
    args = parser.parse_args(argv)
    os.environ["TRITON_INTERPRET"] = "1"  # this process only: the kernel runs on CPU tensors

    from tracedac.kernels.bits import convert_bits, from_bits, nan_rule, to_bits
    from tracedac.ops import pack_cast

    dtype = TARGETS[args.target]
    rule = nan_rule(torch.device("cpu"), torch.float32, dtype)
    out = torch.empty(CHUNK, dtype=dtype)
    start, bad_bits, bad_kernel = time.time(), 0, 0
    for c in range(args.chunks):
        patterns = torch.arange(c * CHUNK, (c + 1) * CHUNK, dtype=torch.int64)
        x = from_bits(patterns, torch.float32)
        want = to_bits(x.to(dtype))
        by_bits = convert_bits(patterns, torch.float32, dtype, rule)
        pack_cast([x], out, backend="triton")
        by_kernel = to_bits(out)
        wrong = (by_bits != want) | (by_kernel != want)
        bad_bits += int((by_bits != want).sum())
        bad_kernel += int((by_kernel != want).sum())
        if bool(wrong.any()):
            i = int(wrong.nonzero()[0])
            print(
                f"mismatch at {int(patterns[i]):#010x}: bits.py {int(by_bits[i]):#x}, "
                f"kernel {int(by_kernel[i]):#x}, torch {int(want[i]):#x}",
                flush=True,
            )
        if c % 16 == 15 or c == args.chunks - 1:
            print(
                f"{args.target}: {c + 1}/{args.chunks} chunks, {time.time() - start:.0f}s, "
                f"mismatches: bits.py {bad_bits}, kernel {bad_kernel}",
                flush=True,
            )
    return 1 if bad_bits or bad_kernel else 0


if __name__ == "__main__":
    sys.exit(main())
