"""The CPU backend of attention: RoPE, the KV write and paged attention in torch, with what depends only on the batch
worked out once per forward instead of once per layer.

Same math as the Triton path (:mod:`nanospec.kernels.rope_store_kv`, :mod:`nanospec.kernels.paged_attention`); on a
CPU the matrix-vector products are the real work and per-op overhead is what is left to cut. :class:`CpuAttention`
holds the batch's plan, shared by every layer:

* :class:`RopeTables`: ``cos`` and a signed ``sin`` over whole heads, with the softmax scale folded into the query
  heads, so rotating a layer's q and k is three ops;
* :class:`PagedAttentionPlan`: the cache slots each row attends over (a plain slice when its blocks are consecutive, as
  a lone request's are): a row that wants logits alone, over exactly the slots it sees (batch-invariant), a prefill
  chunk as one group with its additive mask (causal, or the tree bitmask unpacked);
* where each real (non-padding) token's K/V goes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanospec.kernels.attention_mask import unpack_mask


class RopeTables:
    """``cos`` and a signed ``sin`` over the whole head (:mod:`nanospec.kernels.rope`'s formula),

        cos = [c | c],   sin = [-s | s],   rope(x) = x * cos + [x2 | x1] * sin

    (the two halves of the rotation in three ops). ``head_scale`` ``[H]`` optionally multiplies head ``h``'s rows by
    ``head_scale[h]``: the softmax scale is folded into the query heads this way.
    """

    def __init__(self, positions: torch.Tensor, cos_sin_cache: torch.Tensor, head_scale: torch.Tensor | None = None):
        half_dim = cos_sin_cache.shape[-1] // 2
        cos_sin = cos_sin_cache.index_select(0, positions)
        cos, sin = cos_sin[:, :half_dim], cos_sin[:, half_dim:]
        self.cos = torch.cat((cos, cos), dim=-1).unsqueeze(1)  # [T, 1, D]
        self.sin = torch.cat((-sin, sin), dim=-1).unsqueeze(1)
        if head_scale is not None:  # [T, H, D]
            self.cos = self.cos * head_scale[:, None]
            self.sin = self.sin * head_scale[:, None]

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, H, D]`` rotated (fp32 math, stored in x's dtype), out of place."""
        x32 = x if x.dtype == torch.float32 else x.float()
        swapped = torch.roll(x32, x.shape[-1] // 2, dims=-1)  # [x2 | x1]
        out = torch.addcmul(x32 * self.cos, swapped, self.sin)
        return out if out.dtype == x.dtype else out.to(x.dtype)


@dataclass
class _Group:
    """Query rows of the batch and the cache slots they attend over (see :class:`PagedAttentionPlan`)."""
    rows: slice                     # a slice of the batch's rows
    kv: slice | torch.Tensor        # a slice of the flat slot axis, or slot indices
    q_len: int                      # new tokens of the sequence in this group
    bias: torch.Tensor | None       # additive mask (0 / -inf), [q_len * group, L]; None: each row sees every slot


class PagedAttentionPlan:
    """Paged attention's per-batch work, done once per forward and shared by every layer.

    **Batch-invariant where it matters.** A row that wants logits (a decode token, every node a step verifies) is
    attended alone, over exactly the slots it sees, in position order: the context, then its ancestors and itself.
    That is the very computation (the same ops, shapes and memory layout) plain decoding does for that token once
    it is committed, so its output does not depend on the batch, on the other guesses, or on the step: a
    verified token's K/V and logits are bit for bit a decoded token's. (BLAS picks its kernels by shape: one
    matmul over several rows, or over keys padded and masked, rounds differently. With the CPU's bfloat16 matmul
    inputs, such a difference can move a value across a rounding step and change a near-tie.)

    Rows that want no logits (a prefill chunk but its last row) are attended together, one group per sequence with
    its additive mask (causal, or the tree bitmask unpacked), one row per (new token, query head of a kv head's
    group), token-major. Each group's slots are a plain slice when its blocks are consecutive, as a lone request's
    are. :meth:`attend` costs a handful of torch ops per group and layer.
    """

    def __init__(self, block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                 block_size: int, group: int, tree_mask: torch.Tensor | None = None,
                 logits_indices: torch.Tensor | None = None):
        device = block_tables.device
        self.group = group
        starts, lens, tables = query_start_loc.tolist(), seq_lens.tolist(), block_tables.tolist()
        self.num_tokens = starts[-1] if starts else 0
        wants_logits = set(logits_indices.tolist()) if logits_indices is not None else set()
        self.groups: list[_Group] = []
        for s, seq_len in enumerate(lens):
            start, end = starts[s], starts[s + 1]
            q_len, ctx_len = end - start, seq_len - (end - start)
            if q_len == 0:
                continue
            if all(row in wants_logits for row in range(start, end)):
                self.groups.extend(self._rows_alone(tables[s], start, q_len, ctx_len, block_size, device,
                                                    tree_mask[start:end] if tree_mask is not None else None))
                continue
            visible = None
            if tree_mask is not None and q_len > 1:
                visible = torch.ones(q_len, seq_len, dtype=torch.bool, device=device)
                visible[:, ctx_len:] = unpack_mask(tree_mask[start:end], q_len)
            elif q_len > 1:
                visible = torch.ones(q_len, seq_len, dtype=torch.bool, device=device).tril(diagonal=ctx_len)
            bias = None
            if visible is not None:
                bias = torch.zeros(visible.shape, device=device).masked_fill_(~visible, float("-inf"))
                bias = bias.repeat_interleave(group, dim=0)
            self.groups.append(_Group(slice(start, end), _slots(tables[s], seq_len, block_size, device), q_len, bias))
        self.one_group_for_all_rows = len(self.groups) == 1 and self.groups[0].rows == slice(0, self.num_tokens)

    @staticmethod
    def _rows_alone(table: list[int], start: int, q_len: int, ctx_len: int, block_size: int, device,
                    tree_mask: torch.Tensor | None) -> list[_Group]:
        """One group per row: the row sees the context and the new tokens its mask allows (causal: those up to
        itself), in position order."""
        if tree_mask is None:
            return [_Group(slice(start + j, start + j + 1), _slots(table, ctx_len + j + 1, block_size, device), 1,
                           None) for j in range(q_len)]
        visible = unpack_mask(tree_mask, q_len)  # [q_len, q_len] bool
        all_slots = None
        groups = []
        for j in range(q_len):
            seen = visible[j].nonzero().squeeze(1)
            if torch.equal(seen, torch.arange(len(seen), device=device)):  # a prefix: as a chain
                kv = _slots(table, ctx_len + len(seen), block_size, device)
            else:
                if all_slots is None:
                    all_slots = _slot_indices(table, ctx_len + q_len, block_size, device)
                kv = torch.cat([all_slots[:ctx_len], all_slots[ctx_len + seen]])
            groups.append(_Group(slice(start + j, start + j + 1), kv, 1, None))
        return groups

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
        if g.q_len == 1 and g.bias is None:            # one row over the slots it sees: one fused op
            result = F.scaled_dot_product_attention(q_in.view(1, num_heads, 1, head_dim),
                                                    k_slots[g.kv].transpose(0, 1).unsqueeze(0),
                                                    v_slots[g.kv].transpose(0, 1).unsqueeze(0), scale=1.0,
                                                    enable_gqa=True).view(1, num_heads, head_dim)
            return result if result.dtype == q.dtype else result.to(q.dtype)
        k = k_slots[g.kv].permute(1, 2, 0)             # [Hk, D, L]
        v = v_slots[g.kv].transpose(0, 1)              # [Hk, L, D]
        if g.q_len == 1:                               # rows are the heads of each group already
            q_in = q_in.view(num_kv_heads, group, head_dim)
        else:                                          # [Hk, q_len * group, D]
            q_in = q_in.view(g.q_len, num_kv_heads, group, head_dim).transpose(0, 1)
            q_in = q_in.reshape(num_kv_heads, g.q_len * group, head_dim)
        if g.bias is None:
            scores = torch.bmm(q_in, k)
        else:
            scores = torch.baddbmm(g.bias if g.bias.dtype == k.dtype else g.bias.to(k.dtype), q_in, k)
        probs = torch.softmax(scores, dim=-1) if scores.dtype == torch.float32 else \
            torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
        result = torch.bmm(probs, v)
        if g.q_len > 1:                                # [Hk, q_len * group, D] -> [q_len, Hk, group, D]
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


def real_token_rows(slot_mapping: torch.Tensor) -> torch.Tensor | None:
    """Rows of the tokens that write K/V (slot >= 0; padding tokens have slot -1), or None when all do."""
    if not bool((slot_mapping < 0).any()):  # most batches have no padding
        return None
    return (slot_mapping >= 0).nonzero().squeeze(1)


def paged_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, max_query_len: int,
                        tree_mask: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`nanospec.kernels.paged_attention.paged_attention` through a one-layer plan."""
    plan = PagedAttentionPlan(block_tables, seq_lens, query_start_loc, k_cache.shape[1],
                              q.shape[1] // k_cache.shape[2], tree_mask)
    return plan.attend(q * scale, k_cache.flatten(0, 1), v_cache.flatten(0, 1))


class CpuAttention:
    """One forward's plan (built once, shared by every layer) and a layer's attention from its fused ``qkv``."""

    def __init__(self, batch, block_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 cos_sin_cache: torch.Tensor, head_scale: torch.Tensor):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.real_rows = real_token_rows(batch.slot_mapping)  # which rows are real tokens; None when all are
        self.slot_mapping = batch.slot_mapping if self.real_rows is None else batch.slot_mapping[self.real_rows]
        self.rope = RopeTables(batch.positions, cos_sin_cache, head_scale)  # q's rows carry the softmax scale
        self.attention = PagedAttentionPlan(batch.block_tables, batch.seq_lens, batch.query_start_loc, block_size,
                                            num_heads // num_kv_heads, batch.tree_mask, batch.logits_indices)

    def __call__(self, qkv: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor) -> torch.Tensor:
        """``qkv [T, (Hq + 2 Hk) * D]`` -> ``[T, Hq * D]``; writes the new K/V into the layer's cache, given with its
        block axes merged (``[num_blocks * block_size, Hk, D]``)."""
        T = qkv.shape[0]
        H, Hk, D = self.num_heads, self.num_kv_heads, self.head_dim
        v = qkv.narrow(1, (H + Hk) * D, Hk * D).view(T, Hk, D)
        qk = self.rope.rotate(qkv.narrow(1, 0, (H + Hk) * D).view(T, H + Hk, D))  # q heads come out scaled
        k = qk.narrow(1, H, Hk)
        if self.real_rows is not None:
            k, v = k[self.real_rows], v[self.real_rows]
        k_slots.index_copy_(0, self.slot_mapping, k if k.dtype == k_slots.dtype else k.to(k_slots.dtype))
        v_slots.index_copy_(0, self.slot_mapping, v if v.dtype == v_slots.dtype else v.to(v_slots.dtype))
        return self.attention.attend(qk.narrow(1, 0, H), k_slots, v_slots).reshape(T, H * D)
