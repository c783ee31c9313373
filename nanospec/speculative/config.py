"""``speculative_config``: which proposer guesses tokens for the target to verify.

    {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    {"method": "ngram", "num_speculative_tokens": 5, "max_candidates": 4}          # a token tree
    {"method": "draft", "model": PATH, "num_speculative_tokens": 4, "tree_top_k": 2, "tree_budget": 12}
    {"method": "draft", "model": PATH, "acceptance": "coupled"}     # outputs equal plain seeded sampling
    {"method": "lookahead", "window_size": 5, "ngram_size": 4, "guess_set_size": 5}
    {"method": "mlp_speculator", "model": PATH, "tree_top_k": 4, "prompt_lookup": True}
    {"method": "eagle3", "model": PATH, "tree_top_k": 4, "tree_budget": 24}   # an EAGLE-3 head (vLLM / SGLang format)
    {"method": "eagle3", "prompt_lookup": True}   # the head shipped for the embedded model, and the n-gram chain

``"adaptive": True`` (the default) verifies only the guesses that pay (:mod:`nanospec.speculative.policy`). The
keys of each method and their meaning: ``docs/speculative-decoding.md``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from nanospec.device import cpu_has_fast_bfloat16, resolve_dtype
from nanospec.model.eagle3 import load_eagle3_head
from nanospec.model.hub import resolve_model_path
from nanospec.model.loader import OpenCheckpoint
from nanospec.model.mlp_speculator import load_mlp_speculator
from nanospec.model.parallel import ParallelGroup
from nanospec.model.quantization import parse_quantization
from nanospec.speculative.draft import DraftProposer
from nanospec.speculative.eagle3 import SHIPPED_FOR_EMBEDDED as SHIPPED_EAGLE3
from nanospec.speculative.eagle3 import Eagle3Proposer
from nanospec.speculative.lookahead import LookaheadProposer
from nanospec.speculative.mlp import SHIPPED_FOR_EMBEDDED as SHIPPED_MLP
from nanospec.speculative.mlp import MLPSpeculatorProposer
from nanospec.speculative.ngram import NgramProposer
from nanospec.speculative.proposer import Proposer

_KEYS = {
    "ngram": {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "adaptive",
              "max_candidates", "tree_budget"},
    "draft": {"method", "num_speculative_tokens", "model", "dtype", "adaptive", "tree_top_k", "tree_budget",
              "acceptance", "draft_tensor_parallel_size", "quantization"},
    "lookahead": {"method", "window_size", "ngram_size", "guess_set_size", "adaptive"},
    "mlp_speculator": {"method", "model", "num_speculative_tokens", "adaptive", "dtype", "tree_top_k", "prompt_lookup",
                       "prompt_lookup_min", "prompt_lookup_max"},
    "eagle3": {"method", "model", "num_speculative_tokens", "adaptive", "dtype", "tree_top_k", "tree_budget",
               "prompt_lookup", "prompt_lookup_min", "prompt_lookup_max"},
}


@dataclass
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int  # 0: the proposer's own (lookahead: its window; an MLP speculator: its n_predict)
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None
    dtype: str | None = None
    adaptive: bool = True
    max_candidates: int = 1
    tree_top_k: int | None = None  # None: not set (draft: 1; mlp_speculator: the speculator directory's default)
    tree_budget: int | None = None
    window_size: int = 5
    ngram_size: int = 4
    guess_set_size: int = 5
    acceptance: str = "rejection"
    draft_tensor_parallel_size: int | None = None  # None: the target's (vLLM's default); else 1 or the target's
    prompt_lookup: bool | None = None  # mlp_speculator, eagle3: the n-gram chain joins its guesses (None: not set)
    quantization: str | None = "auto"  # draft: its weights, as LLM(quantization=...)


# The largest value each size may take: beyond these a step would feed hundreds of guesses per sequence.
_MAXIMA = {"num_speculative_tokens": 64, "prompt_lookup_min": 64, "prompt_lookup_max": 64, "max_candidates": 64,
           "tree_budget": 256, "tree_top_k": 64, "window_size": 64, "ngram_size": 16, "guess_set_size": 64}


def _positive_int(config: dict, key: str, default: int, source: str = "speculative_config") -> int:
    value = config.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= _MAXIMA[key]:
        raise ValueError(f"{source}[{key!r}] must be an integer in [1, {_MAXIMA[key]}], got {value!r}")
    return value


def _bool(config: dict, key: str, default: bool, source: str = "speculative_config") -> bool:
    value = config.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"{source}[{key!r}] must be True or False, got {value!r}")
    return value


def _optional_int(config: dict, key: str) -> int | None:
    return _positive_int(config, key, 1) if key in config else None


def parse_speculative_config(config: dict | None) -> SpeculativeConfig | None:
    if config is None:
        return None
    if not isinstance(config, dict):
        raise ValueError(f"speculative_config must be a dict, got {type(config).__name__}")
    method = config.get("method")
    if method not in _KEYS:
        raise ValueError(f"speculative_config['method'] must be one of {sorted(_KEYS)}, got {method!r}")
    unknown = set(config) - _KEYS[method]
    if unknown:
        raise ValueError(f"unknown speculative_config keys for method {method!r}: {sorted(unknown)}")
    if method == "lookahead":
        return SpeculativeConfig(method, 0, window_size=_positive_int(config, "window_size", 5),
                                 ngram_size=_positive_int(config, "ngram_size", 4),
                                 guess_set_size=_positive_int(config, "guess_set_size", 5),
                                 adaptive=_bool(config, "adaptive", True))
    if method == "mlp_speculator":
        k = _optional_int(config, "num_speculative_tokens") or 0
    else:
        k = _positive_int(config, "num_speculative_tokens", 5 if method == "ngram" else 4)
    fields = {"tree_budget": _optional_int(config, "tree_budget"), "adaptive": _bool(config, "adaptive", True)}
    if method in ("ngram", "mlp_speculator", "eagle3"):
        fields["prompt_lookup_min"] = lo = _positive_int(config, "prompt_lookup_min", 1)
        fields["prompt_lookup_max"] = hi = _positive_int(config, "prompt_lookup_max", 4)
        if lo > hi:
            raise ValueError(f"prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
    if method == "ngram":
        return SpeculativeConfig(method, k, max_candidates=_positive_int(config, "max_candidates", 1), **fields)
    fields["dtype"] = dtype = config.get("dtype")
    if dtype is not None and not isinstance(dtype, str):
        raise ValueError(f"speculative_config['dtype'] must be a dtype name such as 'float32', got {dtype!r}")
    model = config.get("model")
    if method == "mlp_speculator":  # without a model: the shipped one, if the target is the embedded model
        if model is not None:
            if not model or not isinstance(model, (str, os.PathLike)):
                raise ValueError(f"speculative_config['model'] for method 'mlp_speculator' must be the path of an "
                                 f"MLP speculator directory (config.json + model.safetensors), got {model!r}")
            model = _local(model, "the MLP speculator")
        tree_top_k = _optional_int(config, "tree_top_k")
        prompt_lookup = _bool(config, "prompt_lookup", False) if "prompt_lookup" in config else None
        return SpeculativeConfig(method, k, model=model, tree_top_k=tree_top_k, prompt_lookup=prompt_lookup, **fields)
    shipped = method == "eagle3" and model is None  # the head shipped for the embedded model (checked when built)
    if not shipped and (not model or not isinstance(model, (str, os.PathLike))):
        what = ("the directory of an EAGLE-3 head (config.json + safetensors)" if method == "eagle3"
                else "the path of a small Llama")
        raise ValueError(f"speculative_config for method {method!r} needs 'model': {what}, got {model!r}")
    if method == "eagle3":  # without a model: the shipped head, if the target is the embedded model
        model = None if model is None else _local(model, "the EAGLE-3 head")
        if model is not None and not Path(model).is_dir():
            raise FileNotFoundError(f"speculative_config['model']: the EAGLE-3 head must be a directory, got {model}")
        # its directory's speculative_config.json: the tree's shape where no shape key is set, prompt_lookup where unset
        shape = {"num_speculative_tokens", "tree_top_k", "tree_budget"}
        directory = Path(model) if model is not None else SHIPPED_EAGLE3
        served = _served(directory / "speculative_config.json", shape | {"prompt_lookup"})
        config = {**({k: v for k, v in served.items() if k in shape} if not shape & set(config) else {}),
                  "prompt_lookup": served.get("prompt_lookup", False), **config}
        k = _positive_int(config, "num_speculative_tokens", 4)
        fields["tree_budget"] = _optional_int(config, "tree_budget")
        return SpeculativeConfig(method, k, model=model, tree_top_k=_positive_int(config, "tree_top_k", 1),
                                 prompt_lookup=_bool(config, "prompt_lookup", False), **fields)
    tree_top_k = _positive_int(config, "tree_top_k", 1)
    acceptance = config.get("acceptance", "rejection")
    if acceptance not in ("rejection", "coupled"):
        raise ValueError(f"speculative_config['acceptance'] must be 'rejection' or 'coupled', got {acceptance!r}")
    draft_tp = config.get("draft_tensor_parallel_size")
    if draft_tp is not None and (not isinstance(draft_tp, int) or isinstance(draft_tp, bool) or draft_tp < 1):
        raise ValueError(f"speculative_config['draft_tensor_parallel_size'] must be a positive integer, got "
                         f"{draft_tp!r}")
    quantization = config.get("quantization", "auto")
    try:
        parse_quantization(quantization)
    except ValueError as e:
        raise ValueError(f"speculative_config['quantization']: {e}") from None
    model = _local(model, "the draft model")
    fields["tree_budget"] = fields["tree_budget"] or k * tree_top_k
    return SpeculativeConfig(method, k, model=model, tree_top_k=tree_top_k, acceptance=acceptance,
                             draft_tensor_parallel_size=draft_tp, quantization=quantization, **fields)


def _local(model: str | os.PathLike, what: str) -> str:
    """``model`` where it lies here: a path that exists, or a Hugging Face Hub id's snapshot (nanospec.model.hub)."""
    try:
        return str(resolve_model_path(model))
    except FileNotFoundError as error:
        raise FileNotFoundError(f"speculative_config['model'] ({what}): {error}") from None


