"""Llama, from scratch, on paged KV: RMSNorm, RoPE (theta, llama3 scaling), GQA attention, SwiGLU.

One forward serves prefill, decode and speculative verify over a flat ragged
:class:`~nanospec.model.forward_batch.ForwardBatch`, writing the new tokens' K/V into the paged cache.

    h_0 = embed(x);  for each layer:  a = h + Attn(RMSNorm(h));  h = a + MLP(RMSNorm(a))
    logits = RMSNorm(h) @ W_head^T          (W_head = embed when embeddings are tied)
    MLP:   down(silu(gate(x)) * up(x))      (q/k/v and gate/up fused: one matmul each; residual add fused into RMSNorm)

Under tensor parallelism (``tp``) each rank builds only its shard (:mod:`nanospec.model.parallel`); ``num_heads`` /
``num_kv_heads`` are then this rank's counts and ``compute_logits`` all-gathers the full ``[R, V]`` logits.
"""

from __future__ import annotations

from collections import Counter

import torch

from nanospec.cache.kv_cache import KVCache
from nanospec.model.forward_batch import ForwardBatch
from nanospec.kernels.activation import silu_and_mul
from nanospec.kernels.rmsnorm import rms_norm
from nanospec.kernels.rope import build_rope_cache
from nanospec.model.attention import Attention
from nanospec.model.config import LlamaConfig
from nanospec.model.linear import logits, make_linear
from nanospec.model.parallel import (ParallelGroup, VocabParallelEmbedding, check_shardable, columns, head_range,
                                     kv_heads_per_rank, rows, vocab_range)
from nanospec.model.quantization import Weight, cat_rows, pad_rows, to_device


class LlamaLayer:
    """One layer's weights: all of them, or (``tp``) this rank's shard: rows of q/k/v and gate/up, columns of o and
    down (see :mod:`nanospec.model.parallel`). Each matrix is float or weight-only quantized, as loaded."""

    def __init__(self, config: LlamaConfig, tensors: dict[str, Weight], prefix: str, device: torch.device,
                 dtype: torch.dtype, tp: ParallelGroup | None = None):
        t = lambda name: tensors[prefix + name]  # noqa: E731
        place = lambda w: to_device(w, device, dtype)  # noqa: E731  (after slicing: only the shard moves)
        self.input_norm = place(t("input_layernorm.weight"))
        self.post_attention_norm = place(t("post_attention_layernorm.weight"))
        q, k, v = t("self_attn.q_proj.weight"), t("self_attn.k_proj.weight"), t("self_attn.v_proj.weight")
        o, gate, up, down = (t("self_attn.o_proj.weight"), t("mlp.gate_proj.weight"), t("mlp.up_proj.weight"),
                             t("mlp.down_proj.weight"))
        if tp is not None and tp.communicates:
            D, F = config.head_dim, config.intermediate_size
            q0, q1 = head_range(config.num_attention_heads, tp.rank, tp.size)
            k0, k1 = head_range(config.num_key_value_heads, tp.rank, tp.size)
            f0, f1 = tp.rank * F // tp.size, (tp.rank + 1) * F // tp.size
            q, k, v = rows(q, q0 * D, q1 * D), rows(k, k0 * D, k1 * D), rows(v, k0 * D, k1 * D)
            o = columns(o, q0 * D, q1 * D)
            gate, up, down = rows(gate, f0, f1), rows(up, f0, f1), columns(down, f0, f1)
        self.qkv_proj = make_linear(place(cat_rows([q, k, v])), keep_weight=False)
        self.o_proj = make_linear(place(o), keep_weight=False)
        self.gate_up_proj = make_linear(place(cat_rows([gate, up])), keep_weight=False)
        self.down_proj = make_linear(place(down), keep_weight=False)


