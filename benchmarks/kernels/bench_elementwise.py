"""Micro-benchmark of the elementwise / memory kernels: Triton against the PyTorch reference.

    PYTHONPATH=. python benchmarks/kernels/bench_elementwise.py [--dtype bf16|fp16|fp32]

Ops: rms_norm (plain and with the fused residual add), silu_and_mul, store_kv, the fused RoPE + KV write
(rope_store_kv) and copy_kv_slots, at SmolLM2-135M and
Llama-3.2-1B shapes, for decode-sized to prefill-sized token counts. Prints microseconds per call
(triton.testing.do_bench, median) and the bandwidth the Triton kernel reaches (bytes it must read and
write / time). Needs a CUDA GPU: without one it exits with status 2.
"""

from __future__ import annotations

import argparse
import sys

import torch

from common import require_cuda, warm_up_gpu

MODELS = {
    # name: (hidden, q heads, kv heads, head dim, ffn)
    "SmolLM2-135M": (576, 9, 3, 64, 1536),
    "Llama-3.2-1B": (2048, 32, 8, 64, 8192),
}
TOKEN_COUNTS = [1, 16, 256, 4096]
BLOCK_SIZE = 16
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def cases(model, num_tokens, dtype):
    """Yields (op name, triton callable, reference callable, bytes moved by the op)."""
    from nanospec.kernels.activation import silu_and_mul_ref, silu_and_mul_triton
    from nanospec.kernels.kv_store import copy_kv_slots_ref, copy_kv_slots_triton, store_kv_ref, store_kv_triton
    from nanospec.kernels.rmsnorm import rms_norm_ref, rms_norm_triton
    from nanospec.kernels.rope import build_rope_cache
    from nanospec.kernels.rope_store_kv import rope_store_kv_ref, rope_store_kv_triton

    hidden, q_heads, kv_heads, head_dim, ffn = MODELS[model]
    element = torch.tensor([], dtype=dtype).element_size()
    device = "cuda"

    x = torch.randn(num_tokens, hidden, device=device, dtype=dtype)
    residual = torch.randn_like(x)
    weight = torch.randn(hidden, device=device, dtype=dtype)
    yield ("rms_norm", lambda: rms_norm_triton(x, weight, 1e-5), lambda: rms_norm_ref(x, weight, 1e-5),
           (2 * x.numel() + hidden) * element)
    yield ("rms_norm+residual", lambda: rms_norm_triton(x, weight, 1e-5, residual),
           lambda: rms_norm_ref(x, weight, 1e-5, residual), (4 * x.numel() + hidden) * element)

    qkv = torch.randn(num_tokens, (q_heads + 2 * kv_heads) * head_dim, device=device, dtype=dtype)
    q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = q.view(num_tokens, q_heads, head_dim)
    k = k.view(num_tokens, kv_heads, head_dim)
    v = v.view(num_tokens, kv_heads, head_dim)
    cache = build_rope_cache(head_dim, 8192, 500000.0, device=device)
    positions = torch.randint(0, 8192, (num_tokens,), device=device)
    rope_bytes = 2 * (q.numel() + k.numel()) * element + num_tokens * head_dim * 4

    gate_up = torch.randn(num_tokens, 2 * ffn, device=device, dtype=dtype)
    yield ("silu_and_mul", lambda: silu_and_mul_triton(gate_up), lambda: silu_and_mul_ref(gate_up),
           3 * num_tokens * ffn * element)

    num_blocks = 2 * num_tokens // BLOCK_SIZE + 1
    k_cache = torch.zeros(num_blocks, BLOCK_SIZE, kv_heads, head_dim, device=device, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device=device)[:num_tokens]
    kv_bytes = 4 * k.numel() * element
    yield ("store_kv", lambda: store_kv_triton(k, v, k_cache, v_cache, slots),
           lambda: store_kv_ref(k, v, k_cache, v_cache, slots), kv_bytes)

    # what a layer does before attending: RoPE and the KV write, fused
    fused_bytes = rope_bytes + 2 * k.numel() * element
    yield ("rope_store_kv", lambda: rope_store_kv_triton(q, k, v, positions, cache, k_cache, v_cache, slots),
           lambda: rope_store_kv_ref(q, k, v, positions, cache, k_cache, v_cache, slots), fused_bytes)

    src = torch.arange(num_tokens, device=device) * 2 + 1
    dst = torch.arange(num_tokens, device=device)
    yield ("copy_kv_slots", lambda: copy_kv_slots_triton(k_cache, v_cache, src, dst),
           lambda: copy_kv_slots_ref(k_cache, v_cache, src, dst), 2 * kv_bytes)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    args = parser.parse_args()
    require_cuda("bench_elementwise")
    warm_up_gpu()

    from triton.testing import do_bench

    dtype = DTYPES[args.dtype]
    print(f"{torch.cuda.get_device_name()}  dtype={args.dtype}")
    header = ("model", "op", "tokens", "triton us", "torch us", "speedup", "triton GB/s")
    print("{:<14} {:<18} {:>6} {:>10} {:>10} {:>8} {:>12}".format(*header))
    for model in MODELS:
        for num_tokens in TOKEN_COUNTS:
            for op, triton_fn, ref_fn, num_bytes in cases(model, num_tokens, dtype):
                triton_ms, ref_ms = do_bench(triton_fn), do_bench(ref_fn)
                print(f"{model:<14} {op:<18} {num_tokens:>6} {triton_ms * 1e3:>10.1f} {ref_ms * 1e3:>10.1f} "
                      f"{ref_ms / triton_ms:>7.2f}x {num_bytes / triton_ms / 1e6:>12.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
