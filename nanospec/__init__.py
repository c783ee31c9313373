"""nanospec: a small, Triton-kernel-first LLM inference engine built for speculative decoding."""

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput"]


def __getattr__(name):  # lazy, so `import nanospec.kernels.x` does not load the engine
    if name == "LLM":
        from nanospec.llm import LLM

        return LLM
    if name == "SamplingParams":
        from nanospec.sampling_params import SamplingParams

        return SamplingParams
    if name == "RequestOutput":
        from nanospec.outputs import RequestOutput

        return RequestOutput
    raise AttributeError(f"module 'nanospec' has no attribute {name!r}")
