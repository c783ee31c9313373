"""One layer's attention on paged KV, from its fused ``qkv`` projection:

    q, k, v = split(qkv);  q, k = RoPE(q, k, positions);  cache[slot_mapping] = k, v
    out[t] = softmax(scale * q[t] K^T + mask) V      over the context and the new tokens t may see

Triton: ``rope_store_kv`` and ``paged_attention``. CPU (:mod:`nanospec.kernels.cpu_attention`): torch ops, planned
once per forward (:meth:`Attention.plan`).
"""

from __future__ import annotations

import torch

from nanospec.cache.kv_cache import KVCache
from nanospec.kernels.backend import use_triton
from nanospec.kernels.cpu_attention import CpuAttention
from nanospec.kernels.paged_attention import paged_attention
from nanospec.kernels.rope_store_kv import rope_store_kv
from nanospec.model.forward_batch import ForwardBatch


class Attention:
    """RoPE + KV write + paged attention, for every layer of one model."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, cos_sin_cache: torch.Tensor):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.cos_sin_cache = cos_sin_cache
        self.head_scale = torch.ones(num_heads + num_kv_heads, device=cos_sin_cache.device)
        self.head_scale[:num_heads] = self.scale

    def plan(self, batch: ForwardBatch, block_size: int) -> CpuAttention | None:
        """Once per forward: the CPU backend's plan, or None where the Triton kernels run."""
        if use_triton(batch.input_ids):
            return None
        return CpuAttention(batch, block_size, self.num_heads, self.num_kv_heads, self.head_dim, self.cos_sin_cache,
                            self.head_scale)

    def __call__(self, qkv: torch.Tensor, kv_cache: KVCache, layer: int, batch: ForwardBatch,
                 plan: CpuAttention | None) -> torch.Tensor:
        """``qkv [T, (Hq + 2 Hk) * D]`` -> attention output ``[T, Hq * D]``; writes the layer's new K/V."""
        if plan is not None:
            return plan(qkv, *kv_cache.layer_slots(layer))
        T = qkv.shape[0]
        H, Hk, D = self.num_heads, self.num_kv_heads, self.head_dim
        k_cache, v_cache = kv_cache.layer(layer)
        q = qkv.narrow(1, 0, H * D).view(T, H, D)
        k = qkv.narrow(1, H * D, Hk * D).view(T, Hk, D)
        v = qkv.narrow(1, (H + Hk) * D, Hk * D).view(T, Hk, D)
        q = rope_store_kv(q, k, v, batch.positions, self.cos_sin_cache, k_cache, v_cache, batch.slot_mapping)
        return paged_attention(q, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                               self.scale, batch.max_query_len, batch.tree_mask).view(T, H * D)
