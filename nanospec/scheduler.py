"""Continuous batching: which sequences run this step, with their KV blocks reserved.

Running sequences come first, each with slots for its uncached tokens plus the guesses it may verify; when the pool
runs dry the most recently admitted is preempted (its blocks freed, back to the front of the queue, recomputed
later). Then waiting sequences are admitted oldest first, with the cached blocks that already hold the start of
their tokens (the prefix cache), while the token budget, ``max_num_seqs`` and the pool allow. A request is admitted
only if its whole lifetime fits the pool (``Engine.validate_prompt``), so a lone sequence never preempts itself.
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
            lookahead = self.num_lookahead_slots(seq)
            while not bm.can_reserve(seq.block_table, seq.num_tokens + lookahead) and queue:
                self._preempt(queue.pop())
            if not bm.can_reserve(seq.block_table, seq.num_tokens + lookahead):
                self._preempt(seq)
                continue
            bm.reserve(seq.block_table, seq.num_tokens + lookahead)
            budget -= seq.num_tokens - seq.num_cached_tokens + lookahead
            scheduled.append(seq)
        self.running = list(scheduled)

        while self.waiting and len(scheduled) < self.max_num_seqs:
            seq = self.waiting[0]
            prefix = [] if seq.needs_prompt_logprobs else bm.cached_prefix(seq.token_ids)  # every row is computed
            seq.num_cached_tokens = len(prefix) * bm.block_size
            lookahead = self.num_lookahead_slots(seq)  # a one-token prompt guesses at once
            num_new = seq.num_tokens - seq.num_cached_tokens + lookahead
            if (num_new > budget and scheduled) or not bm.can_allocate(prefix, seq.num_tokens + lookahead):
                seq.num_cached_tokens = 0
                break
            bm.allocate(seq.block_table, prefix, seq.num_tokens, seq.num_tokens + lookahead)
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
        self.on_preempt(seq)  # (schedule() then sets the running list without it)
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
