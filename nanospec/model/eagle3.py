"""An EAGLE-3 draft head (Li et al. 2025), in the format vLLM and SGLang load: one Llama decoder layer that drafts from
three of the target's hidden states fused, beside the embedding of the token that follows them.

    g      = fc(concat(a_low, a_mid, a_high))        the target's residual stream entering three of its layers
                                                     (layer 0: the embeddings), at one position, [3 * target_hidden]
    x      = concat(input_layernorm(embed(t)), hidden_norm(g))        [2 * hidden]: q, k and v read both
    h      = g + o(Attn(q, k, v))                    (norm_before_residual: hidden_norm(g) + ..., as vLLM reads it)
    out    = h + mlp(post_attention_layernorm(h))    the prenorm state: fed back as g for the next draft step
    logits = lm_head(norm(out))                      over the draft vocabulary; target id = d + d2t[d]

Row ``j`` pairs the target's states at position ``j`` with the token at ``j + 1`` and predicts the token at
``j + 2``, at RoPE position ``j``. The auxiliary layers are ``eagle_aux_hidden_state_layer_ids`` (top level or in
``eagle_config``), else vLLM's default ``(2, L // 2, L - 3)``; id ``i`` is the stream *entering* layer ``i``.
On disk: ``config.json`` (a one-layer Llama with ``draft_vocab_size``, optionally ``target_hidden_size``) and
safetensors weights named ``midlayer.*`` (EAGLE, SGLang) or ``layers.0.*`` (vLLM), optionally under ``model.``, with
``fc``, ``norm``, ``lm_head``, ``d2t`` (target id - draft id; absent: the draft vocabulary is the whole one) and an
optional ``embed_tokens`` (absent: the target's is shared).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from nanospec.model.config import LLAMA_ARCHITECTURE, REQUIRED_HF_FIELDS, LlamaConfig, check_tensors, checked_field
from nanospec.model.linear import pack_linears
from nanospec.model.loader import open_safetensors, read_json

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
LAYER_NAMES = ("input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
               "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
               "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's and EAGLE's: a low, a middle and a high layer."""
    return 2, num_layers // 2, num_layers - 3


