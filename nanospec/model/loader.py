"""Load a Llama checkpoint (a Hugging Face directory, a GGUF file, or the embedded SmolLM2) as a LlamaConfig, tensors
under Hugging Face names, and a Tokenizer. What can be checked cheaply is checked before any weight is read, each
error naming the file and the field or tensor; each weight read is checked for NaN and infinities."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path

import tokenizers
import torch
from safetensors import safe_open
from tqdm import tqdm

from nanospec.model.config import REQUIRED_HF_FIELDS, LlamaConfig, check_tensors, short_list, short_repr, token_ids
from nanospec.model.embedded import embedded_model_path
from nanospec.model.gguf_file import GGUFHeader, all_finite, read_gguf_header, read_gguf_tensors
from nanospec.model.quantization import Weight, check_int4_shape, parse_quantization, quantize
from nanospec.tokenizer import Tokenizer

FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # the safetensors dtypes of weights we load


@dataclass
class Checkpoint:
    config: LlamaConfig
    tensors: dict[str, Weight]  # HF names (config.weight_shapes()), on the CPU: float or quantized
    tokenizer: Tokenizer
    path: Path  # where it was loaded from


def load_checkpoint(path: str | os.PathLike | None, dtype: torch.dtype | None, quantization: str | None = None,
                    check_config: Callable[[LlamaConfig], None] | None = None,
                    check_tokenizer: Callable[[Tokenizer], None] | None = None) -> Checkpoint:
    """Load `path` (None: the embedded SmolLM2), float tensors cast to `dtype` (None: as stored). `quantization`: None
    loads float weights; "auto" keeps a GGUF's 4-bit blocks and an HF checkpoint as stored; "int4" / "int8" round an HF
    checkpoint's matrices on load. `check_config` is called with the config as soon as it is read, before the tokenizer
    or any tensor; `check_tokenizer` with the tokenizer, before any tensor: what either raises ends the load."""
    parse_quantization(quantization)
    return open_checkpoint(path, check_config).load(dtype, quantization, check_tokenizer)


def open_checkpoint(path: str | os.PathLike | None,
                    check_config: Callable[[LlamaConfig], None] | None = None) -> OpenCheckpoint:
    """`path` (None: the embedded SmolLM2) opened for :meth:`OpenCheckpoint.load`: its config read (config.json, or a
    GGUF file's header, parsed here once) and passed to `check_config`; no tokenizer built, no tensor read."""
    path = model_path(path)
    if path.is_dir():
        checkpoint = OpenCheckpoint(path, _read_hf_config(path))
    else:
        header = read_gguf_header(path)
        checkpoint = OpenCheckpoint(path, header.config, header)
    if check_config is not None:
        check_config(checkpoint.config)
    return checkpoint


@dataclass
class OpenCheckpoint:
    """A checkpoint whose config is read (:func:`open_checkpoint`) and whose tensors are not yet."""
    path: Path
    config: LlamaConfig
    gguf: GGUFHeader | None = None  # a GGUF file's parsed header (None: a Hugging Face directory)
    _tokenizer: Tokenizer | None = None

    def tokenizer(self) -> Tokenizer:
        """Its tokenizer (built once), no tensor read."""
        if self._tokenizer is None:
            self._tokenizer = (_load_tokenizer(self.path, self.config) if self.gguf is None
                               else _gguf_tokenizer(self.gguf))
        return self._tokenizer

    def load(self, dtype: torch.dtype | None, quantization: str | None = None,
             check_tokenizer: Callable[[Tokenizer], None] | None = None) -> Checkpoint:
        """The checkpoint (:func:`load_checkpoint`'s `dtype` and `quantization`); `check_tokenizer` is called with
        the tokenizer before any tensor is read."""
        scheme, group_size = parse_quantization(quantization)
        tokenizer = self.tokenizer()
        if check_tokenizer is not None:
            check_tokenizer(tokenizer)
        if self.gguf is None:
            tensors = _read_hf_tensors(self.path, self.config, dtype, scheme, group_size)
        else:
            tensors = read_gguf_tensors(self.gguf, scheme, group_size)
            if dtype is not None:
                for name in list(tensors):  # one tensor at a time, so the fp32 copy of the model is freed as we go
                    if isinstance(tensors[name], torch.Tensor):
                        tensors[name] = tensors.pop(name).to(dtype)
        return Checkpoint(self.config, tensors, tokenizer, self.path)


def model_path(path: str | os.PathLike | None) -> Path:
    """`path` (None: the embedded model's file), checked to be a directory or a GGUF file: FileNotFoundError or
    ValueError naming it otherwise (a file of a Hugging Face directory: the error names the directory to pass)."""
    if path is not None and os.fspath(path) == "":
        raise ValueError("the model path is empty: give a Hugging Face directory or a .gguf file")
    path = embedded_model_path() if path is None else Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model path does not exist: {path}")
    if path.is_dir() or path.suffix == ".gguf" or _starts_with_gguf(path):
        return path
    hint = f"; pass its directory {path.parent}" if (path.parent / "config.json").is_file() else ""
    raise ValueError(f"cannot load {path}: expected a .gguf file or a Hugging Face model directory "
                     f"(config.json, model.safetensors, tokenizer.json){hint}")


def round_checkpoint(checkpoint: Checkpoint, quantization: str | None) -> Checkpoint:
    """A checkpoint given as tensors (``LLM.with_random_weights``), its float matrices rounded as
    :func:`load_checkpoint` rounds an HF checkpoint's for "int4" / "int8"; as it is for None and "auto"."""
    scheme, group_size = parse_quantization(quantization)
    if scheme not in ("int4", "int8"):
        return checkpoint
    rounded = {name: quantize(t, scheme, group_size) if isinstance(t, torch.Tensor) and t.dim() == 2 else t
               for name, t in checkpoint.tensors.items()}
    return replace(checkpoint, tensors=rounded)


def _gguf_tokenizer(header: GGUFHeader) -> Tokenizer:
    tokenizer_json, tokenizer_config = header.tokenizer()
    try:
        return Tokenizer.from_json_str(tokenizer_json, tokenizer_config, header.config.eos_token_id)
    except Exception as error:  # tokenizers' and jinja's own errors
        raise ValueError(f"cannot build the tokenizer of GGUF file {header.path} ({error})") from None


def _read_hf_config(directory: Path) -> LlamaConfig:
    config_file = directory / "config.json"
    if not config_file.is_file():
        gguf_files = sorted(path for path in directory.glob("*.gguf") if path.is_file())
        hint = f" (to load a GGUF, pass the file itself, e.g. {gguf_files[0]})" if gguf_files else ""
        raise FileNotFoundError(f"{directory} has no config.json{hint}")
    hf_config = read_json(config_file)
    try:
        return LlamaConfig.from_hf_dict(hf_config, require=REQUIRED_HF_FIELDS)
    except ValueError as error:
        raise ValueError(f"{config_file}: {error}") from None


def _read_hf_tensors(directory: Path, config: LlamaConfig, dtype: torch.dtype | None, scheme: str | None,
                     group_size: int) -> dict[str, Weight]:
    weight_files = _weight_files(directory)

    with ExitStack() as stack:
        handles = {file: stack.enter_context(open_safetensors(file)) for file in weight_files}
        file_of = {}
        for file, handle in handles.items():
            for name in handle.keys():
                if name in file_of:  # which copy is the model's? transformers and vLLM would each take one
                    raise ValueError(f"{directory}: tensor {name} is stored twice, in {file_of[name].name} and "
                                     f"{file.name}")
                file_of[name] = file
        stored = {name: handles[file].get_slice(name) for name, file in file_of.items() if not _ignored(name, config)}
        expected = config.weight_shapes()
        check_tensors(weight_files[0] if len(weight_files) == 1 else directory, expected,
                      {name: tuple(stored[name].get_shape()) for name in stored}, "config.json")
        for name, shape in expected.items():
            if stored[name].get_dtype() not in FLOAT_DTYPES:
                raise ValueError(f"tensor {name} in {file_of[name]} has dtype {stored[name].get_dtype()}, but weights "
                                 f"must be floating point ({', '.join(FLOAT_DTYPES)})")
            if scheme == "int4" and len(shape) == 2:
                check_int4_shape(shape[1], group_size)
        tensors = {}
        for name in tqdm(expected, desc=f"Loading {directory.name}", unit="tensor", leave=False, disable=None):
            tensor = handles[file_of[name]].get_tensor(name)
            if not all_finite(tensor):
                raise ValueError(f"tensor {name} in {file_of[name]} holds NaN or infinite values")
            if scheme in ("int4", "int8") and tensor.dim() == 2:
                tensors[name] = quantize(tensor, scheme, group_size)
            else:
                tensors[name] = tensor.to(dtype) if dtype is not None else tensor
    return tensors


def _ignored(name: str, config: LlamaConfig) -> bool:
    """A stored tensor that is not a weight of the model (transformers and vLLM skip it too): the RoPE frequencies
    older transformers saved, and lm_head.weight when tie_word_embeddings ties it to the embedding."""
    return name.endswith(".rotary_emb.inv_freq") or (name == "lm_head.weight" and config.tie_word_embeddings)


def _weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint: one model.safetensors, or the shards its index names."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map", {})
        if not isinstance(weight_map, dict) or not all(isinstance(shard, str) for shard in weight_map.values()):
            raise ValueError(f"shard index {index}: weight_map must map tensor names to file names, got "
                             f"{short_repr(weight_map)}")
        shards = sorted(set(weight_map.values()))
        if not shards:
            raise ValueError(f"shard index {index} has an empty weight_map")
        missing = [shard for shard in shards if not (directory / shard).is_file()]
        if missing:
            raise ValueError(f"shard index {index} names files that are missing: {short_list(missing)}")
        return [directory / shard for shard in shards]
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {directory} "
                            "(only safetensors weights are loaded, never pickled .bin files)")


