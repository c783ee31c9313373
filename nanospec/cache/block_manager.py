"""Paged KV blocks: which physical block holds which tokens of which sequence.

The cache is a pool of ``num_blocks`` blocks of ``block_size`` token slots. A sequence owns a
``block_table`` (a list of block ids); its token ``i`` lives in slot

    slot(i) = block_table[i // block_size] * block_size + i % block_size

``reserve`` grows a block table so that ``n`` tokens fit (before a forward that writes them),
``truncate`` shrinks it after speculative tokens are rejected (returning whole blocks no longer
needed; rejected K/V inside a kept block is simply overwritten later), ``free`` returns them all.
Invariant (property-tested): every block is either free or owned by exactly one block table.
Prefix caching would add a hash per full block and a reference count; the pool API stays the same.
"""

from __future__ import annotations

import heapq


def slots_of(block_table: list[int], block_size: int, token_indices) -> list[int]:
    """The cache slot of each token index (its block must be reserved): the formula above."""
    return [block_table[i // block_size] * block_size + i % block_size for i in token_indices]


class OutOfBlocks(RuntimeError):
    """Raised by ``reserve`` when the pool has too few free blocks; callers preempt and retry."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_block_ids: list[int] = list(range(num_blocks))  # a heap: the lowest free id is handed out first

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_reserve(self, block_table: list[int], num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(block_table) <= self.num_free_blocks

    def reserve(self, block_table: list[int], num_tokens: int) -> None:
        """Grow ``block_table`` in place until ``num_tokens`` tokens fit, with the lowest free block ids: a
        sequence whose speculative tail is reserved and returned every step gets the same blocks back, and one
        running alone keeps consecutive blocks (the CPU attention then reads its K/V as one slice, not a
        gather)."""
        missing = self.blocks_for(num_tokens) - len(block_table)
        if missing > self.num_free_blocks:
            raise OutOfBlocks(f"need {missing} blocks, {self.num_free_blocks} free")
        for _ in range(missing):
            block_table.append(heapq.heappop(self.free_block_ids))

    def truncate(self, block_table: list[int], num_tokens: int) -> None:
        """Shrink ``block_table`` in place to the blocks that ``num_tokens`` tokens need."""
        keep = self.blocks_for(num_tokens)
        while len(block_table) > keep:
            heapq.heappush(self.free_block_ids, block_table.pop())

    def free(self, block_table: list[int]) -> None:
        self.truncate(block_table, 0)