@dataclass
class Eagle3Config:
    layer: LlamaConfig            # the decoder layer's shape (hidden_size, heads, head_dim, rope, vocab_size)
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...] | None  # None: the default for the target
    norm_before_residual: bool = False

    @classmethod
    def from_dict(cls, d: dict, where: str) -> Eagle3Config:
        archs = d.get("architectures")
        if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in ARCHITECTURES:
            raise ValueError(f"{where}: architectures must be one of {[[a] for a in ARCHITECTURES]} for an "
                             f"EAGLE-3 head, got {archs!r}")
        try:
            layer = LlamaConfig.from_hf_dict({**d, "architectures": [LLAMA_ARCHITECTURE]}, require=REQUIRED_HF_FIELDS)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
        if layer.num_hidden_layers != 1:
            raise ValueError(f"{where}: num_hidden_layers must be 1 for an EAGLE-3 head, got "
                             f"{layer.num_hidden_layers}")
        eagle = d.get("eagle_config") or {}
        if not isinstance(eagle, dict):
            raise ValueError(f"{where}: eagle_config must be an object, got {eagle!r}")
        if eagle.get("use_aux_hidden_state", True) is not True:
            raise ValueError(f"{where}: eagle_config.use_aux_hidden_state must be true (an EAGLE-3 head fuses "
                             f"three target layers), got {eagle['use_aux_hidden_state']!r}")
        ids = d.get("eagle_aux_hidden_state_layer_ids", eagle.get("eagle_aux_hidden_state_layer_ids"))
        if ids is not None and (not isinstance(ids, list) or len(ids) != 3
                                or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
            raise ValueError(f"{where}: eagle_aux_hidden_state_layer_ids must be a list of 3 layer ids, got {ids!r}")
        defaults = {"draft_vocab_size": layer.vocab_size, "target_hidden_size": layer.hidden_size}
        values = {name: checked_field(where, name, default if d.get(name) is None else d[name], minimum=1)
                  for name, default in defaults.items()}
        if values["draft_vocab_size"] > layer.vocab_size:
            raise ValueError(f"{where}: draft_vocab_size ({values['draft_vocab_size']}) exceeds vocab_size "
                             f"({layer.vocab_size})")
        norm_before_residual = checked_field(where, "norm_before_residual", d.get("norm_before_residual", False))
        return cls(layer, values["draft_vocab_size"], values["target_hidden_size"],
                   tuple(ids) if ids is not None else None, norm_before_residual)

    def aux_layers(self, target: LlamaConfig, where: str) -> tuple[int, ...]:
        """The target layers whose entering states the head fuses, in layer order (ValueError naming the field)."""
        num_layers = target.num_hidden_layers
        ids = self.aux_layer_ids if self.aux_layer_ids is not None else default_aux_layers(num_layers)
        source = "eagle_aux_hidden_state_layer_ids" if self.aux_layer_ids is not None else \
            f"the default eagle_aux_hidden_state_layer_ids (2, L // 2, L - 3) for L = {num_layers}"
        if any(not 0 <= i < num_layers for i in ids) or len(set(ids)) != len(ids):
            raise ValueError(f"{where}: {source} = {list(ids)}: each must be a distinct layer id in [0, {num_layers}) "
                             f"(the target has {num_layers} layers)")
        return tuple(sorted(ids))

    def shapes(self, has_embedding: bool) -> dict[str, tuple[int, ...]]:
        """Every tensor by its canonical (``midlayer.``) name and shape; ``d2t`` where the vocabulary is reduced."""
        c, H = self.layer, self.layer.hidden_size
        q, kv, F_ = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.intermediate_size
        shapes = {"fc.weight": (H, 3 * self.target_hidden_size), "norm.weight": (H,),
                  "lm_head.weight": (self.draft_vocab_size, H)}
        layer = [(H,), (H,), (H,), (q, 2 * H), (kv, 2 * H), (kv, 2 * H), (H, q), (F_, H), (F_, H), (H, F_)]
        shapes |= {f"midlayer.{name}": shape for name, shape in zip(LAYER_NAMES, layer)}
        if has_embedding:
            shapes["embed_tokens.weight"] = (c.vocab_size, H)
        if self.draft_vocab_size != c.vocab_size:
            shapes["d2t"] = (self.draft_vocab_size,)
        return shapes


def canonical_name(name: str) -> str:
    """A tensor's name in either style (optionally under ``model.``) as this module names it (``midlayer.``)."""
    name = name.removeprefix("model.")
    return "midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


class Eagle3Head(nn.Module):
    """The head's weights and math; the attention is the caller's (paged K/V for inference, dense to train)."""

    def __init__(self, config: Eagle3Config, has_embedding: bool):
        super().__init__()
        self.config = config
        c, H = config.layer, config.layer.hidden_size
        self.eps = c.rms_norm_eps
        self.q_size, self.kv_size = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        self.fc = nn.Linear(3 * config.target_hidden_size, H, bias=False)
        self.input_layernorm, self.hidden_norm, self.post_attention_layernorm, self.norm = (
            nn.Parameter(torch.ones(H)) for _ in range(4))
        self.qkv_proj = nn.Linear(2 * H, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, H, bias=False)
        self.gate_up_proj = nn.Linear(H, 2 * c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, H, bias=False)
        self.lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(c.vocab_size, H) if has_embedding else None
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """``[N, 3 * target_hidden]`` target states -> ``[N, hidden]``."""
        return self.fc(aux)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor,
                attention: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The decoder layer: ``embeds`` (the next tokens' embeddings) and ``hidden`` (fused target states, or the
        head's own previous output), ``[N, hidden]`` each; ``attention(qkv [N, q + 2 kv]) -> [N, q]`` applies RoPE
        and attends. Returns the prenorm output ``[N, hidden]``."""
        normed = _rms_norm(hidden, self.hidden_norm, self.eps)
        residual = normed if self.config.norm_before_residual else hidden
        x = torch.cat([_rms_norm(embeds, self.input_layernorm, self.eps), normed], dim=-1)
        h = residual + self.o_proj(attention(self.qkv_proj(x)))
        gate, up = self.gate_up_proj(_rms_norm(h, self.post_attention_layernorm, self.eps)).chunk(2, dim=-1)
        return h + self.down_proj(F.silu(gate) * up)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """``[N, draft_vocab]`` float32 logits of the prenorm outputs."""
        return self.lm_head(_rms_norm(out, self.norm, self.eps)).float()

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids: ``d + d2t[d]``."""
        return draft_ids + self.d2t[draft_ids]


def load_eagle3_head(path: str | Path, target: LlamaConfig, device: torch.device | str, dtype: torch.dtype,
                     int8: bool = False) -> tuple[Eagle3Head, tuple[int, ...]]:
    """The head at ``path`` for ``target``, for inference (:func:`~nanospec.model.linear.pack_linears`, ``int8``
    or not), and the target layers it reads. Its config and every tensor's name and shape are checked against the
    target before any weight is read (ValueError naming the field or tensor)."""
    path = Path(path)
    where = path / "config.json"
    if not where.exists():
        raise FileNotFoundError(f"{path} has no config.json (an EAGLE-3 head directory holds config.json and its "
                                "safetensors)")
    config = Eagle3Config.from_dict(read_json(where), str(where))
    if config.target_hidden_size != target.hidden_size:
        field = "target_hidden_size" if config.target_hidden_size != config.layer.hidden_size else "hidden_size"
        raise ValueError(f"{where}: {field} = {config.target_hidden_size} but the target's hidden_size is "
                         f"{target.hidden_size}")
    if config.layer.vocab_size != target.vocab_size:
        raise ValueError(f"{where}: vocab_size = {config.layer.vocab_size} but the target's vocab_size is "
                         f"{target.vocab_size}")
    aux_layers = config.aux_layers(target, str(where))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path} (an EAGLE-3 head's weights; pickled .bin files are "
                                f"never loaded)")
    handles = {}
    for file in files:
        with open_safetensors(file) as f:
            for name in f.keys():
                handles[canonical_name(name)] = (file, name, tuple(f.get_slice(name).get_shape()))
    has_embedding = "embed_tokens.weight" in handles
    if not has_embedding and config.layer.hidden_size != target.hidden_size:
        raise ValueError(f"{path}: hidden_size = {config.layer.hidden_size} differs from the target's "
                         f"({target.hidden_size}) and the head has no embed_tokens.weight of its own")
    expected = config.shapes(has_embedding)
    check_tensors(path, expected, {name: shape for name, (_, _, shape) in handles.items()},
                  f"config.json (hidden_size {config.layer.hidden_size}, head_dim {config.layer.head_dim}, "
                  f"draft_vocab_size {config.draft_vocab_size}, vocab_size {config.layer.vocab_size})", strict=False)
    tensors = {}
    for name in expected:
        file, stored, _ = handles[name]
        with open_safetensors(file) as f:
            tensors[name] = f.get_tensor(stored)
    if "d2t" in tensors:
        ids = torch.arange(config.draft_vocab_size) + tensors["d2t"].long()
        if ids.min() < 0 or ids.max() >= target.vocab_size:
            raise ValueError(f"{path}: d2t maps a draft id outside the target's vocabulary [0, {target.vocab_size})")
    head = Eagle3Head(config, has_embedding)
    layer = lambda name: tensors[f"midlayer.{name}.weight"]  # noqa: E731
    state = {"fc.weight": tensors["fc.weight"], "norm": tensors["norm.weight"],
             "lm_head.weight": tensors["lm_head.weight"],
             **{norm: layer(norm) for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm")},
             "qkv_proj.weight": torch.cat([layer(f"self_attn.{p}_proj") for p in "qkv"]),
             "o_proj.weight": layer("self_attn.o_proj"), "down_proj.weight": layer("mlp.down_proj"),
             "gate_up_proj.weight": torch.cat([layer("mlp.gate_proj"), layer("mlp.up_proj")]),
             "d2t": tensors["d2t"].long() if "d2t" in tensors else head.d2t}
    if has_embedding:
        state["embed_tokens.weight"] = tensors["embed_tokens.weight"]
    head.load_state_dict({k: v.to(torch.float32) if v.is_floating_point() else v for k, v in state.items()})
    head.to(device=device, dtype=dtype)
    head.d2t = head.d2t.to(device=device, dtype=torch.int64)
    return pack_linears(head.eval().requires_grad_(False), int8), aux_layers
