"""nanospec: a small, Triton-kernel-first LLM inference engine built for speculative decoding."""

import importlib

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
_MODULES = {"LLM": "nanospec.llm", "SamplingParams": "nanospec.sampling_params", "RequestOutput": "nanospec.outputs",
            "CompletionOutput": "nanospec.outputs"}


def __getattr__(name):  # lazy, so `import nanospec.kernels.x` does not load the engine
    if name in _MODULES:
        return getattr(importlib.import_module(_MODULES[name]), name)
    raise AttributeError(f"module 'nanospec' has no attribute {name!r}")
