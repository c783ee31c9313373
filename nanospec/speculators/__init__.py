"""Shipped speculators and the prompt set they are trained on (data; see ``nanospec.train_speculator``).

``prompts.jsonl``: the prompts ``python -m nanospec.train_speculator`` runs the target over (written by
``python -m nanospec.speculators.make_prompts``); ``smollm2-135m-instruct/``: the MLP speculator trained for the
embedded SmolLM2-135M-Instruct (``config.json`` + ``model.safetensors``).
"""
