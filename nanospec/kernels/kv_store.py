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
def _move_kv_kernel(k_ptr, v_ptr, k_out_ptr, v_out_ptr, slots_ptr, k_row_stride, k_head_stride, v_row_stride,
                    v_head_stride, k_out_row_stride, k_out_head_stride, v_out_row_stride, v_out_head_stride, num_heads,
                    head_dim, GATHER: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_DIM: tl.constexpr):
    """Row ``i`` of k and v to row ``slots[i]`` of the outputs, or with ``GATHER`` row ``slots[i]`` to row ``i``;
    nothing for a negative slot (a padding token)."""
    index = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + index).to(tl.int64)
    if slot < 0:
        return
    if GATHER:
        src = slot
        dst = index
    else:
        src = index
        dst = slot
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    dims = tl.arange(0, BLOCK_DIM)[None, :]
    mask = (heads < num_heads) & (dims < head_dim)

    k = tl.load(k_ptr + src * k_row_stride + heads * k_head_stride + dims, mask=mask)
    v = tl.load(v_ptr + src * v_row_stride + heads * v_head_stride + dims, mask=mask)
    tl.store(k_out_ptr + dst * k_out_row_stride + heads * k_out_head_stride + dims, k, mask=mask)
    tl.store(v_out_ptr + dst * v_out_row_stride + heads * v_out_head_stride + dims, v, mask=mask)


def _slot_view(cache: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, block_size, Hk, D]`` -> ``[num_blocks * block_size, Hk, D]`` without a copy."""
    return cache.view(-1, *cache.shape[2:])


def _move_kv(k, v, k_out, v_out, slots, gather: bool) -> None:
    """Launch :func:`_move_kv_kernel`, one program per slot; every tensor ``[rows, Hk, D]``, contiguous in D."""
    num_heads, head_dim = k.shape[1:]
    _move_kv_kernel[(slots.shape[0],)](k, v, k_out, v_out, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                       k_out.stride(0), k_out.stride(1), v_out.stride(0), v_out.stride(1), num_heads,
                                       head_dim, GATHER=gather, BLOCK_HEADS=triton.next_power_of_2(num_heads),
                                       BLOCK_DIM=triton.next_power_of_2(head_dim))


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    real = slot_mapping >= 0
    k, v, slot_mapping = k[real], v[real], slot_mapping[real]
    _slot_view(k_cache).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    _slot_view(v_cache).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def store_kv_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    if k.shape[0] == 0:
        return
    k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (k, v))
    _move_kv(k, v, _slot_view(k_cache), _slot_view(v_cache), slot_mapping, gather=False)


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
    _move_kv(k_slots, v_slots, k_moved, v_moved, src_slots, gather=True)
    store_kv_triton(k_moved, v_moved, k_cache, v_cache, dst_slots)


copy_kv_slots = dispatch(copy_kv_slots_triton, copy_kv_slots_ref)
