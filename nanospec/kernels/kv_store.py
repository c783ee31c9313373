"""Moving K/V inside the paged cache (``copy_kv_slots``), and the slot write it is built on.

Per layer ``k_cache, v_cache: [num_blocks, block_size, Hk, D]``, slot ``block_id * block_size + offset``.

    store_kv:       k_cache[slot_mapping[t]] = k[t], v likewise, for every t with slot_mapping[t] >= 0
    copy_kv_slots:  cache[dst_slots[i]] = old cache[src_slots[i]] for K and V, every read before any write

so a destination may be another pair's source; ``dst_slots`` must be distinct.
"""

from __future__ import annotations

import torch

from nanospec.kernels.backend import dispatch, tl, triton


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_token_stride, k_head_stride,
                     v_token_stride, v_head_stride, k_cache_slot_stride, k_cache_head_stride, v_cache_slot_stride,
                     v_cache_head_stride, num_heads, head_dim, BLOCK_HEADS: tl.constexpr, BLOCK_DIM: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token
        return
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    dims = tl.arange(0, BLOCK_DIM)[None, :]
    mask = (heads < num_heads) & (dims < head_dim)

    k = tl.load(k_ptr + token * k_token_stride + heads * k_head_stride + dims, mask=mask)
    v = tl.load(v_ptr + token * v_token_stride + heads * v_head_stride + dims, mask=mask)
    tl.store(k_cache_ptr + slot * k_cache_slot_stride + heads * k_cache_head_stride + dims, k, mask=mask)
    tl.store(v_cache_ptr + slot * v_cache_slot_stride + heads * v_cache_head_stride + dims, v, mask=mask)


@triton.jit
def _gather_kv_kernel(k_cache_ptr, v_cache_ptr, k_out_ptr, v_out_ptr, slots_ptr, k_cache_slot_stride,
                      k_cache_head_stride, v_cache_slot_stride, v_cache_head_stride, num_heads, head_dim,
                      BLOCK_HEADS: tl.constexpr, BLOCK_DIM: tl.constexpr):
    index = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + index).to(tl.int64)
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    dims = tl.arange(0, BLOCK_DIM)[None, :]
    mask = (heads < num_heads) & (dims < head_dim)

    k = tl.load(k_cache_ptr + slot * k_cache_slot_stride + heads * k_cache_head_stride + dims, mask=mask)
    v = tl.load(v_cache_ptr + slot * v_cache_slot_stride + heads * v_cache_head_stride + dims, mask=mask)
    out_offsets = (index * num_heads + heads) * head_dim + dims
    tl.store(k_out_ptr + out_offsets, k, mask=mask)
    tl.store(v_out_ptr + out_offsets, v, mask=mask)


def _slot_view(cache: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, block_size, Hk, D]`` -> ``[num_blocks * block_size, Hk, D]`` without a copy."""
    return cache.view(-1, *cache.shape[2:])


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    real = slot_mapping >= 0
    k, v, slot_mapping = k[real], v[real], slot_mapping[real]
    _slot_view(k_cache).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    _slot_view(v_cache).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def store_kv_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    k_slots, v_slots = _slot_view(k_cache), _slot_view(v_cache)
    _store_kv_kernel[(num_tokens,)](k, v, k_slots, v_slots, slot_mapping, k.stride(0), k.stride(1), v.stride(0),
                                    v.stride(1), k_slots.stride(0), k_slots.stride(1), v_slots.stride(0),
                                    v_slots.stride(1), num_heads, head_dim,
                                    BLOCK_HEADS=triton.next_power_of_2(num_heads),
                                    BLOCK_DIM=triton.next_power_of_2(head_dim))


def copy_kv_slots_ref(k_cache: torch.Tensor, v_cache: torch.Tensor, src_slots: torch.Tensor,
                      dst_slots: torch.Tensor) -> None:
    """``cache[dst_slots[i]] = old cache[src_slots[i]]`` for K and V, all reads before any writes."""
    for cache in (k_cache, v_cache):
        slots = _slot_view(cache)
        slots.index_copy_(0, dst_slots, slots.index_select(0, src_slots))


def copy_kv_slots_triton(k_cache: torch.Tensor, v_cache: torch.Tensor, src_slots: torch.Tensor,
                         dst_slots: torch.Tensor) -> None:
    num_pairs = src_slots.shape[0]
    if num_pairs == 0:
        return
    k_slots, v_slots = _slot_view(k_cache), _slot_view(v_cache)
    num_heads, head_dim = k_slots.shape[1:]
    k_moved = torch.empty((num_pairs, num_heads, head_dim), dtype=k_cache.dtype, device=k_cache.device)
    v_moved = torch.empty((num_pairs, num_heads, head_dim), dtype=v_cache.dtype, device=v_cache.device)
    _gather_kv_kernel[(num_pairs,)](k_slots, v_slots, k_moved, v_moved, src_slots, k_slots.stride(0), k_slots.stride(1),
                                    v_slots.stride(0), v_slots.stride(1), num_heads, head_dim,
                                    BLOCK_HEADS=triton.next_power_of_2(num_heads),
                                    BLOCK_DIM=triton.next_power_of_2(head_dim))
    store_kv_triton(k_moved, v_moved, k_cache, v_cache, dst_slots)


copy_kv_slots = dispatch(copy_kv_slots_triton, copy_kv_slots_ref)
