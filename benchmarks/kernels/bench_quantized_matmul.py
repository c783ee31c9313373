"""Micro-benchmark of the Triton weight-only matmul against PyTorch's bf16 matmul (cuBLAS) on the same shapes.

    PYTHONPATH=. python benchmarks/kernels/bench_quantized_matmul.py [--rows 1 8 64]

For each weight of SmolLM2-135M and Llama-3.2-1B (q/k/v fused, o, gate/up fused, down, the head) and each row
count: microseconds per call of ``quantized_matmul_triton`` (int4 in groups of 32; int8 per channel) and of
``x @ W^T`` in bf16 (triton.testing.do_bench, median), the speed-up, and the bandwidth the int4 kernel reaches
(bytes of packed weight, scales, zeros, x and y / time). Needs a CUDA GPU: without one it exits with status 2.

``--sweep``: times every launch shape of a grid (block sizes, K split, warps) on each weight and row count, and
prints the fastest per weight and, per row count, the one shape whose total time over the weights is least.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import sys

import torch

from common import require_cuda, warm_up_gpu

MODELS = {
    # name: {weight: (out, in)}
    "SmolLM2-135M": {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
                     "head": (49152, 576)},
    "Llama-3.2-1B": {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
                     "head": (128256, 2048)},
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--sweep", action="store_true", help="time a grid of launch shapes instead")
    args = parser.parse_args()
    require_cuda("bench_quantized_matmul")
    warm_up_gpu()
    if args.sweep:
        return sweep(args.rows)

    from triton.testing import do_bench

    from nanospec.kernels.quantized_matmul import launch_shape, quantized_matmul_triton
    from nanospec.model.quantization import quantize_int4, quantize_int8

    print(torch.cuda.get_device_name())
    header = ("model", "weight", "rows", "int4 us", "int8 us", "bf16 us", "int4 x", "int4 GB/s", "split")
    print("{:<14} {:<8} {:>5} {:>9} {:>9} {:>9} {:>7} {:>10} {:>6}".format(*header))
    for model, weights in MODELS.items():
        for name, (N, K) in weights.items():
            w = torch.randn(N, K, device="cuda") * K ** -0.5
            q4, q8 = quantize_int4(w), quantize_int8(w)
            w16 = w.bfloat16()
            for M in args.rows:
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                int4_ms = do_bench(lambda: quantized_matmul_triton(x, q4.packed, q4.scale, q4.zero, 32, 4))
                int8_ms = do_bench(lambda: quantized_matmul_triton(x, q8.q, q8.scale, None, K, 8))
                bf16_ms = do_bench(lambda: x @ w16.T)
                moved = q4.packed.numel() + 8 * q4.scale.numel() + 2 * (x.numel() + M * N)
                print(f"{model:<14} {name:<8} {M:>5} {int4_ms * 1e3:>9.1f} {int8_ms * 1e3:>9.1f} "
                      f"{bf16_ms * 1e3:>9.1f} {bf16_ms / int4_ms:>6.2f}x {moved / int4_ms / 1e6:>10.1f} "
                      f"{launch_shape(M, N, K)['split_k']:>6}")
    return 0


def shapes_to_try(M: int, N: int, K: int):
    """(rule, launch shape) pairs; a rule names a shape apart from the weight (its K split is a program count)."""
    from triton import cdiv

    if M > 16:  # the tiled path
        for bm, bn, bk, warps in itertools.product((32, 64), (64, 128), (64, 128), (4, 8)):
            yield (bm, bn, bk, warps), dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, split_k=1, num_warps=warps)
        return
    for bn, bk, programs, warps in itertools.product((32, 64, 128), (64, 128, 256), (0, 132, 264, 528), (4, 8)):
        split_k = max(1, min(cdiv(K, bk), programs // cdiv(N, bn)))
        yield (bn, bk, programs, warps), dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, split_k=split_k, num_warps=warps)


def sweep(rows: list[int]) -> int:
    from triton.testing import do_bench

    from nanospec.kernels.quantized_matmul import launch_shape, quantized_matmul_triton
    from nanospec.model.quantization import quantize_int4, quantize_int8

    def us(fn):
        return do_bench(fn, warmup=5, rep=20) * 1e3

    print(torch.cuda.get_device_name(), "rules: tiled (BLOCK_M, BLOCK_N, BLOCK_K, warps), "
          "split (BLOCK_N, BLOCK_K, programs the K split aims at, warps)")
    for bits, bits_rows in ((4, rows), (8, rows[:1])):  # int8: only at one row (a GGUF's head, by default)
        for M in bits_rows:
            totals = collections.defaultdict(float)  # rule -> microseconds summed over the weights
            for model, weights in MODELS.items():
                for name, (N, K) in weights.items():
                    w = torch.randn(N, K, device="cuda") * K ** -0.5
                    w16 = w.bfloat16()
                    q = quantize_int4(w) if bits == 4 else quantize_int8(w)
                    args = (q.packed, q.scale, q.zero, 32, 4) if bits == 4 else (q.q, q.scale, None, K, 8)
                    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                    bf16_us = us(lambda: x @ w16.T)  # noqa: B023
                    default_us = us(lambda: quantized_matmul_triton(x, *args))  # noqa: B023
                    timed = {}
                    for rule, shape in shapes_to_try(M, N, K):
                        timed[rule] = us(lambda: quantized_matmul_triton(x, *args, shape=shape))  # noqa: B023
                        totals[rule] += timed[rule]
                    best = min(timed, key=timed.get)
                    print(f"int{bits} M={M:<3} {model:<13} {name:<8} bf16 {bf16_us:7.1f}  default {default_us:7.1f} "
                          f"{launch_shape(M, N, K)}  best {timed[best]:7.1f} {best}", flush=True)
            best = min(totals, key=totals.get)
            print(f"int{bits} M={M}: least total {totals[best]:.1f} us with rule {best}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
