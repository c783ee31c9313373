"""Paged KV blocks: which physical block holds which tokens of which sequence, and the prefix cache.

A pool of ``num_blocks`` blocks of ``block_size`` token slots; a sequence's ``block_table`` (block ids) puts its
token ``i`` in slot

    slot(i) = block_table[i // block_size] * block_size + i % block_size

**Prefix cache** (as vLLM v1's): a block full of committed tokens is named by its chain hash

    hash(block j) = H(hash(block j - 1), tokens of block j)        (block -1: the empty prefix)

(``H``: BLAKE2b-128; a hit also compares the block's own tokens). A block whose last table lets go keeps its K/V and
name as a **cached** block, which a new table starting with the same tokens takes by reference count. Free blocks go
out before cached ones, cached ones least recently used first (a table's tail is returned before its head, so a
prefix outlives its continuations). Only full, named blocks are shared, and a sequence writes only at or past its
committed length, so a shared block is never written.

Every block is exactly one of: **used** (``ref_counts[b]`` tables hold it), **cached** (no table, named, in the
LRU) or **free** (no table, no name). ``num_free_blocks`` counts free and cached: both are there to reserve.

**Consecutive tables** (``consecutive=True``, where attention runs on a CPU, which reads a table of consecutive
blocks as one slice and any other by a gather): a table grows into the block after its last when that one is free
(or cached as another continuation of its own tokens, or out of every lookup's reach), and a new table whose cached
prefix cannot be continued in place takes a run of free blocks instead and has the prefix's K/V *copied* there
(``take_copies``: the engine copies before the step's forward); the cached blocks stay cached. Where no run is
free, the cached blocks right after the prefix are forgotten so that the table grows in place.
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections import OrderedDict
from dataclasses import dataclass


def slots_of(block_table: list[int], block_size: int, token_indices) -> list[int]:
    """The cache slot of each token index (its block must be reserved): the formula above."""
    return [block_table[i // block_size] * block_size + i % block_size for i in token_indices]


def chain_hash(parent: bytes, tokens: tuple[int, ...]) -> bytes:
    """The name of a full block: BLAKE2b-128 over its parent's name and its tokens (int64 each)."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class OutOfBlocks(RuntimeError):
    """Raised by ``reserve`` when the pool has too few free blocks; callers preempt and retry."""