def open_safetensors(file: Path):
    """``safe_open(file)``, or a ValueError naming the file (and the tensor cut short, when its header tells)."""
    try:
        return safe_open(str(file), framework="pt")
    except Exception as error:  # SafetensorError: bad header, truncated data, ...
        cut = _cut_short_tensor(file)
        problem = f"tensor {cut} is cut short: the file is truncated" if cut else str(error)
        raise ValueError(f"not a valid safetensors file: {file} ({problem})") from None


def _cut_short_tensor(file: Path) -> str | None:
    """The first tensor of a safetensors file whose data runs past the file's end, when its header tells."""
    try:
        with open(file, "rb") as f:
            (header_size,) = struct.unpack("<Q", f.read(8))
            if header_size > 100_000_000:  # safetensors' own limit
                return None
            header = json.loads(f.read(header_size))
        data_size = file.stat().st_size - 8 - header_size
        cut = [(info["data_offsets"][1], name) for name, info in header.items()
               if name != "__metadata__" and info["data_offsets"][1] > data_size]
    except (OSError, struct.error, ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None  # not even a readable header: safetensors' own message says so
    return min(cut)[1] if cut else None


def _load_tokenizer(directory: Path, config: LlamaConfig) -> Tokenizer:
    """tokenizer.json with tokenizer_config.json (or chat_template.jinja); stop ids from config.json and
    generation_config.json too."""
    tokenizer_json = directory / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise FileNotFoundError(f"{directory} has no tokenizer.json")
    config_file = directory / "tokenizer_config.json"
    tokenizer_config = read_json(config_file) if config_file.is_file() else {}
    template_file = directory / "chat_template.jinja"
    config_source = config_file  # where tokenizer_config's fields were read
    if "chat_template" not in tokenizer_config and template_file.is_file():
        tokenizer_config["chat_template"] = template_file.read_text()
        config_source = template_file if not config_file.is_file() else f"{config_file} with {template_file.name}"
    eos_ids = list(config.eos_token_id)
    generation_file = directory / "generation_config.json"
    if generation_file.exists():  # (one that is not a readable file: read_json's error)
        generation_eos = read_json(generation_file).get("eos_token_id")
        try:
            eos_ids += token_ids("eos_token_id", generation_eos, config.vocab_size)
        except ValueError as error:
            raise ValueError(f"{generation_file}: {error}") from None
    try:
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_json))
    except Exception as error:  # tokenizers' own error type
        raise ValueError(f"cannot read tokenizer {tokenizer_json} ({error})") from None
    try:
        return Tokenizer(backend, tokenizer_config, eos_ids)
    except ValueError as error:  # a special token or the chat template
        raise ValueError(f"{config_source}: {error}") from None


def read_json(path: Path) -> dict:
    """A JSON file that holds an object; ValueError naming the file otherwise."""
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise
    except OSError as error:  # there but not a readable file: a directory of that name, no permission to read, ...
        raise ValueError(f"cannot read {path} ({error.strerror or error})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"not a valid JSON file: {path} ({error})") from None
    if not isinstance(value, dict):
        raise ValueError(f"not a valid JSON file: {path} (it must hold an object, got {short_repr(value)})")
    return value


def _starts_with_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"

