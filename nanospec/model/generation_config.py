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
from nanospec.model.loader import model_path, read_json
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
        if not (directory / FILE_NAME).exists():  # (one that is there but not a readable file: read_json's error)
            raise ValueError(f"--generation-config {generation_config}: no {FILE_NAME} in that directory "
                             f"(give 'auto', 'vllm' or a directory that holds one)")
        return read_generation_config(directory / FILE_NAME)
    if model is None:
        return dict(EMBEDDED_SAMPLING), "the embedded model's chat defaults"
    path = model_path(model)
    if not path.is_dir():
        return read_gguf_sampling(path)
    if (path / FILE_NAME).exists():
        return read_generation_config(path / FILE_NAME)
    return {}, f"the API's defaults ({path} has no {FILE_NAME})"


def read_gguf_sampling(file: Path) -> tuple[dict, str]:
    metadata = read_gguf_metadata(file)
    fields = {ours: metadata[theirs] for theirs, ours in GGUF_KEYS.items() if theirs in metadata}
    if not fields:
        return {}, f"the API's defaults ({file} has no general.sampling keys)"
    if _is_int(fields.get("top_k")) and fields["top_k"] <= 0:  # llama.cpp's "no top-k"
        fields["top_k"] = -1
    source = f"{file} (general.sampling)"
    return _checked(fields, source), source


def read_generation_config(file: Path) -> tuple[dict, str]:
    """The SamplingParams fields of a generation_config.json; ValueError naming the file and the key otherwise."""
    config = read_json(file)
    fields = {ours: config[theirs] for theirs, ours in KEYS.items() if config.get(theirs) is not None}
    do_sample = config.get("do_sample")
    if do_sample is not None and not isinstance(do_sample, bool):
        raise ValueError(f"{file}: do_sample must be true or false, got {do_sample!r}")
    if do_sample is False:
        fields["temperature"] = 0.0
    if _is_int(fields.get("top_k")) and fields["top_k"] == 0:  # transformers' "no top-k"
        fields["top_k"] = -1
    return _checked(fields, file, {ours: theirs for theirs, ours in KEYS.items()}), str(file)


def to_generation_config(fields: dict) -> dict:
    """generation_config.json's keys for SamplingParams `fields` (:func:`default_sampling`'s), which
    :func:`read_generation_config` reads back as the same fields and transformers samples alike: temperature 0 as
    ``do_sample: false``, any other as ``do_sample: true`` with it; no top-k (-1) as ``top_k: 0``."""
    config = {theirs: fields[ours] for theirs, ours in KEYS.items() if ours in fields}
    if "temperature" in config:
        config["do_sample"] = config["temperature"] != 0
        if not config["do_sample"]:
            del config["temperature"]
    if config.get("top_k") == -1:
        config["top_k"] = 0
    return config


def _checked(fields: dict, source, names: dict[str, str] | None = None) -> dict:
    """`fields`, which SamplingParams takes; ValueError naming `source` and the key (its name there, `names`: field ->
    key) otherwise."""
    for field, value in fields.items():  # one at a time, so that the error names the key
        try:
            SamplingParams(**{field: value})
        except ValueError as e:
            key = (names or {}).get(field, field)
            raise ValueError(f"{source}: {e}" if key == field else f"{source}: {key}: {e}") from None
    try:
        SamplingParams(**fields)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    return fields


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def describe(fields: dict) -> str:
    """``temperature 0.2, top_p 0.9`` (or ``none``)."""
    return ", ".join(f"{k} {v}" for k, v in fields.items()) or "none"
