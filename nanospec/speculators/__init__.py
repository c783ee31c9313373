"""Shipped speculators (data): ``smollm2-135m-instruct/``, the MLP speculator trained for the embedded
SmolLM2-135M-Instruct (``config.json`` + ``model.safetensors``, ``speculative_config.json``: how it is served) by
``python -m nanospec.train``.
"""
