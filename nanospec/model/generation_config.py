"""The sampling a model asks for by default (vLLM's ``--generation-config``); the server applies it to every field
a request leaves out. ``"auto"``: the model directory's ``generation_config.json`` (the embedded SmolLM2: temperature
0.2, top-p 0.9, its model card's); ``"vllm"``: the API's defaults; a DIR: ``DIR/generation_config.json``. Keys read:
``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, ``max_new_tokens``; ``do_sample: false``
is greedy.
"""

from __future__ import annotations

import json
from pathlib import Path

from nanospec.model.embedded import EMBEDDED_SAMPLING
from nanospec.sampling_params import SamplingParams

FILE_NAME = "generation_config.json"
# generation_config.json's name -> SamplingParams'
KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


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
    file = (path if path.is_dir() else path.parent) / FILE_NAME
    if file.is_file():
        return read_generation_config(file)
    return {}, f"the API's defaults ({path} has no {FILE_NAME})"


def read_generation_config(file: Path) -> tuple[dict, str]:
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{file}: not a readable JSON file ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file}: must hold a JSON object")
    fields = {ours: config[theirs] for theirs, ours in KEYS.items() if config.get(theirs) is not None}
    if config.get("do_sample") is False:
        fields["temperature"] = 0.0
    if fields.get("top_k") == 0:  # transformers' "no top-k"
        fields["top_k"] = -1
    try:
        SamplingParams(**fields)
    except ValueError as e:
        raise ValueError(f"{file}: {e}") from None
    return fields, str(file)


def describe(fields: dict) -> str:
    """``temperature 0.2, top_p 0.9`` (or ``none``)."""
    return ", ".join(f"{k} {v}" for k, v in fields.items()) or "none"