class Llama:
    def __init__(self, config: LlamaConfig, tensors: dict[str, Weight], device: torch.device | str,
                 dtype: torch.dtype, max_len: int | None = None, tp: ParallelGroup | None = None):
        """``dtype``: the activations' (and float weights', norms', K/V's) dtype; quantized weights stay as they are.
        ``max_len``: the longest sequence it will run, which the RoPE table covers (default: the model's context).
        ``tp``: build this rank's shard and run its forward with the group's collectives (None: the whole model)."""
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.tp = tp if tp is not None and tp.communicates else None
        if self.tp is not None:
            check_shardable(config, self.tp.size)
        place = lambda w: to_device(w, device, dtype)  # noqa: E731
        embed = tensors["model.embed_tokens.weight"]
        head = embed if config.tie_word_embeddings else tensors["lm_head.weight"]
        if self.tp is not None:  # this rank's vocabulary rows, sliced before they move
            v0, v1 = vocab_range(config.vocab_size, self.tp.rank, self.tp.size)
            embed = rows(embed, v0, v1)
            # the head's rows padded with zeros to V' = ceil(V / T), so the all-gather is even
            head = pad_rows(rows(head, v0, v1), -(-config.vocab_size // self.tp.size))
        tied = head is embed
        embed = place(embed)
        self.embed = VocabParallelEmbedding(embed, config.vocab_size, self.tp, dtype)
        self.lm_head = make_linear(embed if tied else place(head))
        self.norm = place(tensors["model.norm.weight"])
        self.layers = [LlamaLayer(config, tensors, f"model.layers.{i}.", self.device, dtype, self.tp)
                       for i in range(config.num_hidden_layers)]
        size = self.tp.size if self.tp is not None else 1
        self.num_heads = config.num_attention_heads // size
        self.num_kv_heads = kv_heads_per_rank(config.num_key_value_heads, size)
        self.head_dim = config.head_dim
        positions = min(config.max_position_embeddings, max_len or config.max_position_embeddings)
        self.cos_sin_cache = build_rope_cache(self.head_dim, positions, config.rope_theta, config.rope_scaling,
                                              device=self.device)
        self.attention = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.cos_sin_cache)
        # the dtype the layers' matmuls read (bfloat16 for the CPU's weight-only kernels): the norms write it, so the
        # residual stream, attention and K/V stay in ``dtype`` while no matmul input needs a cast of its own
        self.matmul_dtype = (self.layers[0].gate_up_proj.input_dtype if self.layers else None) or dtype

    @property
    def quantization(self) -> str:
        """The kinds of the model's matrices, most common first: "int4-g32 (120), int8 (1)", or "float32 (121)"."""
        kinds = Counter(m.kind for layer in self.layers
                        for m in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj))
        kinds[self.lm_head.kind] += 1
        return ", ".join(f"{kind} ({count})" for kind, count in kinds.most_common())

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: KVCache, aux_layers: tuple[int, ...] = ()
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Hidden states (after the final norm) of the rows ``batch.logits_indices``: ``[R, hidden]``. With
        ``aux_layers``, also the residual stream entering each of those layers (layer 0: the embeddings) at every
        row, concatenated in layer order: ``[T, len(aux_layers) * hidden]`` (an EAGLE-3 head's input)."""
        plan = self.attention.plan(batch, kv_cache.block_size)  # what every layer's attention shares
        hidden = self.embed(batch.input_ids)
        residual = None
        eps, matmul_dtype = self.config.rms_norm_eps, self.matmul_dtype
        aux = []
        for i, layer in enumerate(self.layers):
            if i in aux_layers:
                aux.append(hidden if residual is None else hidden + residual)
            if residual is None:
                residual = hidden
                x = rms_norm(hidden, layer.input_norm, eps, out_dtype=matmul_dtype)
            else:
                x, residual = rms_norm(hidden, layer.input_norm, eps, residual=residual, out_dtype=matmul_dtype)
            hidden = layer.o_proj(self.attention(layer.qkv_proj(x).to(self.dtype), kv_cache, i, batch, plan))
            if self.tp is not None:  # row-parallel o: sum the ranks' shares (in the residual stream's dtype)
                hidden = self.tp.all_reduce(hidden.to(self.dtype))
            x, residual = rms_norm(hidden, layer.post_attention_norm, eps, residual=residual, out_dtype=matmul_dtype)
            hidden = layer.down_proj(silu_and_mul(layer.gate_up_proj(x)))
            if self.tp is not None:  # row-parallel down: sum the ranks' shares
                hidden = self.tp.all_reduce(hidden.to(self.dtype))
        if residual is None:  # a model with no layers
            residual, hidden = hidden, torch.zeros_like(hidden)
        rows = batch.logits_indices
        out = rms_norm(hidden[rows], self.norm, self.config.rms_norm_eps, residual=residual[rows])[0]
        return (out, torch.cat(aux, dim=-1)) if aux_layers else out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[R, vocab]`` float32 logits (under tensor parallelism: every rank's slice, gathered on every rank)."""
        if self.tp is None:
            return logits(self.lm_head, hidden)
        return self.tp.all_gather_last(logits(self.lm_head, hidden))[:, : self.config.vocab_size]
