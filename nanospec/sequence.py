"""One request as the engine sees it: its tokens, its KV blocks, its progress."""

from __future__ import annotations

import enum
from typing import Any

from nanospec.detokenizer import TextStream
from nanospec.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Tokens ``token_ids`` = prompt + output. The target's K/V exists for the first
    ``num_cached_tokens`` of them; the next forward computes the next ``num_scheduled_tokens`` of
    ``token_ids[num_cached_tokens:]`` (None: all of them): the whole prompt on prefill, or a chunk of it
    (chunked prefill: no token is drawn until the chunk that ends it), the last token on decode,
    everything again after preemption."""

    def __init__(self, seq_id: int, prompt_token_ids: list[int], params: SamplingParams, seed: int,
                 text_stream: TextStream, stop_token_ids: list[int]):
        self.seq_id = seq_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.seed = seed  # an int64: the counters of nanospec.kernels.random take 64 bits
        self.stop_token_ids = stop_token_ids  # the tokens that end it: eos (unless ignored) and params.stop_token_ids
        self.bad_words_token_ids: list[list[int]] = []  # params.bad_words as token ids (sampling.penalties)
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_cached_tokens = 0
        self.num_scheduled_tokens: int | None = None  # set by the scheduler for the step
        self.num_prefix_cached_tokens: int | None = None  # tokens the prefix cache held at its first admission
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None  # the stop string or stop token id that ended it
        self.error: str | None = None  # why it failed, when finish_reason is "error"
        self.text_stream = text_stream  # the output text, stop strings, what is streamed
        self.num_steps = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.logprobs: list | None = [] if params.logprobs is not None else None  # a TokenLogprob per output token
        self.prompt_logprobs: list | None = None  # once computed: None, then a TokenLogprob per later prompt token
        self.spec_state: Any = None  # owned by the proposer (n-gram index, draft KV, acceptance estimate, ...)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Its next step must compute every prompt row's logits (``SamplingParams.prompt_logprobs``)."""
        return self.params.prompt_logprobs is not None and self.prompt_logprobs is None

    @property
    def num_new_tokens(self) -> int:
        """The tokens the step computes (its own, not the guesses it feeds)."""
        uncached = self.num_tokens - self.num_cached_tokens
        return uncached if self.num_scheduled_tokens is None else min(self.num_scheduled_tokens, uncached)

    @property
    def is_prefill_chunk(self) -> bool:
        """The step computes a chunk of its uncached tokens that stops short of the last: it draws no token."""
        return self.num_cached_tokens + self.num_new_tokens < self.num_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def text(self) -> str:
        return self.text_stream.text

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
