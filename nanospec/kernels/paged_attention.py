"""Paged attention over a ragged batch: prefill, decode and verify in one call, causal or tree-masked.

Sequence ``s`` has ``q_len`` new query tokens (rows ``query_start_loc[s]...`` of ``q``) and ``seq_len = seq_lens[s]``
tokens in all, so ``ctx_len = seq_len - q_len``. Every token's K/V is already in the cache
``[num_blocks, block_size, Hk, D]``: storage index ``j`` at slot ``block_tables[s, j // block_size] * block_size +
j % block_size``. Query ``i`` (head ``h``, kv head ``h // (Hq // Hk)``) sees index ``j`` iff

    j < ctx_len, or  j - ctx_len <= i (causal), or  bit (j - ctx_len) of tree_mask[query_start_loc[s] + i]

and    out[t, h] = sum_j softmax_j(scale * q[t, h] . k[j]) v[j]    over the visible j.

Triton: one program per (sequence, BLOCK_M query tokens, kv head), the query heads of a GQA group together, keys in
tiles of BLOCK_N with an online softmax. The CPU backend is :mod:`nanospec.kernels.cpu_attention`.
"""

from __future__ import annotations

import torch

from nanospec.kernels.backend import dispatch, tl, triton

_LOG2E = 1.4426950408889634


@triton.jit
def _paged_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
                            block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, tree_mask_ptr, scale_log2e,
                            stride_q_token, stride_q_head, stride_k_block, stride_k_slot, stride_k_head,
                            stride_v_block, stride_v_slot, stride_v_head, stride_out_token, stride_out_head,
                            stride_block_table, stride_tree_mask,
                            HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                            HAS_TREE_MASK: tl.constexpr, DOT_FP32: tl.constexpr):
    seq = tl.program_id(0)
    first_query = tl.program_id(1) * BLOCK_M
    kv_head = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if first_query >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len

    # Tile rows: (query token, query head of this kv head's group) pairs.
    rows = tl.arange(0, BLOCK_R)
    query_idx = first_query + rows // GROUP
    q_head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_M * GROUP) & (query_idx < q_len)
    query_row = (q_start + query_idx).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM

    q_offsets = query_row[:, None] * stride_q_token + q_head[:, None] * stride_q_head + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    if HAS_TREE_MASK:
        kv_end = seq_len
    else:
        kv_end = ctx_len + tl.minimum(first_query + BLOCK_M, q_len)

    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_block_table
    # A finite start for the running max: rows that see nothing in a tile give exp2(-inf) = 0, never NaN.
    m_i = tl.full([BLOCK_R], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)

    for key_start in range(0, kv_end, BLOCK_N):
        keys = key_start + tl.arange(0, BLOCK_N)
        key_valid = keys < kv_end
        physical_block = tl.load(block_table_row + keys // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        slot_in_block = keys % BLOCK_SIZE
        kv_mask = key_valid[None, :] & dim_valid[:, None]

        k_offsets = (physical_block[None, :] * stride_k_block + slot_in_block[None, :] * stride_k_slot
                     + kv_head * stride_k_head + dims[:, None])
        k_t = tl.load(k_cache_ptr + k_offsets, mask=kv_mask, other=0.0)  # [BLOCK_D, BLOCK_N]
        if DOT_FP32:
            k_t = k_t.to(tl.float32)
        # input_precision="ieee" keeps fp32 dots exact (no tf32); it does not affect fp16/bf16 operands.
        scores = tl.dot(q, k_t, input_precision="ieee") * scale_log2e

        new_idx = keys - ctx_len  # index among the new tokens; negative for the context
        if HAS_TREE_MASK:
            bit = tl.maximum(new_idx, 0)
            word_ptrs = tree_mask_ptr + query_row[:, None] * stride_tree_mask + (bit // 64)[None, :]
            word_mask = row_valid[:, None] & (key_valid & (new_idx >= 0))[None, :]
            words = tl.load(word_ptrs, mask=word_mask, other=0)
            new_visible = ((words >> (bit % 64)[None, :]) & 1) != 0
        else:
            new_visible = new_idx[None, :] <= query_idx[:, None]
        visible = key_valid[None, :] & ((new_idx < 0)[None, :] | new_visible)
        scores = tl.where(visible, scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)

        v_offsets = (physical_block[:, None] * stride_v_block + slot_in_block[:, None] * stride_v_slot
                     + kv_head * stride_v_head + dims[None, :])
        v = tl.load(v_cache_ptr + v_offsets, mask=key_valid[:, None] & dim_valid[None, :], other=0.0)
        if DOT_FP32:
            v = v.to(tl.float32)
        else:
            p = p.to(v.dtype)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new

    l_i = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_i[:, None]
    out_offsets = query_row[:, None] * stride_out_token + q_head[:, None] * stride_out_head + dims[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, max_query_len: int,
                           tree_mask: torch.Tensor | None = None) -> torch.Tensor:
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_q_heads % num_kv_heads == 0, "query heads must be a multiple of kv heads"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "the KV cache must be contiguous in head_dim"
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    num_seqs = block_tables.shape[0]
    if num_tokens == 0 or num_seqs == 0 or max_query_len == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if tree_mask is not None:
        assert tree_mask.dtype == torch.int64 and tree_mask.shape[0] == num_tokens
        tree_mask = tree_mask.contiguous()

    group = num_q_heads // num_kv_heads
    # Tile rows = BLOCK_M query tokens x GROUP heads, a power of two >= 16 (tl.dot's minimum).
    block_r = max(16, triton.next_power_of_2(group), min(64, triton.next_power_of_2(max_query_len * group)))
    block_m = block_r // group
    grid = (num_seqs, triton.cdiv(max_query_len, block_m), num_kv_heads)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out,
        block_tables, seq_lens, query_start_loc, tree_mask if tree_mask is not None else query_start_loc,
        scale * _LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        block_tables.stride(0), tree_mask.stride(0) if tree_mask is not None else 0,
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size, GROUP=group,
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_N=64, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        HAS_TREE_MASK=tree_mask is not None,
        # On GPU fp16/bf16 operands go straight to the tensor cores; the interpreter needs fp32 (bf16 dots are wrong).
        DOT_FP32=(not q.is_cuda) or q.dtype == torch.float32,
        num_warps=4,
    )
    return out


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, max_query_len: int,
                        tree_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The formula, one sequence at a time, in fp32: ``[T, Hq, D]``."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    block_size, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    k_slots, v_slots = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for s, seq_len in enumerate(lens):
        q_len = starts[s + 1] - starts[s]
        if q_len == 0:
            continue
        keys = torch.arange(seq_len, device=q.device)
        slots = block_tables[s, keys // block_size].long() * block_size + keys % block_size
        k = k_slots[slots].float().repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v_slots[slots].float().repeat_interleave(group, dim=1)
        new = keys - (seq_len - q_len)  # index among the new tokens; negative for the context
        if tree_mask is None:
            new_visible = new[None, :] <= torch.arange(q_len, device=q.device)[:, None]
        else:
            bits = new.clamp(min=0)
            words = tree_mask[starts[s]:starts[s + 1]][:, bits // 64]
            new_visible = ((words >> (bits % 64)) & 1).bool()
        visible = (new < 0)[None, :] | new_visible  # [q_len, L]
        scores = torch.einsum("qhd,khd->hqk", q[starts[s]:starts[s + 1]].float(), k) * scale
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out[starts[s]:starts[s + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


paged_attention = dispatch(paged_attention_triton, paged_attention_ref)
