"""Micro-benchmark: paged attention, Triton kernel vs the PyTorch reference, on a CUDA GPU.

    python benchmarks/kernels/bench_paged_attention.py

Cases: decode (q_len 1), speculative verify (q_len 6, causal and tree-masked), prefill, at SmolLM2-135M
(9 q heads / 3 kv heads, head_dim 64) and Llama-3.2-1B (32 / 8, head_dim 64) shapes, bf16, block size 16.
For decode and verify the K/V read dominates, so the Triton column also reports K/V bytes / time.
Needs a CUDA GPU: without one it exits with status 2.
"""

from __future__ import annotations

import math

import torch
import triton

from common import require_cuda, warm_up_gpu
from nanospec.kernels.attention_mask import concat_masks
from nanospec.speculative.proposal import tree_mask
from nanospec.kernels.paged_attention import paged_attention_ref, paged_attention_triton

MODELS = {"smollm2-135m": (9, 3, 64), "llama-1b": (32, 8, 64)}
BLOCK_SIZE = 16
# (name, number of sequences, new tokens per sequence, cached context per sequence, tree-masked)
CASES = [
    ("decode", 1, 1, 1024, False),
    ("decode", 32, 1, 1024, False),
    ("decode", 64, 1, 4096, False),
    ("verify", 8, 6, 2048, False),
    ("verify-tree", 8, 6, 2048, True),
    ("prefill", 1, 2048, 0, False),
    ("prefill", 4, 512, 0, False),
]


def make_batch(num_seqs, q_len, ctx_len, num_q_heads, num_kv_heads, head_dim, dtype, device):
    seq_len = q_len + ctx_len
    blocks_per_seq = math.ceil(seq_len / BLOCK_SIZE)
    num_blocks = num_seqs * blocks_per_seq
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.randperm(num_blocks, device=device).to(torch.int32).view(num_seqs, blocks_per_seq)
    return dict(
        q=torch.randn(num_seqs * q_len, num_q_heads, head_dim, dtype=dtype, device=device),
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables,
        seq_lens=torch.full((num_seqs,), seq_len, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32, device=device) * q_len,
        scale=1.0 / math.sqrt(head_dim),
        max_query_len=q_len,
    )


def two_branch_tree_mask(num_seqs, q_len, device):
    """A tree per sequence: node 0 the root, odd nodes on one branch, even nodes on the other."""
    parents = [-1] + [max(i - 2, 0) for i in range(1, q_len)]
    return concat_masks([tree_mask(parents)] * num_seqs).to(device)


def main() -> None:
    require_cuda("bench_paged_attention")
    warm_up_gpu()
    dtype = torch.bfloat16
    print(f"{torch.cuda.get_device_name()}  dtype={dtype}  block_size={BLOCK_SIZE}")
    print(f"{'model':<13} {'case':<12} {'seqs':>4} {'q_len':>5} {'ctx':>5} "
          f"{'triton us':>10} {'ref us':>10} {'speedup':>8} {'KV GB/s':>8} {'max err':>8}")
    for model, (num_q_heads, num_kv_heads, head_dim) in MODELS.items():
        for name, num_seqs, q_len, ctx_len, tree in CASES:
            batch = make_batch(num_seqs, q_len, ctx_len, num_q_heads, num_kv_heads, head_dim, dtype, "cuda")
            tree_mask = two_branch_tree_mask(num_seqs, q_len, "cuda") if tree else None
            out_triton = paged_attention_triton(**batch, tree_mask=tree_mask)
            out_ref = paged_attention_ref(**batch, tree_mask=tree_mask)
            max_err = (out_triton.float() - out_ref.float()).abs().max().item()
            triton_ms = triton.testing.do_bench(lambda: paged_attention_triton(**batch, tree_mask=tree_mask))
            ref_ms = triton.testing.do_bench(lambda: paged_attention_ref(**batch, tree_mask=tree_mask))
            kv_bytes = 2 * num_seqs * (q_len + ctx_len) * num_kv_heads * head_dim * batch["k_cache"].element_size()
            print(f"{model:<13} {name:<12} {num_seqs:>4} {q_len:>5} {ctx_len:>5} {triton_ms * 1e3:>10.1f} "
                  f"{ref_ms * 1e3:>10.1f} {ref_ms / triton_ms:>7.1f}x {kv_bytes / triton_ms / 1e6:>8.0f} "
                  f"{max_err:>8.1e}")


if __name__ == "__main__":
    main()
