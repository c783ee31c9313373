"""Paged attention over a ragged batch: prefill, decode and verify in one call, causal or tree-masked.

Sequence ``s`` has ``q_len = query_start_loc[s+1] - query_start_loc[s]`` new query tokens (rows
``query_start_loc[s]...`` of ``q``) and ``seq_len = seq_lens[s]`` tokens in all, the last ``q_len`` of them
new, so ``ctx_len = seq_len - q_len``; new token ``i`` has storage index ``ctx_len + i``. The K/V of every
token, the new ones included, are already in the paged cache ``[num_blocks, block_size, Hk, D]``:
storage index ``j`` lives at slot ``block_tables[s, j // block_size] * block_size + j % block_size``.

Query ``i`` of sequence ``s`` (query head ``h``, kv head ``h // (Hq // Hk)``) sees storage index ``j`` iff

    j < ctx_len                                         (the cached context), or
    j - ctx_len <= i                                    (no tree_mask: causal), or
    bit (j - ctx_len) of tree_mask[query_start_loc[s] + i]   (see attention_mask.py)

and    out[t, h] = sum_j softmax_j(scale * q[t, h] . k[j]) v[j]    over the visible j.

The Triton kernel runs one program per (sequence, block of BLOCK_M query tokens, kv head). The query
heads of one kv head are processed together, so K/V are read once per GQA group: tile row ``r`` is
query token ``r // GROUP``, query head ``r % GROUP`` of the group. Keys are visited in tiles of
BLOCK_N with an online (flash-attention) softmax; each key's slot is looked up in the block table, so
a tile may span cache blocks. Without a tree mask the loop stops at the last key the block's last
query can see.

The torch reference works out what depends only on the batch (each sequence's cache slots and mask)
once, in :class:`PagedAttentionPlan`; the CPU engine builds one plan per forward for all its layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanospec.kernels.attention_mask import unpack_mask
from nanospec.kernels.backend import use_triton

_LOG2E = 1.4426950408889634


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, tree_mask_ptr,
    scale_log2e,
    stride_q_token, stride_q_head,
    stride_k_block, stride_k_slot, stride_k_head,
    stride_v_block, stride_v_slot, stride_v_head,
    stride_out_token, stride_out_head,
    stride_block_table, stride_tree_mask,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_TREE_MASK: tl.constexpr, DOT_FP32: tl.constexpr,
):
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


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
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


@dataclass
class _Group:
    """Query rows of the batch and the cache slots they attend over (see :class:`PagedAttentionPlan`)."""
    rows: slice | torch.Tensor      # a slice of the batch's rows, or row indices (batched decode)
    kv: slice | torch.Tensor        # a slice of the flat slot axis, or slot indices ([S, L] for batched decode)
    q_len: int                      # new tokens per sequence
    bias: torch.Tensor | None       # additive mask (0 / -inf): [q_len * group, L], or [S, 1, 1, L] batched
    batched: bool = False


class PagedAttentionPlan:
    """The torch reference's per-batch work, done once per forward and shared by every layer.

    For each sequence: the flat cache slots of its storage indices (a plain slice when its blocks are
    consecutive, as a lone request's are) and its additive mask among the new tokens (causal, or the
    tree bitmask unpacked), with one row per (new token, query head of a kv head's group), token-major.
    Sequences with one new token each, when there are several, are attended together: padded to the
    longest, in one batched matmul. :meth:`attend` then costs a handful of torch ops per layer.
    """

    def __init__(self, block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                 block_size: int, group: int, tree_mask: torch.Tensor | None = None):
        device = block_tables.device
        self.group = group
        starts, lens, tables = query_start_loc.tolist(), seq_lens.tolist(), block_tables.tolist()
        self.num_tokens = starts[-1] if starts else 0
        q_lens = [starts[s + 1] - starts[s] for s in range(len(lens))]
        decode = [s for s, q_len in enumerate(q_lens) if q_len == 1]
        batched = set(decode) if len(decode) > 1 else set()
        self.groups: list[_Group] = []
        if batched:
            self.groups.append(self._batched_decode(decode, starts, lens, tables, block_size, device))
        for s, q_len in enumerate(q_lens):
            if q_len == 0 or s in batched:
                continue
            seq_len, ctx_len = lens[s], lens[s] - q_len
            visible = None
            if tree_mask is not None and q_len > 1:
                visible = torch.ones(q_len, seq_len, dtype=torch.bool, device=device)
                visible[:, ctx_len:] = unpack_mask(tree_mask[starts[s]:starts[s + 1]], q_len)
            elif q_len > 1:
                visible = torch.ones(q_len, seq_len, dtype=torch.bool, device=device).tril(diagonal=ctx_len)
            bias = None
            if visible is not None:
                bias = torch.zeros(visible.shape, device=device).masked_fill_(~visible, float("-inf"))
                bias = bias.repeat_interleave(group, dim=0)
            self.groups.append(_Group(slice(starts[s], starts[s + 1]), _slots(tables[s], seq_len, block_size, device),
                                      q_len, bias))
        self.one_group_for_all_rows = (len(self.groups) == 1 and isinstance(self.groups[0].rows, slice)
                                       and self.groups[0].rows == slice(0, self.num_tokens))

    def _batched_decode(self, seqs, starts, lens, tables, block_size, device) -> _Group:
        longest = max(lens[s] for s in seqs)
        slots = torch.zeros(len(seqs), longest, dtype=torch.int64, device=device)  # padding reads slot 0, masked
        bias = torch.zeros(len(seqs), 1, 1, longest, device=device)
        for i, s in enumerate(seqs):
            slots[i, :lens[s]] = _slot_indices(tables[s], lens[s], block_size, device)
            bias[i, ..., lens[s]:] = float("-inf")
        rows = [starts[s] for s in seqs]
        in_order = rows == list(range(self.num_tokens))
        return _Group(slice(0, self.num_tokens) if in_order else torch.tensor(rows, device=device), slots, 1, bias,
                      batched=True)

    def attend(self, q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor) -> torch.Tensor:
        """``softmax(q K^T + mask) V`` for ``q [T, Hq, D]`` already multiplied by the scale; ``[T, Hq, D]``.

        ``k_slots`` / ``v_slots``: the cache with its block axes merged, ``[num_blocks * block_size, Hk, D]``.
        """
        if self.one_group_for_all_rows:
            return self._attend_group(self.groups[0], q, k_slots, v_slots)
        out = q.new_zeros(q.shape)
        for g in self.groups:
            out[g.rows] = self._attend_group(g, q[g.rows], k_slots, v_slots)
        return out

    def _attend_group(self, g: _Group, q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor) -> torch.Tensor:
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads, group = num_heads // self.group, self.group
        q_in = q if q.dtype == k_slots.dtype else q.to(k_slots.dtype)
        if g.batched:                                  # S sequences, one token each, padded to the longest
            k = k_slots[g.kv].permute(0, 2, 3, 1)      # [S, Hk, D, L]
            v = v_slots[g.kv].transpose(1, 2)          # [S, Hk, L, D]
            scores = torch.matmul(q_in.view(-1, num_kv_heads, group, head_dim), k)
            scores = scores.add_(g.bias if g.bias.dtype == scores.dtype else g.bias.to(scores.dtype))
        else:                                          # one sequence: [Hk, q_len * group, L]
            k = k_slots[g.kv].permute(1, 2, 0)         # [Hk, D, L]
            v = v_slots[g.kv].transpose(0, 1)          # [Hk, L, D]
            if g.q_len == 1:                           # rows are the heads of each group already
                q_in = q_in.view(num_kv_heads, group, head_dim)
            else:
                q_in = q_in.view(g.q_len, num_kv_heads, group, head_dim).transpose(0, 1)
                q_in = q_in.reshape(num_kv_heads, g.q_len * group, head_dim)
            if g.bias is None:
                scores = torch.bmm(q_in, k)
            else:
                scores = torch.baddbmm(g.bias if g.bias.dtype == k.dtype else g.bias.to(k.dtype), q_in, k)
        probs = torch.softmax(scores, dim=-1) if scores.dtype == torch.float32 else \
            torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
        result = torch.matmul(probs, v) if g.batched else torch.bmm(probs, v)
        if not g.batched and g.q_len > 1:              # [Hk, q_len * group, D] -> [q_len, Hk, group, D]
            result = result.view(num_kv_heads, g.q_len, group, head_dim).transpose(0, 1)
        result = result.reshape(num_tokens, num_heads, head_dim)
        return result if result.dtype == q.dtype else result.to(q.dtype)


def _slot_indices(table: list[int], seq_len: int, block_size: int, device) -> torch.Tensor:
    blocks = torch.tensor(table[: (seq_len + block_size - 1) // block_size], dtype=torch.int64, device=device)
    return (blocks[:, None] * block_size + torch.arange(block_size, device=device)).flatten()[:seq_len]


def _slots(table: list[int], seq_len: int, block_size: int, device) -> slice | torch.Tensor:
    """The flat cache slots of storage indices ``0 .. seq_len-1``: a slice when the blocks are consecutive."""
    num_blocks = (seq_len + block_size - 1) // block_size
    if all(table[i + 1] == table[i] + 1 for i in range(num_blocks - 1)):
        first = table[0] * block_size if num_blocks else 0
        return slice(first, first + seq_len)
    return _slot_indices(table, seq_len, block_size, device)


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    plan = PagedAttentionPlan(block_tables, seq_lens, query_start_loc, k_cache.shape[1],
                              q.shape[1] // k_cache.shape[2], tree_mask)
    return plan.attend(q * scale, k_cache.flatten(0, 1), v_cache.flatten(0, 1))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of the new tokens ``q [T, Hq, D]`` over their sequences' paged K/V; returns ``[T, Hq, D]``."""
    args = (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, max_query_len, tree_mask)
    return paged_attention_triton(*args) if use_triton(q) else paged_attention_ref(*args)
