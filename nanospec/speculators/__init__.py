"""Shipped speculators (data) for the embedded SmolLM2-135M-Instruct, each with ``speculative_config.json``, how it
is served, and its training log and summary:

* ``smollm2-135m-instruct/``: the MLP speculator (``config.json`` + ``model.safetensors``), trained by
  ``python -m nanospec.train``;
* ``smollm2-135m-instruct-eagle3/``: an EAGLE-3 head in the published format (``{"method": "eagle3", "model": DIR}``),
  trained by ``python -m nanospec.train --kind eagle3``.
"""