def _served(file: Path, keys: set[str]) -> dict:
    """A speculator directory's ``speculative_config.json`` (``{}`` when there is none), holding only ``keys``."""
    if not file.is_file():
        return {}
    try:
        served = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{file}: not valid JSON ({error})") from None
    if not isinstance(served, dict):
        raise ValueError(f"{file}: must hold a JSON object, got {type(served).__name__}")
    unknown = set(served) - keys
    if unknown:
        raise ValueError(f"{file}: unknown keys {sorted(unknown)} (it may set {', '.join(map(repr, sorted(keys)))})")
    return served


def with_served_defaults(config: SpeculativeConfig, speculator: Path) -> SpeculativeConfig:
    """``tree_top_k`` and ``prompt_lookup`` where the caller left them out: from the speculator directory's
    ``speculative_config.json``, else a chain without lookup."""
    file = Path(speculator) / "speculative_config.json"
    served = _served(file, {"tree_top_k", "prompt_lookup"})
    return replace(config,
                   tree_top_k=config.tree_top_k or _positive_int(served, "tree_top_k", 1, source=str(file)),
                   prompt_lookup=config.prompt_lookup if config.prompt_lookup is not None
                   else _bool(served, "prompt_lookup", False, source=str(file)))


def draft_tensor_parallel_size(config: SpeculativeConfig | None, tensor_parallel_size: int) -> int | None:
    """How many ranks the draft runs on (None: no draft model): 1 or the target's ``tensor_parallel_size``."""
    if config is None or config.method != "draft":
        return None
    size = config.draft_tensor_parallel_size
    if size is None:
        return tensor_parallel_size
    if size not in (1, tensor_parallel_size):
        raise ValueError(f"speculative_config['draft_tensor_parallel_size']={size}: the draft runs on rank 0 alone "
                         f"(1) or on as many ranks as the target (tensor_parallel_size={tensor_parallel_size})")
    return size


