"""A model named by its Hugging Face Hub id (``"org/name"``), as vLLM takes it: the local snapshot of that repository,
from the Hub's cache (``HF_HUB_CACHE``) or downloaded into it by ``huggingface_hub``. Only what nanospec reads is
fetched: the JSON files (config, tokenizer, generation config) and the safetensors weights, never pickled weights."""

from __future__ import annotations

import os
import re
from pathlib import Path

HUB_FILES = ["*.json", "*.safetensors"]
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def resolve_model_path(model: str | os.PathLike) -> Path:
    """``model`` itself when it exists here or cannot be a Hub id, else its Hub snapshot. FileNotFoundError (naming
    ``model`` and what the Hub said) when it is neither."""
    path = Path(model)
    if path.exists():
        return path
    if not _HUB_ID.fullmatch(str(model)):
        raise FileNotFoundError(f"model path does not exist: {model}")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(model), allow_patterns=HUB_FILES))
    except Exception as error:  # offline and not cached, no such repository, a gated one, ...
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise FileNotFoundError(f"model {model!r} is not a local path, and the Hugging Face Hub did not give it "
                                f"({reason}); where the Hub is reachable, `hf download {model} --local-dir DIR` "
                                f"fetches it, then pass DIR") from None
