"""An EAGLE-3 head (:class:`nanospec.model.eagle3.Eagle3Head`) trained with EAGLE-3's training-time test.

A recorded sequence ``x`` has rows ``r = 0 .. N - 2`` at positions ``r``: the auxiliary states ``A_r`` (the residual
stream entering the head's three target layers), the final hidden state ``H_r`` and the token ``tok[r] = x_{r+1}``
its logits gave. The head is unrolled ``K`` steps over every row at once, as the proposer runs it:

    step 0, row r (position r):        hidden fc(A_r),                   token x_{r+1}  -> predicts x_{r+2}
    step k, row r (position r + k):    hidden = its own step k-1 output, token x_{r+k+1} -> predicts x_{r+k+2}

Step ``k``'s row ``r`` is the ``k``-th draft step after a last accepted row ``r``: its attention sees the step-0 K/V
of rows ``0 .. r`` (the real rows) and the K/V of steps ``1 .. k`` at row ``r`` (its own earlier drafts), exactly the
K/V a chain's draft steps read at run time. Tokens are the recorded ones (a draft step's token is accepted only if
it equals them), so with teacher-forced tokens step ``k``'s top-1 accuracy is the chance depth ``k`` is accepted
given that the earlier depths were, and tau is ``1 +`` the mean count of leading hits.

The loss of step ``k`` (weight ``0.8^k``, EAGLE-3's) mixes the recorded token with the target's own distribution
there (``distill w``: ``(1 - w) * CE(token) + w * CE(softmax(lm_head @ H_{r+k+1}))``), both over the draft
vocabulary; a token outside it is left out of the token loss and counted as a miss.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from nanospec.kernels.rope import apply_rope_ref, build_rope_cache
from nanospec.model.config import LlamaConfig
from nanospec.model.eagle3 import ARCHITECTURES, Eagle3Config, Eagle3Head
from nanospec.train.data import IGNORE

STEP_WEIGHT = 0.8


@dataclass
class Batch:
    """Sequences padded to ``L`` rows: ``aux [B, L, 3H]``, ``tokens [B, L + K + 1]`` (``tok``, ``IGNORE`` past each
    sequence), ``rows [B, L + K + 1]`` (each token's row in the recording's ``hidden``, for distillation) and
    ``scored [B, L]`` (rows whose losses count)."""
    aux: torch.Tensor
    tokens: torch.Tensor
    rows: torch.Tensor
    scored: torch.Tensor


def new_head(target: LlamaConfig, draft_ids: torch.Tensor, aux_layers: tuple[int, ...], intermediate_size: int,
             embed_norm: torch.Tensor, target_head: torch.Tensor, seed: int) -> Eagle3Head:
    """A head of the target's layer shape (but ``intermediate_size``) over the draft vocabulary ``draft_ids``
    (target ids), its final norm and ``lm_head`` the target's own (rows ``draft_ids``), the rest random."""
    config = head_config(target, len(draft_ids), aux_layers, intermediate_size)
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.from_dict(config, "new head"), has_embedding=False)
    with torch.no_grad():
        for linear in (head.fc, head.qkv_proj, head.o_proj, head.gate_up_proj, head.down_proj):
            linear.weight.normal_(0, 1 / math.sqrt(linear.weight.shape[1]))
        head.o_proj.weight.mul_(0.1)
        head.down_proj.weight.mul_(0.1)
        head.norm.copy_(embed_norm)
        head.lm_head.weight.copy_(target_head[draft_ids])
        head.d2t.copy_(draft_ids - torch.arange(len(draft_ids)))
    return head


def head_config(target: LlamaConfig, draft_vocab_size: int, aux_layers: tuple[int, ...], intermediate_size: int
                ) -> dict:
    c = target
    return {"architectures": [ARCHITECTURES[0]], "model_type": "llama", "hidden_size": c.hidden_size,
            "intermediate_size": intermediate_size, "num_hidden_layers": 1,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
            "rope_scaling": c.rope_scaling, "max_position_embeddings": c.max_position_embeddings,
            "vocab_size": c.vocab_size, "draft_vocab_size": draft_vocab_size, "target_hidden_size": c.hidden_size,
            "eagle_aux_hidden_state_layer_ids": list(aux_layers), "tie_word_embeddings": False,
            "torch_dtype": "float16"}