# A target of the embedded model's shape (SmolLM2-135M-Instruct) gets its shipped speculator when none is named.
EMBEDDED_SHAPE = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                  "num_attention_heads": 9, "num_key_value_heads": 3}
# method -> (the directory shipped for the embedded model, what it holds, its files and width, how to train one)
SHIPPED = {
    "mlp_speculator": (SHIPPED_MLP, "an MLP speculator", "config.json + model.safetensors, emb_dim",
                       "python -m nanospec.train"),
    "eagle3": (SHIPPED_EAGLE3, "an EAGLE-3 head", "config.json + safetensors, hidden_size",
               "python -m nanospec.train --kind eagle3"),
}


def shipped_path(method: str, model: str | None, target_config) -> Path:
    """The speculator directory of ``method`` ("mlp_speculator" or "eagle3"): ``model``, or the one shipped for a
    target of the embedded model's shape (ValueError for another target, FileNotFoundError if it is missing)."""
    if model is not None:
        return Path(model)
    shipped, what, files, train = SHIPPED[method]
    if any(getattr(target_config, name) != value for name, value in EMBEDDED_SHAPE.items()):
        c = target_config
        raise ValueError(f"speculative_config for method {method!r} needs 'model': the directory of {what} for this "
                         f"target ({files} {c.hidden_size}, vocab_size {c.vocab_size}). Only the embedded "
                         f"SmolLM2-135M-Instruct has a shipped one, and this target (hidden_size {c.hidden_size}, "
                         f"{c.num_hidden_layers} layers, vocab_size {c.vocab_size}) is not it")
    if not (shipped / "config.json").is_file():
        raise FileNotFoundError(f"the {what.split(' ', 1)[1]} shipped for the embedded SmolLM2-135M-Instruct is "
                                f"missing from this installation ({shipped}); pass speculative_config['model'], the "
                                f"directory of one ({train} trains one)")
    return shipped


