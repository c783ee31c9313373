"""Micro-benchmark of the Triton weight-only matmul against PyTorch's bf16 matmul (cuBLAS) on the same shapes.

    PYTHONPATH=. python benchmarks/kernels/bench_quantized_matmul.py [--rows 1 8 64]

For each weight of SmolLM2-135M and Llama-3.2-1B (q/k/v fused, o, gate/up fused, down, the head) and each row
count: microseconds per call of ``quantized_matmul_triton`` (int4 in groups of 32; int8 per channel) and of
``x @ W^T`` in bf16 (triton.testing.do_bench, median), the speed-up, and the bandwidth the int4 kernel reaches
(bytes of packed weight, scales, zeros, x and y / time). Needs a CUDA GPU: without one it exits with status 2.
"""

from __future__ import annotations

import argparse
import sys

import torch

from common import require_cuda

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
    args = parser.parse_args()
    require_cuda("bench_quantized_matmul")

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


if __name__ == "__main__":
    sys.exit(main())
