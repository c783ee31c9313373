"""The hyper-parameters of a Llama model, read from and written to Hugging Face's config.json."""

from __future__ import annotations

from dataclasses import dataclass, field

LLAMA_ARCHITECTURE = "LlamaForCausalLM"


@dataclass
class LlamaConfig:
    """What nanospec needs to build a Llama model. Defaults are those of transformers' LlamaConfig."""

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None  # None: one KV head per query head (no grouped-query attention)
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # e.g. {"rope_type": "llama3", "factor": 8.0, ...}; None for plain RoPE
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_id: list[int] = field(default_factory=lambda: [2])
    architectures: list[str] = field(default_factory=lambda: [LLAMA_ARCHITECTURE])

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        self.eos_token_id = _as_id_list(self.eos_token_id)
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @classmethod
    def from_hf_dict(cls, d: dict) -> LlamaConfig:
        """Read a transformers config.json (4.x or 5.x layout). Raises ValueError for a model that is not a Llama."""
        model_type = d.get("model_type", "llama")
        if model_type != "llama":
            raise ValueError(f"unsupported model_type {model_type!r}: nanospec runs Llama models only "
                             "(model_type 'llama')")
        architectures = list(d.get("architectures") or [LLAMA_ARCHITECTURE])
        if architectures != [LLAMA_ARCHITECTURE]:
            raise ValueError(f"unsupported architectures {architectures!r}: nanospec runs {LLAMA_ARCHITECTURE} only")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {d['hidden_act']!r}: nanospec's Llama MLP uses 'silu'")
        for flag in ("attention_bias", "mlp_bias"):
            if d.get(flag, False):
                raise ValueError(f"unsupported {flag}=True: nanospec's Llama layers have no biases")

        # transformers 5 keeps rope_theta and the scaling together in `rope_parameters`; 4.x keeps them apart.
        rope_parameters = dict(d.get("rope_parameters") or {})
        rope_theta = d.get("rope_theta", rope_parameters.pop("rope_theta", 10000.0))
        rope_scaling = _normalize_rope_scaling(d.get("rope_scaling") or rope_parameters or None)

        heads = d.get("num_attention_heads", 32)
        return cls(
            vocab_size=d.get("vocab_size", 32000),
            hidden_size=d.get("hidden_size", 4096),
            intermediate_size=d.get("intermediate_size", 11008),
            num_hidden_layers=d.get("num_hidden_layers", 32),
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim"),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            bos_token_id=d.get("bos_token_id", 1),
            eos_token_id=_as_id_list(d.get("eos_token_id", 2)),
            architectures=architectures,
        )

    def to_hf_dict(self) -> dict:
        """A config.json that transformers' LlamaConfig / AutoConfig reads back to the same model."""
        eos = self.eos_token_id[0] if len(self.eos_token_id) == 1 else list(self.eos_token_id)
        return {
            "architectures": [LLAMA_ARCHITECTURE],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
        }

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight the model needs, by its Hugging Face name, with its shape (Linear weights are (out, in)).
        No "lm_head.weight" when the head is tied to the embeddings."""
        hidden, q_size = self.hidden_size, self.num_attention_heads * self.head_dim
        kv_size = self.num_key_value_heads * self.head_dim
        shapes = {"model.embed_tokens.weight": (self.vocab_size, hidden)}
        for i in range(self.num_hidden_layers):
            layer = f"model.layers.{i}"
            shapes |= {
                f"{layer}.input_layernorm.weight": (hidden,),
                f"{layer}.self_attn.q_proj.weight": (q_size, hidden),
                f"{layer}.self_attn.k_proj.weight": (kv_size, hidden),
                f"{layer}.self_attn.v_proj.weight": (kv_size, hidden),
                f"{layer}.self_attn.o_proj.weight": (hidden, q_size),
                f"{layer}.post_attention_layernorm.weight": (hidden,),
                f"{layer}.mlp.gate_proj.weight": (self.intermediate_size, hidden),
                f"{layer}.mlp.up_proj.weight": (self.intermediate_size, hidden),
                f"{layer}.mlp.down_proj.weight": (hidden, self.intermediate_size),
            }
        shapes["model.norm.weight"] = (hidden,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, hidden)
        return shapes


def _as_id_list(ids) -> list[int]:
    if ids is None:
        return []
    if isinstance(ids, int):
        return [ids]
    return [int(i) for i in ids]


def _normalize_rope_scaling(scaling: dict | None) -> dict | None:
    """Spell the scaling kind as "rope_type" (older configs say "type"); plain RoPE is None. rope_theta, which
    transformers 5 keeps among these, is a field of its own."""
    if not scaling:
        return None
    scaling = dict(scaling)
    scaling.pop("rope_theta", None)
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type == "default":
        return None
    return {"rope_type": rope_type, **scaling}
