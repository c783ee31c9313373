"""Continuous batching: which sequences run this step, with their KV blocks reserved.

Running sequences come first, each with slots for its uncached tokens plus the guesses it may verify; when the pool
runs dry the most recently admitted is preempted (its blocks freed, back to the front of the queue, recomputed
later). Then waiting sequences are admitted oldest first, with the cached blocks that already hold the start of
their tokens (the prefix cache), while the token budget (``max_num_batched_tokens``), ``max_num_seqs`` and the pool
allow. A request is admitted only if its whole lifetime fits the pool (``Engine.validate_prompt``), so a lone
sequence never preempts itself.

**Chunked prefill** (``enable_chunked_prefill``, as vLLM's): decoding sequences take the budget first, every step;
a prompt longer than what is left of it is computed a chunk a step (``Sequence.num_scheduled_tokens``), so a long
prompt neither waits for the running sequences to end nor stalls their decoding. Without it a prompt runs whole,
alone in its step when it exceeds the budget. A request that asks for ``prompt_logprobs`` always runs whole.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from nanospec.cache.block_manager import BlockManager
from nanospec.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 num_lookahead_slots: Callable[[Sequence], int] = lambda seq: 0,
                 on_preempt: Callable[[Sequence], None] = lambda seq: None, enable_chunked_prefill: bool = True):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.num_lookahead_slots = num_lookahead_slots
        self.on_preempt = on_preempt
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Sequence]:
        """The step's sequences, each with ``num_scheduled_tokens`` set and its KV slots reserved."""
        bm = self.block_manager
        scheduled: list[Sequence] = []
        prefilling: list[Sequence] = []  # running, amid a chunked prefill: they take what decoding leaves
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
            if seq.num_tokens - seq.num_cached_tokens > 1:
                prefilling.append(seq)
                continue
            seq.num_scheduled_tokens = 1
            budget -= 1 + lookahead
            scheduled.append(seq)
        for seq in prefilling:
            seq.num_scheduled_tokens = min(seq.num_tokens - seq.num_cached_tokens, budget)
            if seq.num_scheduled_tokens > 0:
                budget -= seq.num_scheduled_tokens
                scheduled.append(seq)
        self.running = [seq for seq in self.running if seq.status is SequenceStatus.RUNNING]

        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            prefix = [] if seq.needs_prompt_logprobs else bm.cached_prefix(seq.token_ids)  # every row is computed
            seq.num_cached_tokens = len(prefix) * bm.block_size
            lookahead = self.num_lookahead_slots(seq)  # a one-token prompt guesses at once
            uncached = seq.num_tokens - seq.num_cached_tokens
            num_new = uncached + lookahead
            if num_new > budget > 0 and lookahead == 0 and self.enable_chunked_prefill \
                    and not seq.needs_prompt_logprobs:
                num_new = budget  # its first chunk
            if (num_new > budget and scheduled) or not bm.can_allocate(prefix, seq.num_tokens + lookahead):
                seq.num_cached_tokens = 0
                break
            bm.allocate(seq.block_table, prefix, seq.num_tokens, seq.num_tokens + lookahead)
            if seq.num_prefix_cached_tokens is None:
                seq.num_prefix_cached_tokens = seq.num_cached_tokens
            seq.num_scheduled_tokens = num_new - lookahead
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
