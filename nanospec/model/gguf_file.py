"""Read a llama.cpp GGUF file into Hugging Face form: a LlamaConfig, fp32 or quantized tensors under HF names
(``_LAYER_NAMES``), and a tokenizer (:mod:`nanospec.model.gguf_tokenizer`). llama.cpp reorders q and k rows per head
so that each rotary pair (i, i + d / 2) sits in adjacent rows: HF row h * d / 2 + j is stored at row 2 j + h.

The header is read here, not by gguf's GGUFReader, which trusts every length and count in the file: each is checked
against the bytes left, and every tensor against the file's end and the config, before any data is read.
"""

from __future__ import annotations

import functools
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from tqdm import tqdm

from nanospec.model.config import ConfigError, LlamaConfig, check_tensors, short_repr
from nanospec.model.gguf_quant import dequantize_blocks, gguf_weight
from nanospec.model.gguf_tokenizer import STRINGS, tokenizer_from_metadata
from nanospec.model.quantization import Weight, check_int4_shape, select_rows

_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


# The metadata keys of the LlamaConfig fields. Without llama.vocab_size the vocabulary is tokenizer.ggml.tokens.
_CONFIG_KEYS = {
    "vocab_size": "llama.vocab_size", "hidden_size": "llama.embedding_length",
    "intermediate_size": "llama.feed_forward_length", "num_hidden_layers": "llama.block_count",
    "num_attention_heads": "llama.attention.head_count", "num_key_value_heads": "llama.attention.head_count_kv",
    "head_dim": "llama.attention.key_length", "rms_norm_eps": "llama.attention.layer_norm_rms_epsilon",
    "rope_theta": "llama.rope.freq_base", "max_position_embeddings": "llama.context_length",
    "bos_token_id": "tokenizer.ggml.bos_token_id",
}
_REQUIRED_CONFIG_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                           "max_position_embeddings")  # llama.cpp requires these keys too
_CONFIG_DEFAULTS = {"rms_norm_eps": 1e-5, "rope_theta": 10000.0, "bos_token_id": None}
_EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
_ROPE_FACTOR_KEYS = ("llama.rope.scaling.factor", "llama.rope.scale_linear")  # llama.cpp reads the second, older one


@dataclass
class GGUFModel:
    config: LlamaConfig
    tensors: dict[str, Weight]  # HF names, HF layout: float32, or quantized (nanospec.model.quantization)
    tokenizer_json: str  # a `tokenizers` tokenizer.json
    tokenizer_config: dict  # tokenizer_config.json: chat_template, bos_token, eos_token, add_bos_token, ...


@dataclass
class _Tensor:
    name: str
    shape: tuple[int, ...]  # outermost first, as in PyTorch (GGUF lists dimensions innermost first)
    type: GGMLQuantizationType
    data: np.ndarray  # its bytes (uint8), a view of the file's memory map


def read_gguf(path: str | os.PathLike, quantization: str | None = None, group_size: int = 32) -> GGUFModel:
    """Read a GGUF file of a Llama model. Raises FileNotFoundError, or ValueError naming the file and the key or tensor
    at fault: a corrupt or truncated header, bad metadata (LlamaConfig's checks), a tensor whose name, shape or type
    does not fit the metadata (all before any tensor is dequantized), or NaN or infinite values.
    ``quantization`` (None, "auto", "int4", "int8"; ``nanospec.model.gguf_quant.gguf_weight``): which weights stay
    or become quantized; None dequantizes every tensor to float32. (:func:`read_gguf_header` and
    :func:`read_gguf_tensors` are its two halves, for a caller that checks the config before any tensor is read.)"""
    header = read_gguf_header(path)
    tokenizer_json, tokenizer_config = header.tokenizer()
    return GGUFModel(header.config, read_gguf_tensors(header, quantization, group_size), tokenizer_json,
                     tokenizer_config)


