"""The KV tensors: one K and one V pool per layer, ``[num_blocks, block_size, num_kv_heads, head_dim]``."""

from __future__ import annotations

import torch


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        self.data = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks = num_blocks
        self.block_size = block_size
        # views, made once: per layer as blocks, and with the block axes merged into one slot axis
        self._layers = [(self.data[i, 0], self.data[i, 1]) for i in range(num_layers)]
        self._slots = [(k.flatten(0, 1), v.flatten(0, 1)) for k, v in self._layers]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_cache, v_cache)`` of layer ``i``, ``[num_blocks, block_size, Hk, D]`` each."""
        return self._layers[i]

    def layer_slots(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The same, ``[num_blocks * block_size, Hk, D]``: slot ``s`` is row ``s % block_size`` of block
        ``s // block_size``."""
        return self._slots[i]
