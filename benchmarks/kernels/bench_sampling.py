"""Micro-benchmark of the sampling kernels: Triton against the PyTorch reference.

    PYTHONPATH=. python benchmarks/kernels/bench_sampling.py [--dtype bf16|fp16|fp32]

Ops: probs_from_logits (temperature only, top-k, top-p, both, min-p), sample_from_probs and the
whole of sample, for 1 to 64 rows at the vocabularies of SmolLM2-135M (49152) and Llama-3.2-1B
(128256). Prints microseconds per call (triton.testing.do_bench, median). The Triton top-k / top-p
kernel makes 32 passes over a row per threshold it searches (min-p adds one pass), so those columns show what the
sort-free bisection costs against torch's sort-based reference. Needs a CUDA GPU: without one it
exits with status 2.
"""

from __future__ import annotations

import argparse
import sys

import torch

from common import require_cuda, warm_up_gpu

VOCABS = {"SmolLM2-135M": 49152, "Llama-3.2-1B": 128256}
ROW_COUNTS = [1, 8, 64]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# name: (temperature, top_k, top_p, min_p) of every row
SETTINGS = {
    "temperature": (0.8, -1, 1.0, 0.0),
    "top-k 50": (0.8, 50, 1.0, 0.0),
    "top-p 0.9": (0.8, -1, 0.9, 0.0),
    "top-k 50 + top-p 0.9": (0.8, 50, 0.9, 0.0),
    "min-p 0.05": (0.8, -1, 1.0, 0.05),
}


def cases(vocab_size, num_rows, dtype):
    """Yields (op name, triton callable, reference callable)."""
    from nanospec.kernels.sampling import (
        probs_from_logits_ref,
        probs_from_logits_triton,
        sample_from_probs_ref,
        sample_from_probs_triton,
        sample_ref,
        sample_triton,
    )

    device = "cuda"
    logits = torch.randn(num_rows, vocab_size, device=device, dtype=dtype) * 4
    seeds = torch.randint(0, 2**62, (num_rows,), device=device)
    offsets = torch.arange(num_rows, device=device)

    for name, (temperature, top_k, top_p, min_p) in SETTINGS.items():
        args = (
            logits,
            torch.full((num_rows,), temperature, device=device),
            torch.full((num_rows,), top_k, device=device, dtype=torch.int32),
            torch.full((num_rows,), top_p, device=device),
        )
        min_p = torch.full((num_rows,), min_p, device=device)
        yield (f"probs_from_logits {name}", lambda args=args, m=min_p: probs_from_logits_triton(*args, m),
               lambda args=args, m=min_p: probs_from_logits_ref(*args, m))
        yield (f"sample {name}", lambda args=args, m=min_p: sample_triton(*args, seeds, offsets, m),
               lambda args=args, m=min_p: sample_ref(*args, seeds, offsets, m))

    probs = torch.softmax(logits.float(), dim=-1)
    yield ("sample_from_probs", lambda: sample_from_probs_triton(probs, seeds, offsets),
           lambda: sample_from_probs_ref(probs, seeds, offsets))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    args = parser.parse_args()
    require_cuda("bench_sampling")
    warm_up_gpu()

    from triton.testing import do_bench

    dtype = DTYPES[args.dtype]
    print(f"{torch.cuda.get_device_name()}  logits dtype={args.dtype}")
    header = ("model", "op", "rows", "triton us", "torch us", "speedup")
    print("{:<14} {:<40} {:>5} {:>10} {:>10} {:>8}".format(*header))
    for model, vocab_size in VOCABS.items():
        for num_rows in ROW_COUNTS:
            for op, triton_fn, ref_fn in cases(vocab_size, num_rows, dtype):
                triton_ms, ref_ms = do_bench(triton_fn), do_bench(ref_fn)
                print(f"{model:<14} {op:<40} {num_rows:>5} {triton_ms * 1e3:>10.1f} {ref_ms * 1e3:>10.1f} "
                      f"{ref_ms / triton_ms:>7.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