@dataclass
class GGUFHeader:
    """A GGUF file's header, parsed once (:func:`read_gguf_header`): its metadata, its config and its tensors, whose
    data (views of the file's memory map) :func:`read_gguf_tensors` reads."""
    path: Path
    metadata: _Metadata
    tensors: list[_Tensor]
    config: LlamaConfig

    def tokenizer(self) -> tuple[str, dict]:
        """The tokenizer.json text and tokenizer_config of its ``tokenizer.ggml.*`` metadata (no tensor read)."""
        return tokenizer_from_metadata(self.metadata, self.config.vocab_size)


def read_gguf_header(path: str | os.PathLike) -> GGUFHeader:
    """The header of a GGUF file of a Llama model, and its config (read_gguf's errors for the header), no tensor
    read."""
    path = Path(path)
    metadata, tensors, config = _read_header_and_config(path)
    return GGUFHeader(path, metadata, tensors, config)


def read_gguf_tensors(header: GGUFHeader, quantization: str | None = None, group_size: int = 32
                      ) -> dict[str, Weight]:
    """The tensors of the file of `header` under HF names (read_gguf's tensor checks first, then the data)."""
    path, config, header_tensors = header.path, header.config, header.tensors
    hf_names = _check_tensors(header_tensors, config, path)
    if quantization in ("int4", "auto") and group_size != 32:
        for tensor in header_tensors:
            if len(tensor.shape) == 2:
                check_int4_shape(tensor.shape[1], group_size)

    tensors = {}
    for tensor in tqdm(header_tensors, desc=f"Loading {path.name}", unit="tensor", leave=False, disable=None):
        # copied out of the memory map (gguf's dequantizers are slow on it), whose pages are then let go: else the
        # whole file stays resident until the model is read
        blocks = np.array(tensor.data)
        if getattr(tensor.data, "_mmap", None) is not None and hasattr(mmap, "MADV_DONTNEED"):
            tensor.data._mmap.madvise(mmap.MADV_DONTNEED)
        weight = gguf_weight(blocks, tensor.type, tensor.shape, quantization, group_size)
        if not weight_is_finite(weight):
            raise ValueError(f"tensor {tensor.name} in {path} holds NaN or infinite values")
        if tensor.name.endswith("attn_q.weight"):
            weight = _unpermute_rotary_rows(weight, config.num_attention_heads)
        elif tensor.name.endswith("attn_k.weight"):
            weight = _unpermute_rotary_rows(weight, config.num_key_value_heads)
        tensors[hf_names[tensor.name]] = weight
    return tensors


def read_gguf_metadata(path: str | os.PathLike) -> dict:
    """The key/value metadata of a GGUF file but its arrays (left unread), with read_gguf's errors for the header."""
    return dict(_read_header(Path(path), arrays=False)[0])


def _read_header_and_config(path: Path) -> tuple[_Metadata, list[_Tensor], LlamaConfig]:
    metadata, header_tensors = _read_header(path)
    architecture = metadata.get("general.architecture")
    if architecture != "llama":
        raise ValueError(f"unsupported GGUF architecture {short_repr(architecture)} in {path}: nanospec runs 'llama' "
                         "only")
    config = _config_from_metadata(metadata, tied=not any(t.name == "output.weight" for t in header_tensors))
    return metadata, header_tensors, config


_SCALAR_FORMATS = {  # struct formats of GGUF's scalar value types
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT32: "f", GGUFValueType.FLOAT64: "d", GGUFValueType.BOOL: "?",
}
_MAX_DIMS = 4  # GGML_MAX_DIMS


class _Corrupt(Exception):
    """Raised while reading a header; read_gguf words it as a ValueError naming the file."""


