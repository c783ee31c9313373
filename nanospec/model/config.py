"""The hyper-parameters of a Llama model, from and to Hugging Face's config.json, checked when made (see LIMITS); and
the check of a checkpoint's tensor names and shapes against those its config implies (:func:`check_tensors`)."""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, field, fields

from nanospec.kernels.rope import ROPE_SCALING_KEYS

LLAMA_ARCHITECTURE = "LlamaForCausalLM"

# The sane range of each integer field, (smallest, largest): far beyond any real Llama, far below absurd.
LIMITS = {
    "vocab_size": (1, 1 << 22),
    "hidden_size": (1, 1 << 16),
    "intermediate_size": (1, 1 << 18),
    "num_hidden_layers": (1, 1024),
    "num_attention_heads": (1, 1024),
    "num_key_value_heads": (1, 1024),
    "head_dim": (2, 1024),  # and even: rotary embeddings rotate pairs
    "max_position_embeddings": (1, 1 << 24),
}
# The range of each float field, (exclusive lower bound, inclusive upper bound).
FLOAT_LIMITS = {"rms_norm_eps": (0.0, 1.0), "rope_theta": (1.0, 1e12)}
# The numbers rope_scaling may hold, each finite and positive: those of every kind ROPE_SCALING_KEYS lists.
_ROPE_SCALING_NUMBERS = tuple(dict.fromkeys(key for keys in ROPE_SCALING_KEYS.values() for key in keys))

# What a checkpoint's config.json must state: a defaulted shape would only fail later as a shape mismatch.
REQUIRED_HF_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


class ConfigError(ValueError):
    """A field with a bad type or value: `field`, `value`, `requirement`; `describe` words it for another name (a GGUF
    key)."""

    def __init__(self, field: str, value, requirement: str):
        self.field, self.value, self.requirement = field, value, requirement
        super().__init__(self.describe(field))

    def describe(self, name: str) -> str:
        return f"{name} must be {self.requirement}, got {short_repr(self.value)}"


