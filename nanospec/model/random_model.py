"""A Llama of a given shape with random weights, drawn on the device, and the embedded SmolLM2's tokenizer (for speed
measurements)."""

from __future__ import annotations

import torch

from nanospec.model.config import LlamaConfig
from nanospec.model.loader import Checkpoint, load_checkpoint


def random_checkpoint(shape: dict, *, device=None, dtype: torch.dtype = torch.float32, seed: int = 0) -> Checkpoint:
    """``shape``: LlamaConfig fields (hidden_size, intermediate_size, num_hidden_layers, ...)."""
    embedded = load_checkpoint(None, None)
    config = LlamaConfig(vocab_size=embedded.config.vocab_size, max_position_embeddings=8192, rope_theta=500000.0,
                         tie_word_embeddings=True, bos_token_id=embedded.config.bos_token_id,
                         eos_token_id=embedded.config.eos_token_id, **shape)
    generator = torch.Generator(device=device or "cpu").manual_seed(seed)
    tensors = {}
    for name, size in config.weight_shapes().items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(size, dtype=dtype, device=device)
        else:
            tensors[name] = (torch.randn(size, generator=generator, device=device) * size[-1] ** -0.5).to(dtype)
    return Checkpoint(config, tensors, embedded.tokenizer, embedded.path)