class _HeaderParser:
    """Reads GGUF values (little-endian) from the bytes of a file, refusing any length or count that runs past its
    end before reading, allocating or looping over it."""

    def __init__(self, data: memoryview):
        self.data, self.offset = data, 0

    def need(self, size: int, what: str) -> None:
        if size > len(self.data) - self.offset:
            raise _Corrupt(f"{what} at byte {self.offset} needs {size} bytes, but the file ends at byte "
                           f"{len(self.data)}")

    def scalar(self, fmt: str, what: str):
        size = struct.calcsize(fmt)
        self.need(size, what)
        (value,) = struct.unpack_from("<" + fmt, self.data, self.offset)
        self.offset += size
        return value

    def string(self, what: str, build: bool = True) -> str | None:
        size = self.scalar("Q", what)
        self.need(size, what)
        try:
            text = str(self.data[self.offset:self.offset + size], "utf-8") if build else None
        except UnicodeDecodeError:
            raise _Corrupt(f"{what} at byte {self.offset} is not UTF-8 text") from None
        self.offset += size
        return text

    def value(self, value_type: int, what: str, build: bool = True):
        """The value of type ``value_type``; ``build`` False steps over an array's items unread (returns None)."""
        if value_type == GGUFValueType.STRING:
            return self.string(what, build)
        if value_type in _SCALAR_FORMATS:
            return self.scalar(_SCALAR_FORMATS[value_type], what)
        if value_type != GGUFValueType.ARRAY:
            raise _Corrupt(f"{what} has an unknown value type ({value_type})")
        item_type, count = self.scalar("I", what), self.scalar("Q", what)
        if item_type in _SCALAR_FORMATS:
            dtype = np.dtype("<" + _SCALAR_FORMATS[item_type])
            self.need(count * dtype.itemsize, f"{what} ({count} values)")
            items = np.frombuffer(self.data, dtype, count, self.offset)
            self.offset += items.nbytes
            return items.tolist() if build else None
        self.need(count * 8, f"{what} ({count} values)")  # a string or an array takes 8 bytes or more
        items = [self.value(item_type, what, build) for _ in range(count)]
        return items if build else None