@dataclass
class LlamaConfig:
    """What nanospec needs to build a Llama (transformers' defaults). Every field is checked when made (ConfigError
    naming the field): types, LIMITS, head divisibility, an even head_dim, token ids in the vocabulary, rope_scaling."""

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

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "max_position_embeddings"):
            setattr(self, name, _checked_int(name, getattr(self, name)))
        for name in FLOAT_LIMITS:
            setattr(self, name, _checked_float(name, getattr(self, name)))
        if not isinstance(self.tie_word_embeddings, bool):
            raise ConfigError("tie_word_embeddings", self.tie_word_embeddings, "true or false")

        heads = self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = heads
        self.num_key_value_heads = _checked_int("num_key_value_heads", self.num_key_value_heads)
        if heads % self.num_key_value_heads != 0:
            raise ConfigError("num_key_value_heads", self.num_key_value_heads,
                              f"a divisor of num_attention_heads ({heads})")
        if self.head_dim is None:
            if self.hidden_size % heads != 0:
                raise ConfigError("hidden_size", self.hidden_size,
                                  f"a multiple of num_attention_heads ({heads}) when head_dim is not given")
            self.head_dim = self.hidden_size // heads
        self.head_dim = _checked_int("head_dim", self.head_dim)
        if self.head_dim % 2 != 0:
            raise ConfigError("head_dim", self.head_dim, "even (rotary embeddings rotate pairs of dimensions)")

        if self.bos_token_id is not None:
            self.bos_token_id = _checked_id("bos_token_id", self.bos_token_id, self.vocab_size)
        self.eos_token_id = token_ids("eos_token_id", self.eos_token_id, self.vocab_size)
        self.rope_scaling = _checked_rope_scaling(self.rope_scaling)

    @classmethod
    def from_hf_dict(cls, d: dict, require: tuple[str, ...] = ()) -> LlamaConfig:
        """Read a transformers config.json (4.x or 5.x); the keys in `require` must be present. ValueError for a missing
        key or not a Llama."""
        if not isinstance(d, dict):
            raise ValueError(f"a config must be a JSON object, got {short_repr(d)}")
        missing = [key for key in require if key not in d]
        if missing:
            raise ValueError(f"the required field {missing[0]!r} is missing")
        model_type = d.get("model_type", "llama")
        if model_type != "llama":
            raise ValueError(f"unsupported model_type {short_repr(model_type)}: nanospec runs Llama models only "
                             "(model_type 'llama')")
        architectures = d.get("architectures") or [LLAMA_ARCHITECTURE]
        if architectures != [LLAMA_ARCHITECTURE]:
            raise ValueError(f"unsupported architectures {short_repr(architectures)}: nanospec runs "
                             f"{LLAMA_ARCHITECTURE} only")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {short_repr(d['hidden_act'])}: nanospec's Llama MLP uses 'silu'")
        for flag in ("attention_bias", "mlp_bias"):
            if d.get(flag, False):
                raise ValueError(f"unsupported {flag}={d[flag]!r}: nanospec's Llama layers have no biases")
        quantization_config = d.get("quantization_config")
        if quantization_config:  # GPTQ, AWQ, FP8, bitsandbytes, ...: weights stored in a form nanospec does not read
            method = quantization_config.get("quant_method") if isinstance(quantization_config, dict) else None
            raise ValueError(f"unsupported quantization_config (quant_method {short_repr(method)}): nanospec loads "
                             "float weights, and rounds them itself with quantization='int4' or 'int8'")

        # transformers 5 keeps rope_theta and the scaling together in `rope_parameters`; 4.x keeps them apart.
        rope_parameters = d.get("rope_parameters") or {}
        if not isinstance(rope_parameters, dict):
            raise ConfigError("rope_parameters", rope_parameters, "an object")
        rope_theta = d.get("rope_theta", rope_parameters.get("rope_theta", 10000.0))
        rope_scaling = _normalize_rope_scaling(d.get("rope_scaling") or rope_parameters or None)

        values = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        return cls(**values | {"rope_theta": rope_theta, "rope_scaling": rope_scaling})

    def to_hf_dict(self) -> dict:
        """A config.json that transformers' LlamaConfig / AutoConfig reads back to the same model."""
        hf, eos = asdict(self), self.eos_token_id
        return {"architectures": [LLAMA_ARCHITECTURE], "model_type": "llama", **hf, "hidden_act": "silu",
                "attention_bias": False, "mlp_bias": False, "rope_scaling": hf["rope_scaling"] or None,
                "eos_token_id": eos[0] if len(eos) == 1 else list(eos)}

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight by its Hugging Face name with its shape (Linear: (out, in)); no "lm_head.weight" when tied."""
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


def token_ids(name: str, value, vocab_size: int) -> list[int]:
    """`value` (an id, a list, or None) as a list, each id inside the vocabulary (ConfigError naming `name`)."""
    ids = [] if value is None else value if isinstance(value, (list, tuple)) else [value]
    return [_checked_id(name, i, vocab_size) for i in ids]


def check_tensors(where, expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]], source: str,
                  strict: bool = True) -> None:
    """Check a checkpoint's tensors from its header alone: `found` (name -> stored shape) must hold every tensor of
    `expected` (name -> the shape `source`, e.g. "config.json", implies) with that shape and, when `strict`, no other.
    ValueError naming `where` (the file or directory), the tensors and, for a shape, both shapes."""
    missing = [name for name in expected if name not in found]
    if missing:
        raise ValueError(f"{where}: missing tensors that {source} implies: {short_list(missing)}")
    unexpected = [name for name in found if name not in expected] if strict else []
    if unexpected:  # a bias, a layer beyond the config's, ...: running without it would run another model
        raise ValueError(f"{where}: unexpected tensors, which {source} has no place for: {short_list(unexpected)}")
    for name, shape in expected.items():
        if tuple(found[name]) != tuple(shape):
            raise ValueError(f"{where}: tensor {name} has shape {tuple(found[name])}, but {source} implies "
                             f"{tuple(shape)}")


def checked_field(where: str, name: str, value, minimum: int | None = None):
    """`value`, that of the field `name` of a config: an integer >= `minimum`, or true or false when `minimum` is None.
    ValueError naming `where`, the field and the value otherwise."""
    if not (isinstance(value, bool) if minimum is None else _is_int(value) and value >= minimum):
        kind = "true or false" if minimum is None else f"an integer >= {minimum}"
        raise ValueError(f"{where}: {name} must be {kind}, got {short_repr(value)}")
    return value


def short_list(items: list[str], limit: int = 8) -> str:
    """The first `limit` items, comma-separated, and how many there are in all when there are more."""
    return ", ".join(items[:limit]) + (f", ... ({len(items)} in all)" if len(items) > limit else "")


def short_repr(value, limit: int = 60) -> str:
    """repr(value), cut to about `limit` characters (a corrupt file can hold a huge value)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + " ..."


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _checked_id(name: str, value, vocab_size: int) -> int:
    if not _is_int(value) or not 0 <= value < vocab_size:
        raise ConfigError(name, value, f"a token id from 0 to {vocab_size - 1} (inside the vocabulary)")
    return int(value)


def _checked_int(name: str, value) -> int:
    low, high = LIMITS[name]
    if not _is_int(value) or not low <= value <= high:
        raise ConfigError(name, value, f"an integer from {low} to {high}")
    return int(value)


def _checked_float(name: str, value) -> float:
    low, high = FLOAT_LIMITS[name]
    if not _is_number(value) or not low < value <= high:  # NaN fails the comparison too
        raise ConfigError(name, value, f"a number above {low:g} and at most {high:g}")
    return float(value)


def _checked_rope_scaling(scaling) -> dict | None:
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise ConfigError("rope_scaling", scaling, "an object or null")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if not isinstance(rope_type, str):
        raise ConfigError("rope_scaling.rope_type", rope_type, "a string")
    if rope_type not in ROPE_SCALING_KEYS:
        raise ConfigError("rope_scaling.rope_type", rope_type,
                          f"a RoPE scaling nanospec supports ({', '.join(ROPE_SCALING_KEYS)})")
    required = ROPE_SCALING_KEYS[rope_type]
    for key in _ROPE_SCALING_NUMBERS:
        if key in scaling or key in required:
            value = scaling.get(key)
            if not _is_number(value) or not 0 < value < math.inf:
                raise ConfigError(f"rope_scaling.{key}", value, f"a finite number above 0 (rope_type {rope_type!r})")
    return scaling


def _normalize_rope_scaling(scaling) -> dict | None:
    """The scaling kind as "rope_type" (older configs say "type"); plain RoPE is None. Not an object: left for
    LlamaConfig to refuse."""
    if not scaling or not isinstance(scaling, dict):
        return scaling or None
    scaling = dict(scaling)
    scaling.pop("rope_theta", None)
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type == "default":
        return None
    return {"rope_type": rope_type, **scaling}