def make_proposer(config: SpeculativeConfig, target_config, tokenizer, num_blocks: int, block_size: int, device,
                  dtype, max_model_len: int | None = None, draft_tp: ParallelGroup | None = None,
                  enable_prefix_caching: bool = True, matmul_dtype: torch.dtype | None = None,
                  draft: OpenCheckpoint | None = None) -> Proposer:
    """The proposer the speculator drives, in ``config.dtype`` or the target's ``dtype`` (over a target whose matmuls
    read ``matmul_dtype``: an MLP speculator on a CPU with native bfloat16 in that dtype, an EAGLE-3 head in int8);
    ``draft_tp``: a draft model's group under tensor parallelism (None: whole on this process); ``draft``: the draft
    model already opened (None: opened here)."""
    weight_only = matmul_dtype not in (None, dtype)  # the target's matmuls are a CPU's weight-only kernels
    if config.dtype is not None:
        dtype = resolve_dtype(config.dtype, device)
    elif config.method == "mlp_speculator" and weight_only and cpu_has_fast_bfloat16():
        dtype = matmul_dtype
    if config.method == "ngram":
        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max,
                             config.max_candidates, config.tree_budget)
    if config.method == "lookahead":
        return LookaheadProposer(config.window_size, config.ngram_size, config.guess_set_size)
    if config.method == "mlp_speculator":
        path = shipped_path(config.method, config.model, target_config)
        config = with_served_defaults(config, path)
        speculator = load_mlp_speculator(path, emb_dim=target_config.hidden_size, vocab_size=target_config.vocab_size,
                                         device=device, dtype=dtype)
        return MLPSpeculatorProposer(speculator, config.num_speculative_tokens, config.tree_top_k,
                                     _prompt_lookup(config, speculator.config.n_predict), config.adaptive)
    if config.method == "eagle3":
        head, aux_layers = load_eagle3_head(shipped_path(config.method, config.model, target_config), target_config,
                                            device, dtype, int8=weight_only)
        return Eagle3Proposer(head, aux_layers, config.num_speculative_tokens, num_blocks, block_size,
                              max_model_len or target_config.max_position_embeddings, config.tree_top_k or 1,
                              config.tree_budget, config.adaptive,
                              _prompt_lookup(config, config.num_speculative_tokens))
    return DraftProposer(config, target_config, tokenizer, num_blocks, block_size, device, dtype, max_model_len,
                         draft_tp, enable_prefix_caching, draft)


def _prompt_lookup(config: SpeculativeConfig, k: int) -> NgramProposer | None:
    """The n-gram proposer whose chain, ``k`` long, joins a model's guesses (None without ``prompt_lookup``)."""
    if not config.prompt_lookup:
        return None
    return NgramProposer(k, config.prompt_lookup_min, config.prompt_lookup_max)
