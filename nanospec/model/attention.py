"""One layer's attention on paged KV, from its fused ``qkv`` projection: RoPE, KV write, attention.

    q, k, v = split(qkv);  q, k = RoPE(q, k, positions);  cache[slot_mapping] = k, v
    out[t] = softmax(scale * q[t] K^T + mask) V      over the context and the new tokens t may see

Two ways to run it, the same math:

* **Kernels** (CUDA, or the interpreter when the backend is ``triton``): ``rope_store_kv`` (RoPE and the
  KV write fused) and ``paged_attention``, two Triton launches per layer reading the batch metadata on
  the device.
* **Torch** (the CPU engine): the references of the same ops, with what depends only on the batch
  worked out once per forward (:meth:`Attention.plan`) instead of once per layer: the RoPE tables
  (:class:`~nanospec.kernels.rope.RopeTables`, with the softmax scale folded into the query heads)
  and each sequence's cache slots and mask (:class:`~nanospec.kernels.paged_attention.PagedAttentionPlan`).
  On a CPU decode step the matrix-vector products are the real work and per-op overhead is what is
  left to cut: planning once, with flat per-layer cache views and no needless casts, took the
  non-matmul part of a SmolLM2 decode forward from ~20 ms to ~10 ms on the 2-core CI machine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanospec.cache.kv_cache import KVCache
from nanospec.model.forward_batch import ForwardBatch
from nanospec.kernels.backend import use_triton
from nanospec.kernels.kv_store import real_token_rows
from nanospec.kernels.paged_attention import PagedAttentionPlan, paged_attention
from nanospec.kernels.rope import RopeTables
from nanospec.kernels.rope_store_kv import rope_store_kv


@dataclass
class TorchAttentionPlan:
    rope: RopeTables              # over q and k heads; q's rows carry the softmax scale
    attention: PagedAttentionPlan
    slot_mapping: torch.Tensor    # where each real (non-padding) token's K/V goes
    real_rows: torch.Tensor | None  # which rows are real tokens; None when all are


class Attention:
    """RoPE + KV write + paged attention, for every layer of one model."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, cos_sin_cache: torch.Tensor):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.cos_sin_cache = cos_sin_cache
        self.head_scale = torch.ones(num_heads + num_kv_heads, device=cos_sin_cache.device)
        self.head_scale[:num_heads] = self.scale

    def plan(self, batch: ForwardBatch, block_size: int) -> TorchAttentionPlan | None:
        """Once per forward: the torch path's plan, or None where the Triton kernels run."""
        if use_triton(batch.input_ids):
            return None
        real_rows = real_token_rows(batch.slot_mapping)
        slot_mapping = batch.slot_mapping if real_rows is None else batch.slot_mapping[real_rows]
        return TorchAttentionPlan(
            RopeTables(batch.positions, self.cos_sin_cache, self.head_scale),
            PagedAttentionPlan(batch.block_tables, batch.seq_lens, batch.query_start_loc, block_size,
                               self.num_heads // self.num_kv_heads, batch.tree_mask),
            slot_mapping, real_rows)

    def __call__(self, qkv: torch.Tensor, kv_cache: KVCache, layer: int, batch: ForwardBatch,
                 plan: TorchAttentionPlan | None) -> torch.Tensor:
        """``qkv [T, (Hq + 2 Hk) * D]`` -> attention output ``[T, Hq * D]``; writes the layer's new K/V."""
        T = qkv.shape[0]
        H, Hk, D = self.num_heads, self.num_kv_heads, self.head_dim
        v = qkv.narrow(1, (H + Hk) * D, Hk * D).view(T, Hk, D)
        if plan is None:
            k_cache, v_cache = kv_cache.layer(layer)
            q = qkv.narrow(1, 0, H * D).view(T, H, D)
            k = qkv.narrow(1, H * D, Hk * D).view(T, Hk, D)
            q = rope_store_kv(q, k, v, batch.positions, self.cos_sin_cache, k_cache, v_cache, batch.slot_mapping)
            return paged_attention(q, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                                   self.scale, batch.max_query_len, batch.tree_mask).view(T, H * D)
        k_slots, v_slots = kv_cache.layer_slots(layer)
        qk = plan.rope.rotate(qkv.narrow(1, 0, (H + Hk) * D).view(T, H + Hk, D))  # q heads come out scaled
        k = qk.narrow(1, H, Hk)
        if plan.real_rows is not None:
            k, v = k[plan.real_rows], v[plan.real_rows]
        k_slots.index_copy_(0, plan.slot_mapping, k if k.dtype == k_slots.dtype else k.to(k_slots.dtype))
        v_slots.index_copy_(0, plan.slot_mapping, v if v.dtype == v_slots.dtype else v.to(v_slots.dtype))
        return plan.attention.attend(qk.narrow(1, 0, H), k_slots, v_slots).reshape(T, H * D)
