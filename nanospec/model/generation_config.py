"""The sampling a model asks for by default (vLLM's ``--generation-config``); the server applies it to every field
a request leaves out. ``"auto"``: the model directory's ``generation_config.json``, a GGUF file's own
``general.sampling.*`` keys (as llama.cpp reads them; not a file beside it, which may be another model's), the
embedded SmolLM2's model card's temperature 0.2, top-p 0.9; ``"vllm"``: the API's defaults; a DIR:
``DIR/generation_config.json``. Keys read: ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``,
``max_new_tokens``; ``do_sample: false`` is greedy.
"""

from __future__ import annotations

from pathlib import Path

from nanospec.model.embedded import EMBEDDED_SAMPLING
from nanospec.model.gguf_file import read_gguf_metadata
from nanospec.model.loader import read_json
from nanospec.sampling_params import SamplingParams

FILE_NAME = "generation_config.json"
# generation_config.json's name -> SamplingParams'
KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
# a GGUF file's name (llama.cpp's converter writes them from generation_config.json) -> SamplingParams'
GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
             "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
             "general.sampling.penalty_repeat": "repetition_penalty"}


def default_sampling(model: str | None, generation_config: str = "auto") -> tuple[dict, str]:
    """(SamplingParams fields, where they come from) for ``model``; ValueError naming a bad file or value."""
    if generation_config == "vllm":
        return {}, "the API's defaults (--generation-config vllm)"
    if generation_config != "auto":
        directory = Path(generation_config)
        if not (directory / FILE_NAME).is_file():
            raise ValueError(f"--generation-config {generation_config}: no {FILE_NAME} in that directory "
                             f"(give 'auto', 'vllm' or a directory that holds one)")
        return read_generation_config(directory / FILE_NAME)
    if model is None:
        return dict(EMBEDDED_SAMPLING), "the embedded model's chat defaults"
    path = Path(model)
    if not path.is_dir():
        return read_gguf_sampling(path)
    if (path / FILE_NAME).is_file():
        return read_generation_config(path / FILE_NAME)
    return {}, f"the API's defaults ({path} has no {FILE_NAME})"


def read_gguf_sampling(file: Path) -> tuple[dict, str]:
    metadata = read_gguf_metadata(file)
    fields = {ours: metadata[theirs] for theirs, ours in GGUF_KEYS.items() if theirs in metadata}
    if not fields:
        return {}, f"the API's defaults ({file} has no general.sampling keys)"
    if isinstance(fields.get("top_k"), int) and fields["top_k"] <= 0:  # llama.cpp's "no top-k"
        fields["top_k"] = -1
    return _checked(fields, f"{file} (general.sampling)"), f"{file} (general.sampling)"


def read_generation_config(file: Path) -> tuple[dict, str]:
    config = read_json(file)
    fields = {ours: config[theirs] for theirs, ours in KEYS.items() if config.get(theirs) is not None}
    if config.get("do_sample") is False:
        fields["temperature"] = 0.0
    if fields.get("top_k") == 0:  # transformers' "no top-k"
        fields["top_k"] = -1
    return _checked(fields, file), str(file)


def _checked(fields: dict, source) -> dict:
    """`fields`, which SamplingParams takes; ValueError naming `source` and the field otherwise."""
    try:
        SamplingParams(**fields)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    return fields


def describe(fields: dict) -> str:
    """``temperature 0.2, top_p 0.9`` (or ``none``)."""
    return ", ".join(f"{k} {v}" for k, v in fields.items()) or "none"
