"""Llama, from scratch, on paged KV: RMSNorm, RoPE (theta, llama3 scaling), GQA attention, SwiGLU.

One forward serves prefill, decode and speculative verify: it takes a flat ragged
:class:`~nanospec.model.forward_batch.ForwardBatch`, writes the new tokens' K/V into the paged cache and
attends over each sequence's cached context plus the new tokens its mask allows.

    h_0 = embed(x)
    for each layer:  a = h + Attn(RMSNorm(h));  h = a + MLP(RMSNorm(a))
    logits = RMSNorm(h) @ W_head^T          (W_head = embed when embeddings are tied)
    Attn:  q, k, v = x Wq, x Wk, x Wv;  q, k = RoPE(q, k, position);  o = softmax(q k^T / sqrt(d)) v
    MLP:   down(silu(gate(x)) * up(x))

q/k/v and gate/up are fused into single matrices (one matmul each); the residual add is fused
into RMSNorm. Matmuls stay in torch (cuBLAS, or oneDNN on CPU: ``nanospec.model.linear``);
everything else is a kernel from
``nanospec.kernels`` (Triton on CUDA, the torch reference on CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanospec.cache.kv_cache import KVCache
from nanospec.model.forward_batch import ForwardBatch
from nanospec.kernels.activation import silu_and_mul
from nanospec.kernels.rmsnorm import rms_norm
from nanospec.kernels.rope import build_rope_cache
from nanospec.model.attention import Attention
from nanospec.model.config import LlamaConfig
from nanospec.model.linear import Linear


class LlamaLayer:
    def __init__(self, config: LlamaConfig, tensors: dict[str, torch.Tensor], prefix: str):
        t = lambda name: tensors[prefix + name]  # noqa: E731
        self.input_norm = t("input_layernorm.weight")
        self.post_attention_norm = t("post_attention_layernorm.weight")
        self.qkv_proj = Linear(torch.cat([t("self_attn.q_proj.weight"), t("self_attn.k_proj.weight"),
                                          t("self_attn.v_proj.weight")]).contiguous())
        self.o_proj = Linear(t("self_attn.o_proj.weight"))
        self.gate_up_proj = Linear(torch.cat([t("mlp.gate_proj.weight"), t("mlp.up_proj.weight")]).contiguous())
        self.down_proj = Linear(t("mlp.down_proj.weight"))


class Llama:
    def __init__(self, config: LlamaConfig, tensors: dict[str, torch.Tensor], device: torch.device | str,
                 dtype: torch.dtype, max_len: int | None = None):
        """``max_len``: the longest sequence it will run (default: the model's context); the RoPE table covers
        that many positions (a 10M-token context would otherwise cost gigabytes of table)."""
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        tensors = {name: w.to(device=device, dtype=dtype) for name, w in tensors.items()}
        self.embed_tokens = tensors["model.embed_tokens.weight"]
        self.lm_head = Linear(self.embed_tokens if config.tie_word_embeddings else tensors["lm_head.weight"])
        self.norm = tensors["model.norm.weight"]
        self.layers = [LlamaLayer(config, tensors, f"model.layers.{i}.") for i in range(config.num_hidden_layers)]
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        positions = min(config.max_position_embeddings, max_len or config.max_position_embeddings)
        self.cos_sin_cache = build_rope_cache(self.head_dim, positions, config.rope_theta, config.rope_scaling,
                                              device=self.device)
        self.attention = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.cos_sin_cache)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        """Hidden states (after the final norm) of the rows ``batch.logits_indices``: ``[R, hidden]``."""
        plan = self.attention.plan(batch, kv_cache.block_size)  # what every layer's attention shares
        hidden = F.embedding(batch.input_ids, self.embed_tokens)
        residual = None
        for i, layer in enumerate(self.layers):
            if residual is None:
                residual = hidden
                x = rms_norm(hidden, layer.input_norm, self.config.rms_norm_eps)
            else:
                x, residual = rms_norm(hidden, layer.input_norm, self.config.rms_norm_eps, residual=residual)
            hidden = layer.o_proj(self.attention(layer.qkv_proj(x), kv_cache, i, batch, plan))
            x, residual = rms_norm(hidden, layer.post_attention_norm, self.config.rms_norm_eps, residual=residual)
            hidden = layer.down_proj(silu_and_mul(layer.gate_up_proj(x)))
        if residual is None:  # a model with no layers
            residual, hidden = hidden, torch.zeros_like(hidden)
        rows = batch.logits_indices
        return rms_norm(hidden[rows], self.norm, self.config.rms_norm_eps, residual=residual[rows])[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[R, vocab]`` float32 logits."""
        return self.lm_head(hidden).float()
