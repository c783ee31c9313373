"""The KV tensors: one K and one V pool per layer, ``[num_blocks, block_size, num_kv_heads, head_dim]``, and how
many blocks a pool gets."""

from __future__ import annotations

import os

import torch


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def pool_blocks(bytes_per_block: int, device: torch.device, kv_cache_memory: int | None, block_size: int,
                max_model_len: int, max_num_seqs: int) -> int:
    """Blocks of a pool of ``kv_cache_memory`` bytes (default: 1 GiB on a CPU, 40% of the free memory on CUDA),
    never more than ``max_num_seqs`` full contexts hold."""
    if kv_cache_memory is None:
        kv_cache_memory = int(torch.cuda.mem_get_info(device)[0] * 0.4) if device.type == "cuda" else 1 << 30
    if kv_cache_memory < bytes_per_block:
        raise ValueError(f"kv_cache_memory={kv_cache_memory} bytes holds no block ({bytes_per_block} bytes each)")
    return min(kv_cache_memory // bytes_per_block, max_num_seqs * -(-max_model_len // block_size))


def check_pool_memory(num_blocks: int, bytes_per_block: int, block_size: int, device: torch.device) -> None:
    """Refuse, before allocating, a pool larger than the device's memory."""
    need = num_blocks * bytes_per_block
    if device.type == "cuda":
        have = torch.cuda.mem_get_info(device)[0]
    else:
        have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need > have:
        raise ValueError(f"num_blocks={num_blocks} of {block_size} tokens needs {need / 2**30:.1f} GiB of KV "
                         f"cache, more than the {have / 2**30:.1f} GiB this {device.type} has")


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
