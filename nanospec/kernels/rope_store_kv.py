"""RoPE and the KV write in one launch, for every new token t:

    q_out[t]                    = rope(q[t], positions[t])          (returned, contiguous)
    k_cache[slot_mapping[t]]    = rope(k[t], positions[t])          (when slot_mapping[t] >= 0)
    v_cache[slot_mapping[t]]    = v[t]

``q [T, Hq, D]``, ``k, v [T, Hk, D]`` (strided views of a fused qkv, last dim contiguous); ``rope`` and the cache
layout as in :mod:`nanospec.kernels.rope` and :mod:`nanospec.kernels.kv_store`, whose references this one chains.
Triton: one program per token. The caches must have k's dtype.
"""

from __future__ import annotations

import torch

from nanospec.kernels.backend import dispatch, tl, triton
from nanospec.kernels.kv_store import store_kv_ref
from nanospec.kernels.rope import apply_rope_ref, load_cos_sin, rotate_heads


@triton.jit
def _rope_store_kv_kernel(q_ptr, k_ptr, v_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, positions_ptr, slot_mapping_ptr,
                          cos_sin_ptr, q_token_stride, q_head_stride, k_token_stride, k_head_stride, v_token_stride,
                          v_head_stride, k_cache_slot_stride, k_cache_head_stride, v_cache_slot_stride,
                          v_cache_head_stride, num_q_heads, num_kv_heads, half_dim, BLOCK_Q_HEADS: tl.constexpr,
                          BLOCK_KV_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_DIM: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cos, sin = load_cos_sin(positions_ptr, cos_sin_ptr, token, half_dim, BLOCK_HALF)
    rotate_heads(q_ptr + token * q_token_stride, q_out_ptr + token * num_q_heads * 2 * half_dim, q_head_stride,
                  2 * half_dim, num_q_heads, half_dim, cos, sin, BLOCK_Q_HEADS, BLOCK_HALF)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # a padding token writes no K/V
        return
    rotate_heads(k_ptr + token * k_token_stride, k_cache_ptr + slot * k_cache_slot_stride, k_head_stride,
                  k_cache_head_stride, num_kv_heads, half_dim, cos, sin, BLOCK_KV_HEADS, BLOCK_HALF)
    heads = tl.arange(0, BLOCK_KV_HEADS)[:, None]
    dims = tl.arange(0, BLOCK_DIM)[None, :]
    mask = (heads < num_kv_heads) & (dims < 2 * half_dim)
    v = tl.load(v_ptr + token * v_token_stride + heads * v_head_stride + dims, mask=mask)
    tl.store(v_cache_ptr + slot * v_cache_slot_stride + heads * v_cache_head_stride + dims,
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def rope_store_kv_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> torch.Tensor:
    """Rotated ``q``; writes the rotated ``k`` and ``v`` into the caches (see the module docstring)."""
    q_out, k_out = apply_rope_ref(q, k, positions, cos_sin_cache)
    store_kv_ref(k_out, v, k_cache, v_cache, slot_mapping)
    return q_out


def rope_store_kv_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                         cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_mapping: torch.Tensor) -> torch.Tensor:
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert k_cache.dtype == k.dtype and v_cache.dtype == v.dtype, "the caches must have k's and v's dtype"
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    k_slots, v_slots = k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])
    _rope_store_kv_kernel[(num_tokens,)](q, k, v, q_out, k_slots, v_slots, positions, slot_mapping,
                                         cos_sin_cache.contiguous(), q.stride(0), q.stride(1), k.stride(0),
                                         k.stride(1), v.stride(0), v.stride(1),
                                         k_slots.stride(0), k_slots.stride(1), v_slots.stride(0), v_slots.stride(1),
                                         num_q_heads, num_kv_heads, head_dim // 2,
                                         BLOCK_Q_HEADS=triton.next_power_of_2(num_q_heads),
                                         BLOCK_KV_HEADS=triton.next_power_of_2(num_kv_heads),
                                         BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
                                         BLOCK_DIM=triton.next_power_of_2(head_dim))
    return q_out


rope_store_kv = dispatch(rope_store_kv_triton, rope_store_kv_ref)
