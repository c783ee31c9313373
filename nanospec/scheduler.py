"""Continuous batching: which sequences run this step, with their KV blocks reserved.

Every step the running sequences come first (each needs slots for its uncached tokens plus the
speculative tokens it may verify); if the pool runs dry, the most recently admitted sequence is
preempted: its blocks are freed and it goes back to the front of the queue, to be recomputed
(prompt + output so far) when blocks free up. Then waiting sequences are admitted, oldest first,
while the token budget, ``max_num_seqs`` and the pool allow; a sequence is admitted with the cached
blocks that already hold the start of its tokens (the prefix cache, :mod:`nanospec.cache.block_manager`)
and computes only the rest. A request whose whole lifetime fits
the pool is checked at admission (``LLM`` does this), so a lone sequence never needs to preempt
itself and the loop never hangs.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from nanospec.cache.block_manager import BlockManager
from nanospec.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 num_lookahead_slots: Callable[[Sequence], int] = lambda seq: 0,
                 on_preempt: Callable[[Sequence], None] = lambda seq: None):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.num_lookahead_slots = num_lookahead_slots
        self.on_preempt = on_preempt
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Sequence]:
        bm = self.block_manager
        scheduled: list[Sequence] = []
        budget = self.max_num_batched_tokens
        queue = list(self.running)
        while queue:
            seq = queue.pop(0)
            need = seq.num_tokens + self.num_lookahead_slots(seq)
            while not bm.can_reserve(seq.block_table, need) and queue:
                self._preempt(queue.pop())
            if not bm.can_reserve(seq.block_table, need):
                self._preempt(seq)
                continue
            bm.reserve(seq.block_table, need)
            budget -= seq.num_tokens - seq.num_cached_tokens + self.num_lookahead_slots(seq)
            scheduled.append(seq)
        self.running = list(scheduled)

        while self.waiting and len(scheduled) < self.max_num_seqs:
            seq = self.waiting[0]
            prefix = bm.cached_prefix(seq.token_ids)
            seq.num_cached_tokens = len(prefix) * bm.block_size
            # a one-token prompt guesses at once (Speculator.num_lookahead_slots)
            num_new = seq.num_tokens - seq.num_cached_tokens + self.num_lookahead_slots(seq)
            need = seq.num_tokens + self.num_lookahead_slots(seq)
            if (num_new > budget and scheduled) or not bm.can_allocate(prefix, need):
                seq.num_cached_tokens = 0
                break
            bm.allocate(seq.block_table, prefix, seq.num_tokens, need)
            if seq.num_prefix_cached_tokens is None:
                seq.num_prefix_cached_tokens = seq.num_cached_tokens
            budget -= num_new
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(seq)
        return scheduled

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq.block_table)
        seq.num_cached_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.on_preempt(seq)
        if seq in self.running:
            self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark ``seq`` finished and return all its blocks to the pool."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.free(seq.block_table)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