@dataclass
class PrefixCacheStats:
    """Counted at each admission of a sequence (a recompute after preemption is a new admission), in tokens."""
    queries: int = 0  # the sequence's tokens, looked up
    hits: int = 0     # of those, found in cached blocks (not computed again)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 consecutive: bool = False):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.consecutive = consecutive
        # a heap of the free blocks (the lowest id is handed out first); a block taken out of turn (the one after a
        # table's last) stays in it until popped, so ``in_heap`` keeps every block in it at most once
        self._free_heap: list[int] = list(range(num_blocks))
        self._in_heap = bytearray(b"\x01") * num_blocks
        self._num_free = num_blocks
        self._copies: list[tuple[int, int]] = []  # (cached block, its copy): K/V the engine copies before the forward
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks  # a full block's name (None: not named)
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks  # a named block's tokens
        self.block_parents: list[bytes | None] = [None] * num_blocks  # a named block's parent's name (b"": none)
        self.cached_blocks: dict[bytes, int] = {}  # name -> the block that holds it, used or cached
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks, least recently used first
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        """Blocks that ``reserve`` can hand out: free and cached."""
        return self._num_free + len(self.evictable)

    def _is_free(self, block: int) -> bool:
        return self.ref_counts[block] == 0 and self.block_hashes[block] is None

    @property
    def num_cached_blocks(self) -> int:
        return len(self.evictable)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---------------------------------------------------------------- growing and shrinking a table
    def can_reserve(self, block_table: list[int], num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(block_table) <= self.num_free_blocks

    def reserve(self, block_table: list[int], num_tokens: int) -> None:
        """Grow ``block_table`` in place until ``num_tokens`` tokens fit, with the lowest free block ids (so a
        speculative tail reserved and returned every step gets the same blocks back), then the least recently used
        cached blocks, forgotten. With ``consecutive``, first the block after the table's last when it is free or
        :meth:`_reclaimable`."""
        missing = self.blocks_for(num_tokens) - len(block_table)
        if missing > self.num_free_blocks:
            raise OutOfBlocks(f"need {missing} blocks, {self.num_free_blocks} free")
        for _ in range(missing):
            after = block_table[-1] + 1 if block_table else self.num_blocks
            if self.consecutive and after < self.num_blocks and self._is_free(after):
                block = after  # its heap entry stays until popped
                self._num_free -= 1
            elif self.consecutive and block_table and self._reclaimable(after, self.block_hashes[block_table[-1]]):
                block = after
            elif self._num_free:
                block = self._pop_free()
            else:
                block = next(iter(self.evictable))  # the least recently used
            if block in self.evictable:
                self._forget(block)
            self.ref_counts[block] = 1
            block_table.append(block)

    def _reclaimable(self, block: int, parent: bytes | None) -> bool:
        """Whether ``block`` is cached as another continuation of the tokens named ``parent`` (a request that repeats
        a prompt meets its predecessor's answer there), or where no lookup reaches it (no block holds its parent's
        name any more)."""
        if block not in self.evictable:
            return False
        own_parent = self.block_parents[block]
        return (parent is not None and own_parent == parent) or \
            (own_parent != b"" and own_parent not in self.cached_blocks)

    def _pop_free(self) -> int:
        while True:
            block = heapq.heappop(self._free_heap)
            self._in_heap[block] = 0
            if self._is_free(block):
                self._num_free -= 1
                return block

    def _push_free(self, block: int) -> None:
        self._num_free += 1
        if not self._in_heap[block]:
            self._in_heap[block] = 1
            heapq.heappush(self._free_heap, block)

    def truncate(self, block_table: list[int], num_tokens: int) -> None:
        """Shrink ``block_table`` in place to the blocks that ``num_tokens`` tokens need, the last block first."""
        keep = self.blocks_for(num_tokens)
        while len(block_table) > keep:
            self._release(block_table.pop())

    def free(self, block_table: list[int]) -> None:
        self.truncate(block_table, 0)

    def _release(self, block: int) -> None:
        """One table fewer holds ``block``; with none left it is cached if it holds a name, else free."""
        self.ref_counts[block] -= 1
        if self.ref_counts[block] > 0:
            return
        name = self.block_hashes[block]
        if name is not None and self.cached_blocks.get(name) == block:
            self.evictable[block] = None
        else:
            if name is not None:  # named, but another block holds that name
                self.block_hashes[block] = self.block_tokens[block] = None
            self._push_free(block)

    def _forget(self, block: int) -> None:
        """A cached block leaves the LRU and loses its name."""
        del self.evictable[block]
        del self.cached_blocks[self.block_hashes[block]]
        self.block_hashes[block] = self.block_tokens[block] = None

    # ---------------------------------------------------------------- the prefix cache
    def cached_prefix(self, token_ids: list[int]) -> list[int]:
        """The blocks that hold the K/V of the longest start of ``token_ids`` made of whole cached blocks, never
        the last token (its logits are needed, so it is always computed). Looks, changes nothing."""
        if not self.enable_prefix_caching:
            return []
        blocks: list[int] = []
        parent = b""
        size = self.block_size
        for start in range(0, len(token_ids) - size, size):  # blocks that end before the last token
            tokens = tuple(token_ids[start:start + size])
            parent = chain_hash(parent, tokens)
            block = self.cached_blocks.get(parent)
            if block is None or self.block_tokens[block] != tokens:
                break
            blocks.append(block)
        return blocks

    def can_allocate(self, prefix: list[int], num_tokens: int) -> bool:
        """Whether a new table can take the cached ``prefix`` and grow to ``num_tokens`` tokens."""
        taken_from_cache = sum(self.ref_counts[b] == 0 for b in prefix)
        return self.blocks_for(num_tokens) - len(prefix) + taken_from_cache <= self.num_free_blocks

    def allocate(self, block_table: list[int], prefix: list[int], num_queried_tokens: int, num_tokens: int) -> int:
        """Start the empty ``block_table`` with the cached ``prefix`` (from :meth:`cached_prefix` over
        ``num_queried_tokens`` tokens, just before) and grow it to ``num_tokens`` tokens; returns how many tokens
        the prefix holds (their K/V is computed). Counts the lookup in ``stats``."""
        if block_table:
            raise ValueError(f"allocate starts an empty block table, got one of {len(block_table)} blocks")
        if not self.can_allocate(prefix, num_tokens):
            raise OutOfBlocks(f"need {self.blocks_for(num_tokens)} blocks ({len(prefix)} cached), "
                              f"{self.num_free_blocks} free")
        if not (self.consecutive and prefix and self._copy_to_a_run(block_table, prefix, num_tokens)):
            for block in prefix:
                if self.ref_counts[block] == 0:
                    del self.evictable[block]
                self.ref_counts[block] += 1
                block_table.append(block)
        self.reserve(block_table, num_tokens)
        if self.enable_prefix_caching:
            self.stats.queries += num_queried_tokens
            self.stats.hits += len(prefix) * self.block_size
        return len(prefix) * self.block_size

    def _copy_to_a_run(self, block_table: list[int], prefix: list[int], num_tokens: int) -> bool:
        """With ``consecutive``: False where the blocks after ``prefix`` are free (shared in place, ``reserve`` grows
        into them); True after taking the lowest free run for all ``num_tokens`` tokens, the prefix's K/V to be
        copied there (``take_copies``); with no such run, False after forgetting the unheld cached blocks after the
        prefix, so that it grows in place."""
        needed = self.blocks_for(num_tokens)
        after = range(prefix[-1] + 1, prefix[0] + needed)
        in_order = prefix == list(range(prefix[0], prefix[-1] + 1)) and after.stop <= self.num_blocks
        if in_order and all(self._is_free(b) for b in after):
            return False
        start = 0
        for block in range(self.num_blocks):
            if not self._is_free(block):
                start = block + 1
            elif block + 1 - start == needed:
                run = list(range(start, start + needed))
                for cached in prefix:
                    if self.ref_counts[cached] == 0:
                        self.evictable.move_to_end(cached)  # used just now
                for taken in run:
                    self.ref_counts[taken] = 1
                self._num_free -= needed
                self._copies += zip(prefix, run)
                block_table += run
                return True
        if in_order and all(self.ref_counts[b] == 0 for b in after):
            for cached in after:
                if cached in self.evictable:
                    self._forget(cached)
                    self._push_free(cached)
        return False

    def take_copies(self) -> list[tuple[int, int]]:
        """The (cached block, block) pairs whose K/V must be copied before the next forward, handed over once."""
        copies, self._copies = self._copies, []
        return copies

    def cache_full_blocks(self, block_table: list[int], token_ids: list[int], num_computed: int) -> None:
        """Name the blocks of ``block_table`` that ``token_ids[:num_computed]`` fills (K/V computed and committed:
        never guesses), so that later tables can share them. Named blocks are always a start of a table: the walk
        goes back from the last full block to the first named one."""
        if not self.enable_prefix_caching:
            return
        size = self.block_size
        num_full = min(num_computed // size, len(block_table))
        first = num_full
        while first > 0 and self.block_hashes[block_table[first - 1]] is None:
            first -= 1
        parent = self.block_hashes[block_table[first - 1]] if first > 0 else b""
        for j in range(first, num_full):
            block, tokens = block_table[j], tuple(token_ids[j * size:(j + 1) * size])
            self.block_parents[block] = parent
            parent = chain_hash(parent, tokens)
            self.block_hashes[block], self.block_tokens[block] = parent, tokens
            self.cached_blocks.setdefault(parent, block)  # a name already held elsewhere stays there

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (they become free). Only when no table holds a block: returns whether it
        did."""
        if any(self.ref_counts):
            return False
        for block in list(self.evictable):
            self._forget(block)
            self._push_free(block)
        return True
