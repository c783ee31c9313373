"""The CPU backend of attention: RoPE, the KV write and paged attention in torch, with the same math as the Triton
path (:mod:`nanospec.kernels.rope_store_kv`, :mod:`nanospec.kernels.paged_attention`). What depends only on the batch
(:class:`RopeTables`, :class:`PagedAttentionPlan`, the K/V slots) is worked out once per forward for every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanospec.kernels.attention_mask import unpack_mask


class RopeTables:
    """``cos`` and a signed ``sin`` over the whole head (:mod:`nanospec.kernels.rope`'s formula),

        cos = [c | c],   sin = [-s | s],   rope(x) = x * cos + [x2 | x1] * sin

    head ``h``'s rows multiplied by ``head_scale[h]`` (``[H]``: the softmax scale folded into the query heads).
    """

    def __init__(self, positions: torch.Tensor, cos_sin_cache: torch.Tensor, head_scale: torch.Tensor):
        half_dim = cos_sin_cache.shape[-1] // 2
        cos_sin = cos_sin_cache.index_select(0, positions)
        cos, sin = cos_sin[:, :half_dim], cos_sin[:, half_dim:]
        self.cos = torch.cat((cos, cos), dim=-1).unsqueeze(1) * head_scale[:, None]  # [T, H, D]
        self.sin = torch.cat((-sin, sin), dim=-1).unsqueeze(1) * head_scale[:, None]

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, H, D]`` rotated (fp32 math, stored in x's dtype), out of place."""
        x32 = x if x.dtype == torch.float32 else x.float()
        swapped = torch.roll(x32, x.shape[-1] // 2, dims=-1)  # [x2 | x1]
        out = torch.addcmul(x32 * self.cos, swapped, self.sin)
        return out if out.dtype == x.dtype else out.to(x.dtype)


@dataclass
class _Sequence:
    """One sequence's rows of the batch and what each sees (see :class:`PagedAttentionPlan`)."""
    rows: slice                        # its rows of the batch, in order
    kv: slice | torch.Tensor           # its cache slots in position order: a slice of the flat slot axis, or indices
    context: int                       # how many of those slots come before this step's tokens
    seen: list[int | torch.Tensor]     # per row: the first n of those slots, or which of the step's tokens it sees
                                       # after the context (a tree node: its ancestors and itself, in order)


class PagedAttentionPlan:
    """Paged attention's per-batch work, done once per forward and shared by every layer.

    **Every row attends alone**, over exactly the slots it sees, in position order (the context, then the new tokens
    its mask allows: causally those up to itself; in a tree its ancestors and itself), the kv heads as the batch and
    each kv head's query heads as its query rows:

        out = softmax(q K^T) V        (two matmuls and a softmax, none of them split across threads)

    so a row's output depends only on its query and the K/V it sees: not on the batch, the step, chunking, the
    prefix cache or the thread count. With row-wise matmuls too, a token's K/V and logits are the same bits whether
    it was prefilled, decoded, verified or found cached. (Batched or padded matmuls, and the fused
    ``scaled_dot_product_attention``, round differently with shape and thread count.)

    A sequence's slots are a plain slice when its blocks are consecutive. A tree node that is not a prefix of the
    step's tokens has its ancestors' K/V copied over the step's own, right after the context, so that it too attends
    over one run of slots; the step's K/V are put back after the sequence's last row.
    """

    def __init__(self, block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                 block_size: int, group: int, tree_mask: torch.Tensor | None = None):
        device = block_tables.device
        self.group = group
        starts, lens, tables = query_start_loc.tolist(), seq_lens.tolist(), block_tables.tolist()
        self.sequences: list[_Sequence] = []
        for s, seq_len in enumerate(lens):
            start, end = starts[s], starts[s + 1]
            q_len, ctx_len = end - start, seq_len - (end - start)
            if q_len == 0:
                continue
            seen = list(range(ctx_len + 1, seq_len + 1))  # causal
            if tree_mask is not None:
                visible = unpack_mask(tree_mask[start:end], q_len)  # [q_len, q_len] bool
                for j in range(q_len):
                    nodes = visible[j].nonzero().squeeze(1)
                    is_prefix = torch.equal(nodes, torch.arange(len(nodes), device=device))
                    seen[j] = ctx_len + len(nodes) if is_prefix else nodes
            self.sequences.append(_Sequence(slice(start, end), _slots(tables[s], seq_len, block_size, device),
                                            ctx_len, seen))
        self.num_rows = sum(len(seq.seen) for seq in self.sequences)

    def attend(self, q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor) -> torch.Tensor:
        """``softmax(q K^T + mask) V`` for ``q [T, Hq, D]`` already multiplied by the scale; ``[T, Hq, D]``.
        ``k_slots`` / ``v_slots``: the cache with its block axes merged, ``[num_blocks * block_size, Hk, D]``."""
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = num_heads // self.group
        rows = (q if q.dtype == k_slots.dtype else q.to(k_slots.dtype)).view(num_tokens, num_kv_heads, self.group,
                                                                             head_dim)
        # rows of no sequence (padding) stay zero
        result = rows.new_empty(rows.shape) if self.num_rows == num_tokens else rows.new_zeros(rows.shape)
        for seq in self.sequences:
            k_seq, v_seq = k_slots[seq.kv], v_slots[seq.kv]        # [L, Hk, D]
            k_t, v = k_seq.permute(1, 2, 0), v_seq.transpose(0, 1)  # [Hk, D, L], [Hk, L, D]
            ctx, own = seq.context, None  # own: the step's K/V, kept aside while a tree node's ancestors stand there
            try:
                for j, seen in enumerate(seq.seen, start=seq.rows.start):
                    if isinstance(seen, int):  # the first ``seen`` slots
                        n = seen
                        if own is not None and n > ctx:
                            k_seq[ctx:n], v_seq[ctx:n] = own[0][: n - ctx], own[1][: n - ctx]
                    else:  # a tree node: its ancestors' K/V laid right after the context, over the step's own
                        if own is None:
                            own = k_seq[ctx:].clone(), v_seq[ctx:].clone()
                        n = ctx + len(seen)
                        torch.index_select(own[0], 0, seen, out=k_seq[ctx:n])
                        torch.index_select(own[1], 0, seen, out=v_seq[ctx:n])
                    scores = torch.bmm(rows[j], k_t[:, :, :n])                      # [Hk, group, n]
                    torch.bmm(torch.softmax(scores, dim=-1), v[:, :n], out=result[j])
            finally:
                if own is not None and isinstance(seq.kv, slice):  # the step's K/V back in the cache (a gathered
                    k_seq[ctx:], v_seq[ctx:] = own                  # copy is dropped)
        result = result.view(num_tokens, num_heads, head_dim)
        return result if result.dtype == q.dtype else result.to(q.dtype)


def _slots(table: list[int], seq_len: int, block_size: int, device) -> slice | torch.Tensor:
    """The flat cache slots of storage indices ``0 .. seq_len-1``: a slice when the blocks are consecutive."""
    num_blocks = (seq_len + block_size - 1) // block_size
    if all(table[i + 1] == table[i] + 1 for i in range(num_blocks - 1)):
        first = table[0] * block_size if num_blocks else 0
        return slice(first, first + seq_len)
    blocks = torch.tensor(table[:num_blocks], dtype=torch.int64, device=device)
    return (blocks[:, None] * block_size + torch.arange(block_size, device=device)).flatten()[:seq_len]


class CpuAttention:
    """One forward's plan (built once, shared by every layer) and a layer's attention from its fused ``qkv``."""

    def __init__(self, batch, block_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 cos_sin_cache: torch.Tensor, head_scale: torch.Tensor):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        # The rows of the tokens that write K/V (padding tokens have slot -1); None when all do, as in most batches.
        padded = bool((batch.slot_mapping < 0).any())
        self.real_rows = (batch.slot_mapping >= 0).nonzero().squeeze(1) if padded else None
        self.slot_mapping = batch.slot_mapping[self.real_rows] if padded else batch.slot_mapping
        self.rope = RopeTables(batch.positions, cos_sin_cache, head_scale)  # q's rows carry the softmax scale
        self.attention = PagedAttentionPlan(batch.block_tables, batch.seq_lens, batch.query_start_loc, block_size,
                                            num_heads // num_kv_heads, batch.tree_mask)

    def __call__(self, qkv: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor) -> torch.Tensor:
        """``qkv [T, (Hq + 2 Hk) * D]`` -> ``[T, Hq * D]``; writes the new K/V into the layer's cache, given with its
        block axes merged (``[num_blocks * block_size, Hk, D]``)."""
        T = qkv.shape[0]
        H, Hk, D = self.num_heads, self.num_kv_heads, self.head_dim
        heads = qkv.reshape(T, H + 2 * Hk, D)
        qk = self.rope.rotate(heads[:, : H + Hk])  # q heads come out scaled
        k, v = qk[:, H:], heads[:, H + Hk:]
        if self.real_rows is not None:
            k, v = k[self.real_rows], v[self.real_rows]
        k_slots.index_copy_(0, self.slot_mapping, k if k.dtype == k_slots.dtype else k.to(k_slots.dtype))
        v_slots.index_copy_(0, self.slot_mapping, v if v.dtype == v_slots.dtype else v.to(v_slots.dtype))
        return self.attention.attend(qk[:, :H], k_slots, v_slots).reshape(T, H * D)
