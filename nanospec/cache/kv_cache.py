"""The KV tensors: one K and one V pool per layer, ``[num_blocks, block_size, num_kv_heads, head_dim]``, and how
many blocks a pool gets. On a CPU the pool is an anonymous memory map, zero-filled by the operating system and
resident only as its pages are written, so a pool sized for whole contexts costs memory for the tokens it holds."""

from __future__ import annotations

import math
import mmap
import os

import torch

CUDA_FREE_MEMORY_SHARE = 0.4  # of a GPU's free memory, for the pool by default
CPU_MEMORY_SHARE = 0.25       # of a CPU machine's memory, the most a pool reserves by default


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


def pool_blocks(bytes_per_block: int, device: torch.device, block_size: int, max_model_len: int, max_num_seqs: int,
                num_blocks: int | None = None, kv_cache_memory: int | None = None, pools: int = 1) -> int:
    """``num_blocks``, or by default blocks enough for ``max_num_seqs`` sequences of ``max_model_len`` tokens at once
    within ``kv_cache_memory`` bytes (default: the shares above of a GPU's free or a CPU's memory, split between the
    ``pools`` of this size that share it: the ranks of a tensor-parallel group on a CPU). ValueError, before
    allocating, when the budget holds no block or the pools are larger than the device's memory."""
    have = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else \
        os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if num_blocks is None:
        if kv_cache_memory is None:
            share = CUDA_FREE_MEMORY_SHARE if device.type == "cuda" else CPU_MEMORY_SHARE
            kv_cache_memory = int(have * share) // pools
        check_holds_a_block(kv_cache_memory, bytes_per_block)
        num_blocks = min(kv_cache_memory // bytes_per_block, max_num_seqs * -(-max_model_len // block_size))
    if (need := num_blocks * bytes_per_block * pools) > have:
        raise ValueError(f"num_blocks={num_blocks} of {block_size} tokens needs {need / 2**30:.1f} GiB of KV "
                         f"cache{f' ({pools} ranks)' if pools > 1 else ''}, more than the {have / 2**30:.1f} GiB this "
                         f"{device.type} has")
    return num_blocks


def check_holds_a_block(kv_cache_memory: int, bytes_per_block: int) -> None:
    """ValueError, naming the value, when a KV budget of ``kv_cache_memory`` bytes holds no block."""
    if kv_cache_memory < bytes_per_block:
        raise ValueError(f"kv_cache_memory={kv_cache_memory} bytes holds no block ({bytes_per_block} bytes each)")


def zeros_reserved(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros in an anonymous memory map: its pages are committed when first written."""
    nbytes = max(math.prod(shape) * dtype.itemsize, 1)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype, count=math.prod(shape)).view(shape)


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        self.data = zeros_reserved(shape, dtype) if torch.device(device).type == "cpu" else \
            torch.zeros(shape, dtype=dtype, device=device)
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