def _read_header(path: Path, arrays: bool = True) -> tuple[_Metadata, list[_Tensor]]:
    """The metadata of a GGUF file and its tensors (views of the file's memory map, not read yet); ``arrays`` False
    leaves the array values (the tokenizer's) out of the metadata, unread. Raises FileNotFoundError for no file, and
    ValueError for a file that is not a GGUF (version 2 or 3, little-endian) or whose header or tensor data is cut
    short."""
    if not path.is_file():
        raise FileNotFoundError(f"no such GGUF file: {path}")
    data = np.memmap(path, dtype=np.uint8, mode="r") if path.stat().st_size else np.zeros(0, dtype=np.uint8)
    parser = _HeaderParser(memoryview(data))
    try:
        if bytes(parser.data[:4]) != b"GGUF":
            raise _Corrupt("it does not start with 'GGUF'")
        parser.offset = 4
        version = parser.scalar("I", "the version")
        if version not in (2, 3):
            raise _Corrupt(f"version {version}; nanospec reads GGUF versions 2 and 3, little-endian")
        tensor_count, key_count = parser.scalar("Q", "the tensor count"), parser.scalar("Q", "the key count")
        parser.need(key_count * 13, f"the metadata ({key_count} keys)")  # a key/value takes 13 bytes or more
        values = {}
        for _ in range(key_count):
            key = parser.string("a metadata key")
            if key in values:
                raise _Corrupt(f"the metadata key {key} appears twice")
            value_type = parser.scalar("I", f"the type of {key}")
            if value_type != GGUFValueType.ARRAY or arrays:
                values[key] = parser.value(value_type, key)
            else:
                parser.value(value_type, key, build=False)
        parser.need(tensor_count * 32, f"the tensor list ({tensor_count} tensors)")  # 32 bytes or more per tensor
        infos = {}
        for _ in range(tensor_count):
            name = parser.string("a tensor name")
            if name in infos:
                raise _Corrupt(f"the tensor {name} appears twice")
            n_dims = parser.scalar("I", f"tensor {name}")
            if not 1 <= n_dims <= _MAX_DIMS:
                raise _Corrupt(f"tensor {name} has {n_dims} dimensions")
            dims = [parser.scalar("Q", f"tensor {name}") for _ in range(n_dims)]  # innermost first
            # its type, and its offset from the start of the data (after the header)
            infos[name] = (dims, parser.scalar("I", f"tensor {name}"), parser.scalar("Q", f"tensor {name}"))
        alignment = values.get("general.alignment", 32)
        if type(alignment) is not int or alignment < 1 or alignment & (alignment - 1):
            raise _Corrupt(f"general.alignment is {short_repr(alignment)}, not a power of two")
        start = -(-parser.offset // alignment) * alignment
        return _Metadata(values, path), [_tensor(name, dims, type_id, start + offset, data)
                        for name, (dims, type_id, offset) in infos.items()]
    except _Corrupt as error:
        raise ValueError(f"not a valid GGUF file: {path} ({error})") from None


def _tensor(name: str, dims: list[int], type_id: int, begin: int, data: np.ndarray) -> _Tensor:
    """A tensor of the header, its type known and its data (from byte `begin` of `data`) inside the file."""
    try:
        tensor_type = GGMLQuantizationType(type_id)
    except ValueError:
        raise _Corrupt(f"tensor {name} has an unknown type ({type_id})") from None
    block_size, type_size = GGML_QUANT_SIZES[tensor_type]
    if dims[0] % block_size:
        raise _Corrupt(f"tensor {name} has rows of {dims[0]} values, not a multiple of its {tensor_type.name} "
                       f"blocks of {block_size}")
    end = begin + math.prod(dims) // block_size * type_size
    if end > len(data):
        raise _Corrupt(f"tensor {name} is cut short: its data (bytes {begin} to {end}) runs past the end of the "
                       f"file ({len(data)} bytes): the file is truncated, or its header corrupt")
    return _Tensor(name, tuple(reversed(dims)), tensor_type, data[begin:end])


class _Metadata(dict):
    """The key/value metadata of a GGUF file, with the file's path for errors."""

    def __init__(self, values: dict, path: Path):
        super().__init__(values)
        self.path = path

    def get(self, key: str, default=None, expect: tuple | None = None):
        """The value of `key` (`default` if absent), checked to be of type `expect` (a (test, description) pair)."""
        if key not in self:
            return default
        value = self[key]
        if expect is not None and not expect[0](value):
            raise ValueError(f"GGUF file {self.path}: {key} must be {expect[1]}, got {short_repr(value)}")
        return value

    def require(self, key: str, expect: tuple | None = None):
        if key not in self:
            raise ValueError(f"GGUF file {self.path} lacks the metadata key {key!r}")
        return self.get(key, expect=expect)


def _config_from_metadata(metadata: _Metadata, tied: bool) -> LlamaConfig:
    """The LlamaConfig of the llama.* and tokenizer.ggml.* keys, checked by LlamaConfig: a missing or bad value is a
    ValueError naming the file and the key."""
    for field in _REQUIRED_CONFIG_FIELDS:
        metadata.require(_CONFIG_KEYS[field])
    fields = _CONFIG_DEFAULTS | {field: metadata[key] for field, key in _CONFIG_KEYS.items() if key in metadata}
    if "vocab_size" not in fields:
        fields["vocab_size"] = len(metadata.require("tokenizer.ggml.tokens", STRINGS))
    eos_ids = []  # llama.cpp stops at any of them
    for key in _EOS_KEYS:
        if key in metadata and metadata.get(key) not in eos_ids:
            eos_ids.append(metadata.get(key))
    try:
        config = LlamaConfig(**fields, rope_scaling=_rope_scaling_from_metadata(metadata), tie_word_embeddings=tied,
                             eos_token_id=eos_ids)
    except ConfigError as error:
        key = (_CONFIG_KEYS | {"rope_scaling.rope_type": "llama.rope.scaling.type"}).get(error.field)
        if error.field == "eos_token_id":
            key = next((key for key in _EOS_KEYS if metadata.get(key) == error.value), None)
        if error.field == "rope_scaling.factor":
            key = next(key for key in _ROPE_FACTOR_KEYS if key in metadata)
        raise ValueError(f"GGUF file {metadata.path}: {error.describe(key if key in metadata else error.field)}") \
            from None
    rotary = metadata.get("llama.rope.dimension_count", config.head_dim)
    if rotary != config.head_dim:  # llama.cpp refuses such a llama too ("invalid n_rot")
        raise ValueError(f"GGUF file {metadata.path}: llama.rope.dimension_count must be the head dimension "
                         f"({config.head_dim}): nanospec rotates every dimension of a head, got {short_repr(rotary)}")
    value_length = metadata.get("llama.attention.value_length", config.head_dim)
    if value_length != config.head_dim:
        raise ValueError(f"GGUF file {metadata.path}: llama.attention.value_length must be the head dimension "
                         f"({config.head_dim}): nanospec's value heads are as wide as its key heads, got "
                         f"{short_repr(value_length)}")
    experts = metadata.get("llama.expert_count", 0)
    if experts:
        raise ValueError(f"GGUF file {metadata.path}: llama.expert_count is {short_repr(experts)}: nanospec runs "
                         "dense Llama models, not mixtures of experts")
    return config


def _rope_scaling_from_metadata(metadata: _Metadata) -> dict | None:
    """rope_scaling as llama.cpp reads llama.rope.*: the kind (linear when not stated), the factor from
    ``_ROPE_FACTOR_KEYS`` (none, 0 or 1: plain RoPE, as is the kind "none"); LlamaConfig refuses a kind nanospec does
    not compute (llama.cpp's "yarn", ...)."""
    kind = metadata.get("llama.rope.scaling.type", "linear")
    factor = next((metadata.get(key) for key in _ROPE_FACTOR_KEYS if key in metadata), None)
    if kind == "none" or factor in (None, 0.0, 1.0):
        return None
    return {"rope_type": kind, "factor": factor}


def _check_tensors(tensors: list[_Tensor], config: LlamaConfig, path: Path) -> dict[str, str]:
    """Check, from the header alone, that the file holds every tensor the config needs and no other, each with the
    shape the config implies and a type we can dequantize. Returns the HF name of each GGUF tensor."""
    if any(tensor.name == "rope_freqs.weight" for tensor in tensors):
        raise ValueError(f"GGUF file {path} uses Llama 3.1-style RoPE frequency factors (rope_freqs), which nanospec "
                         "cannot read from GGUF: load the model's Hugging Face directory instead")
    gguf_names = {hf: gguf for gguf, hf in _GLOBAL_NAMES.items()}
    for i in range(config.num_hidden_layers):
        gguf_names |= {f"model.layers.{i}.{hf}.weight": f"blk.{i}.{gguf}.weight" for gguf, hf in _LAYER_NAMES.items()}
    check_tensors(path, {gguf_names[name]: shape for name, shape in config.weight_shapes().items()},
                  {tensor.name: tensor.shape for tensor in tensors}, "the metadata")
    for tensor in tensors:
        if not _can_dequantize(tensor.type):
            raise ValueError(f"tensor {tensor.name} in {path} has type {tensor.type.name}, which nanospec cannot "
                             "dequantize")
    return {gguf: hf for hf, gguf in gguf_names.items()}


@functools.cache
def _can_dequantize(tensor_type: GGMLQuantizationType) -> bool:
    """Whether dequantize_blocks reads this type: tried on one block of zeros."""
    block_size, type_size = GGML_QUANT_SIZES[tensor_type]
    try:
        dequantize_blocks(np.zeros(type_size, dtype=np.uint8), tensor_type, (block_size,))
    except NotImplementedError:
        return False
    return True


def all_finite(tensor: torch.Tensor) -> bool:
    """No NaN or infinity in `tensor`: its smallest and largest values tell (NaN propagates through both)."""
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low) & torch.isfinite(high))


def weight_is_finite(weight: Weight) -> bool:
    """No NaN or infinity in a float weight, or in a quantized weight's scales and zeros."""
    if isinstance(weight, torch.Tensor):
        return all_finite(weight)
    return all(all_finite(t) for t in vars(weight).values() if isinstance(t, torch.Tensor) and t.is_floating_point())


def _unpermute_rotary_rows(weight: Weight, num_heads: int) -> Weight:
    """Undo llama.cpp's per-head interleaving of q/k rows (see the module docstring): HF row
    ``h * d / 2 + j`` of a head of ``d`` rows is GGUF row ``2 j + h``."""
    rows = weight.shape[0]
    order = torch.arange(rows).reshape(num_heads, rows // num_heads // 2, 2).transpose(1, 2).reshape(rows)
    return select_rows(weight, order)