def save_head(head: Eagle3Head, config: dict, out: Path, metadata: dict | None = None,
              scale: torch.Tensor | None = None) -> None:
    """The published format (``midlayer.`` names, ``d2t`` and ``t2d``), float16, and its ``config.json``;
    ``scale``: the :class:`Unroller`'s, folded into ``fc``."""
    out.mkdir(parents=True, exist_ok=True)
    q, kv = head.q_size, head.kv_size
    qkv, (gate, up) = head.qkv_proj.weight, head.gate_up_proj.weight.chunk(2)
    layer = {"input_layernorm.weight": head.input_layernorm, "hidden_norm.weight": head.hidden_norm,
             "post_attention_layernorm.weight": head.post_attention_layernorm,
             "self_attn.q_proj.weight": qkv[:q], "self_attn.k_proj.weight": qkv[q:q + kv],
             "self_attn.v_proj.weight": qkv[q + kv:], "self_attn.o_proj.weight": head.o_proj.weight,
             "mlp.gate_proj.weight": gate, "mlp.up_proj.weight": up, "mlp.down_proj.weight": head.down_proj.weight}
    tensors = {f"midlayer.{name}": value for name, value in layer.items()}
    fc = head.fc.weight if scale is None else head.fc.weight / scale
    tensors |= {"fc.weight": fc, "norm.weight": head.norm, "lm_head.weight": head.lm_head.weight}
    tensors = {name: value.detach().to(torch.float16).contiguous() for name, value in tensors.items()}
    draft_ids = torch.arange(head.config.draft_vocab_size) + head.d2t.cpu()
    tensors["d2t"] = head.d2t.detach().cpu().clone()
    tensors["t2d"] = torch.zeros(head.config.layer.vocab_size, dtype=torch.bool).index_fill_(0, draft_ids, True)
    save_file(tensors, str(out / "model.safetensors"), metadata=metadata)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def aux_scale(aux: torch.Tensor, rows: int = 65536) -> torch.Tensor:
    """``[3H]``: each auxiliary feature's root mean square over (up to ``rows`` evenly spaced) recorded rows, leaving
    out the 1% of rows with the largest norm (attention sinks, whose few massive features reach 10^4)."""
    x = aux[::max(1, len(aux) // rows)].float()
    norms = x.pow(2).mean(-1)
    keep = norms <= norms.quantile(0.99)
    return x[keep].pow(2).mean(0).sqrt().clamp(min=1e-3)


class Unroller:
    """The head unrolled ``steps`` times over a :class:`Batch` with dense attention (the K/V each step may read).

    ``scale``: the auxiliary states are divided by it before ``fc`` (a reparametrization: every input feature of
    ``fc`` trains at unit scale, the few massive ones too; :func:`save_head` folds it into ``fc``)."""

    def __init__(self, head: Eagle3Head, embedding: torch.Tensor, steps: int, max_rows: int,
                 scale: torch.Tensor | None = None):
        c = head.config.layer
        self.head, self.embedding, self.steps, self.scale = head, embedding, steps, scale
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.rope = build_rope_cache(c.head_dim, max_rows + steps + 1, c.rope_theta, c.rope_scaling)

    def __call__(self, batch: Batch) -> list[torch.Tensor]:
        """Step ``k``'s prenorm outputs ``[B, L, hidden]``, for ``k = 0 .. steps - 1``."""
        B, L = batch.scored.shape
        hidden = self.head.fuse(batch.aux if self.scale is None else batch.aux / self.scale)
        keys, values, outs = [], [], []
        for k in range(self.steps):
            embeds = F.embedding(batch.tokens[:, k:k + L].clamp(min=0), self.embedding)
            hidden = self.head(embeds, hidden, lambda qkv: self._attention(qkv, k, keys, values))
            outs.append(hidden)
        return outs

    def _attention(self, qkv: torch.Tensor, step: int, keys: list, values: list) -> torch.Tensor:
        """Row ``r`` of step ``k`` (position ``r + k``) attends to step 0's rows ``0 .. r`` and to row ``r`` of steps
        ``1 .. k``; ``[B, L, q + 2 kv] -> [B, L, q]``."""
        B, L, _ = qkv.shape
        nh, nk, d = self.heads, self.kv_heads, self.head_dim
        q, k, v = qkv.split([nh * d, nk * d, nk * d], dim=-1)
        positions = torch.arange(L) + step
        q, k = apply_rope_ref(q.reshape(B * L, nh, d), k.reshape(B * L, nk, d), positions.repeat(B), self.rope)
        q = q.view(B, L, nh, d).transpose(1, 2)                                      # [B, nh, L, d]
        k = k.view(B, L, nk, d).transpose(1, 2).repeat_interleave(nh // nk, dim=1)
        v = v.reshape(B, L, nk, d).transpose(1, 2).repeat_interleave(nh // nk, dim=1)
        keys.append(k)
        values.append(v)
        if step == 0:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            causal = torch.ones(L, L, dtype=torch.bool).tril()
            past = (q @ keys[0].transpose(-1, -2)).masked_fill(~causal, float("-inf"))  # [B, nh, L, L]
            own = torch.stack([(q * key).sum(-1) for key in keys[1:]], dim=-1)         # [B, nh, L, k]
            weights = torch.softmax(torch.cat([past, own], dim=-1) / math.sqrt(d), dim=-1)
            out = weights[..., :L] @ values[0] + (weights[..., L:, None] * torch.stack(values[1:], dim=-2)).sum(-2)
        return out.transpose(1, 2).reshape(B, L, nh * d)


def step_losses(head: Eagle3Head, outs: list[torch.Tensor], batch: Batch, draft_index: torch.Tensor,
                teacher: tuple[torch.Tensor, torch.Tensor, float] | None = None):
    """Per step: the mean loss over its scored rows with a target, the top-1 hits ``[B, L]`` (bool; a target outside
    the draft vocabulary or past the end is a miss) and the count of rows with a target.

    ``draft_index [vocab]``: a target id's draft id, or -1. ``teacher = (hidden [M, H], head [draft, H], w)``: the
    recording's final hidden states and the target's output rows of the draft vocabulary, weight ``w``."""
    L = batch.scored.shape[1]
    losses, hits, counts = [], [], []
    for k, out in enumerate(outs):
        logits = head.logits(out)                                               # [B, L, draft]
        target = batch.tokens[:, k + 1:k + 1 + L]
        valid = batch.scored & (target != IGNORE)
        index = torch.where(valid, draft_index[target.clamp(min=0)], -1)
        in_draft = index >= 0
        loss = F.cross_entropy(logits[in_draft], index[in_draft], reduction="sum") / max(int(in_draft.sum()), 1)
        if teacher is not None:
            hidden, teacher_head, w = teacher
            states = hidden[batch.rows[:, k + 1:k + 1 + L][valid]].float()
            p = torch.softmax(states @ teacher_head.T, dim=-1)
            soft = -(p * torch.log_softmax(logits[valid], dim=-1)).sum(-1)
            loss = (1 - w) * loss + w * soft.sum() / max(int(valid.sum()), 1)
        losses.append(loss)
        hits.append((logits.argmax(-1) == index) & in_draft)
        counts.append(int(valid.sum()))
    return losses, hits, counts


def total_loss(losses: list[torch.Tensor]) -> torch.Tensor:
    return sum(STEP_WEIGHT ** k * loss for k, loss in enumerate(losses))


def draft_vocabulary_index(draft_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[vocab]``: each target id's index in ``draft_ids``, -1 outside it."""
    index = torch.full((vocab_size,), -1, dtype=torch.int64)
    index[draft_ids] = torch.arange(len(draft_ids))
    return index
