"""Read a llama.cpp GGUF file into Hugging Face form: a LlamaConfig, fp32 tensors under HF names, and a tokenizer.

Three things differ from a Hugging Face checkpoint:
- names: "blk.3.attn_q.weight" is "model.layers.3.self_attn.q_proj.weight", and so on (see `_LAYER_NAMES`);
- q and k rows: llama.cpp's converter reorders them per head so that each rotary pair (i, i + head_dim / 2) sits
  in adjacent rows. Within a head of d rows, HF row  h * d / 2 + j  (half h, j < d / 2) is stored at row  2 * j + h.
  Viewing a head as (2, d / 2) in HF order and (d / 2, 2) in GGUF order, the inverse is a transpose of those two axes;
- the tokenizer is metadata (tokens, merges, token types), from which we build a `tokenizers` JSON.
Quantized tensors (Q4_1, Q8_0, K-quants, ...) are dequantized to fp32 with `gguf.quants.dequantize`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer
from tqdm import tqdm

from nanospec.model.config import LlamaConfig

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# How llama.cpp splits text into words before BPE, by `tokenizer.ggml.pre`. The Llama 3 family differs from GPT-2's
# split (digits in runs of up to 3, case-insensitive contractions); anything else uses GPT-2's, as transformers does.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS = {name: _LLAMA3_SPLIT for name in ("llama3", "llama-v3", "llama-bpe", "smaug-bpe")}

_CONTROL_TOKEN, _USER_DEFINED_TOKEN = 3, 4  # tokenizer.ggml.token_type values


@dataclass
class GGUFModel:
    config: LlamaConfig
    tensors: dict[str, torch.Tensor]  # HF names, fp32, HF layout
    tokenizer_json: str  # a `tokenizers` tokenizer.json
    tokenizer_config: dict  # tokenizer_config.json: chat_template, bos_token, eos_token, add_bos_token, ...


def read_gguf(path: str | os.PathLike) -> GGUFModel:
    """Read a GGUF file of a Llama model. Raises FileNotFoundError, or ValueError for a file that is not a valid
    GGUF of a Llama model (checked before any tensor is dequantized)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such GGUF file: {path}")
    try:
        reader = GGUFReader(path)
    except Exception as error:  # the reader fails in many ways on junk (bad magic, short reads, bad reshapes)
        raise ValueError(f"not a valid GGUF file: {path} (corrupt or truncated; the reader said "
                         f"{type(error).__name__}: {error})") from None

    metadata = _Metadata(reader, path)
    architecture = metadata.get("general.architecture")
    if architecture != "llama":
        raise ValueError(f"unsupported GGUF architecture {architecture!r} in {path}: nanospec runs 'llama' only")

    gguf_tensors = {t.name: t for t in reader.tensors}
    config = _config_from_metadata(metadata, tied=("output.weight" not in gguf_tensors))
    tokenizer_json, tokenizer_config = _tokenizer_from_metadata(metadata)

    hf_names = {name: _hf_name(name, path) for name in gguf_tensors}
    expected_shapes = config.weight_shapes()
    missing = sorted(set(expected_shapes) - set(hf_names.values()))
    if missing:
        raise ValueError(f"GGUF file {path} lacks tensors for {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    for name, tensor in gguf_tensors.items():
        if hf_names[name] not in expected_shapes:
            raise ValueError(f"unexpected tensor {name!r} in GGUF file {path} (the config has "
                             f"{config.num_hidden_layers} layers)")
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dimensions innermost first
        if shape != expected_shapes[hf_names[name]]:
            raise ValueError(f"tensor {name} in {path} has shape {shape}, expected {expected_shapes[hf_names[name]]}")
        if tensor.data.nbytes != tensor.n_bytes:
            raise ValueError(f"not a valid GGUF file: {path} (tensor {name} is cut short: the file is truncated)")

    tensors = {}
    progress = tqdm(gguf_tensors.items(), desc=f"Reading {path.name}", unit="tensor", leave=False, disable=None)
    for name, tensor in progress:
        weight = _dequantize(tensor)
        if name.endswith("attn_q.weight"):
            weight = _unpermute_rotary_rows(weight, config.num_attention_heads)
        elif name.endswith("attn_k.weight"):
            weight = _unpermute_rotary_rows(weight, config.num_key_value_heads)
        tensors[hf_names[name]] = weight
    return GGUFModel(config, tensors, tokenizer_json, tokenizer_config)


class _Metadata:
    """The key/value metadata of a GGUF file, read on demand."""

    def __init__(self, reader: GGUFReader, path: Path):
        self.fields, self.path = reader.fields, path

    def get(self, key: str, default=None):
        field = self.fields.get(key)
        return field.contents() if field is not None else default

    def require(self, key: str):
        if key not in self.fields:
            raise ValueError(f"GGUF file {self.path} lacks the metadata key {key!r}")
        return self.get(key)


def _config_from_metadata(metadata: _Metadata, tied: bool) -> LlamaConfig:
    hidden_size = metadata.require("llama.embedding_length")
    num_heads = metadata.require("llama.attention.head_count")
    eos_ids = [
        metadata.get(f"tokenizer.ggml.{key}")
        for key in ("eos_token_id", "eot_token_id", "eom_token_id")  # llama.cpp stops at any of them
    ]
    return LlamaConfig(
        vocab_size=metadata.get("llama.vocab_size") or len(metadata.require("tokenizer.ggml.tokens")),
        hidden_size=hidden_size,
        intermediate_size=metadata.require("llama.feed_forward_length"),
        num_hidden_layers=metadata.require("llama.block_count"),
        num_attention_heads=num_heads,
        num_key_value_heads=metadata.get("llama.attention.head_count_kv", num_heads),
        head_dim=metadata.get("llama.attention.key_length", hidden_size // num_heads),
        rms_norm_eps=metadata.get("llama.attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=metadata.get("llama.rope.freq_base", 10000.0),
        rope_scaling=_rope_scaling_from_metadata(metadata),
        max_position_embeddings=metadata.get("llama.context_length", 2048),
        tie_word_embeddings=tied,
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=list(dict.fromkeys(i for i in eos_ids if i is not None)),
    )


def _rope_scaling_from_metadata(metadata: _Metadata) -> dict | None:
    kind = metadata.get("llama.rope.scaling.type", "none")
    factor = metadata.get("llama.rope.scaling.factor")
    if kind == "none" or factor in (None, 1.0):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        original = metadata.require("llama.rope.scaling.original_context_length")
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    raise ValueError(f"unsupported RoPE scaling {kind!r} in GGUF file {metadata.path}")


def _hf_name(gguf_name: str, path: Path) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")  # blk.<i>.<name>.weight
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES and parts[3] == "weight":
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.weight"
    if gguf_name == "rope_freqs.weight":
        raise ValueError(f"GGUF file {path} uses Llama 3.1-style RoPE frequency factors (rope_freqs), which nanospec "
                         "cannot read from GGUF: load the model's Hugging Face directory instead")
    raise ValueError(f"unexpected tensor {gguf_name!r} in GGUF file {path}")


def _dequantize(tensor) -> torch.Tensor:
    """One GGUF tensor as fp32 in (out, in) order. The data is copied out of the memory map first: `gguf`'s numpy
    dequantizers are several times slower when they index the map directly."""
    shape = tuple(int(n) for n in reversed(tensor.shape))
    data = np.array(tensor.data)
    if tensor.tensor_type == GGMLQuantizationType.F32:
        weight = torch.from_numpy(data.view(np.float32))
    elif tensor.tensor_type == GGMLQuantizationType.F16:
        weight = torch.from_numpy(data.view(np.float16)).float()
    elif tensor.tensor_type == GGMLQuantizationType.BF16:
        weight = torch.from_numpy(data.view(np.int16)).view(torch.bfloat16).float()
    else:
        weight = torch.from_numpy(gguf.quants.dequantize(data, tensor.tensor_type))
    return weight.reshape(shape)


def _unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head interleaving of q/k rows (see the module docstring)."""
    rows, cols = weight.shape
    return weight.reshape(num_heads, rows // num_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols).contiguous()


def _tokenizer_from_metadata(metadata: _Metadata) -> tuple[str, dict]:
    """A byte-level BPE tokenizer (GPT-2 style, `tokenizer.ggml.model` == "gpt2") as tokenizer.json text, and its
    tokenizer_config: the same ids as transformers builds from this file."""
    kind = metadata.require("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer {kind!r} in {metadata.path}: nanospec reads byte-level BPE "
                         "('gpt2') tokenizers from GGUF; load the model's Hugging Face directory instead")
    tokens = metadata.require("tokenizer.ggml.tokens")
    token_types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(merge.split(" ")) for merge in metadata.require("tokenizer.ggml.merges")]

    # Every byte-level BPE token is spelled in GPT-2's 256-character byte alphabet; a few files write a token in
    # plain text instead, which we respell.
    byte_alphabet = _bytes_to_unicode()
    spelled = set(byte_alphabet.values())

    def respell(token: str) -> str:
        return token if set(token) <= spelled else "".join(byte_alphabet[b] for b in token.encode("utf-8"))

    vocab = {respell(token): index for index, token in enumerate(tokens)}
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, continuing_subword_prefix="",
                                          end_of_word_suffix="", fuse_unk=False))
    split = _PRE_TOKENIZER_SPLITS.get(metadata.get("tokenizer.ggml.pre"))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    backend.decoder = decoders.ByteLevel()

    # Control tokens ("<|im_start|>") are special: matched whole in text and skipped when decoding. A "control" token
    # outside the byte alphabet is a mislabel in the file and stays out, as in transformers. User-defined tokens
    # ("<think>") are matched whole but are ordinary text.
    backend.add_special_tokens([
        AddedToken(token, special=True, normalized=False)
        for token, kind in zip(tokens, token_types) if kind == _CONTROL_TOKEN and set(token) <= spelled
    ])
    backend.add_tokens([
        AddedToken(token, special=False, normalized=False)
        for token, kind in zip(tokens, token_types) if kind == _USER_DEFINED_TOKEN and token in vocab
    ])

    def token_of(key: str) -> str | None:
        index = metadata.get(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None else None

    config = {
        "bos_token": token_of("bos_token_id"),
        "eos_token": token_of("eos_token_id"),
        "unk_token": token_of("unknown_token_id"),
        "pad_token": token_of("padding_token_id"),
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        "chat_template": metadata.get("tokenizer.chat_template"),
    }
    if config["add_bos_token"] and config["bos_token"] is not None:
        # Let the tokenizer.json itself add BOS, so any reader of it (transformers included) agrees.
        bos = config["bos_token"]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, vocab[respell(bos)])]
        )
    return backend.to_str(), {key: value for key, value in config.items() if value is not None}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character: printable bytes map to themselves, the rest to
    characters from U+0100 up, so that every byte sequence is a string without spaces or control characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping
