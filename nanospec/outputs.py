"""What generation returns, in vLLM's shape: a ``RequestOutput`` per prompt holding its ``n`` ``CompletionOutput`` s.

The engine, a stream and the server deal in ``CompletionOutput`` s (each completion is one sequence of the engine);
``LLM.generate`` and ``LLM.chat`` gather a prompt's completions into its ``RequestOutput``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """One emitted token's log-probability under the target (raw logits, before penalties and temperature), and
    the ``SamplingParams.logprobs`` most likely tokens at that position, most likely first."""
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob)


@dataclass
class CompletionOutput:
    """One completion (one sequence of the engine), finished or as it stands after a step."""
    request_id: int                 # the engine's id of this completion's sequence
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]            # generated tokens only
    finish_reason: str | None       # "stop" (eos, stop token or string), "length", "abort", "error"; None: running
    num_steps: int                  # target forward passes that produced tokens for it, prefill included
    num_draft_tokens: int = 0       # speculative tokens proposed for it
    num_accepted_tokens: int = 0    # of those, accepted by the target
    delta_text: str = ""            # text added by the step that produced this output (streaming)
    error: str | None = None        # what went wrong, when finish_reason is "error"
    logprobs: list[TokenLogprob] | None = None  # one per generated token, when SamplingParams.logprobs is set
    index: int = 0                  # which of the prompt's n completions this is
    num_cached_tokens: int = 0      # prompt tokens whose K/V came from the prefix cache (not computed)
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (None: the tokenizer's eos,
    #                                       or not "stop"; an eos id only the model's configs name is a stop token id)
    # with SamplingParams.prompt_logprobs: None for the first prompt token, then a TokenLogprob per prompt token
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the generated tokens' log-probabilities, when ``SamplingParams.logprobs`` asked for them."""
        return sum(t.logprob for t in self.logprobs) if self.logprobs is not None else None

    @property
    def tau(self) -> float:
        """Mean tokens produced per target step after prefill (1.0 without speculation)."""
        decode_steps = self.num_steps - 1
        return (len(self.token_ids) - 1) / decode_steps if decode_steps > 0 else float(len(self.token_ids) > 0)


@dataclass
class RequestOutput:
    """One prompt's outcome, as vLLM's: ``outputs`` holds its ``n`` completions in ``index`` order."""
    request_id: int                 # the engine's id of the first completion's sequence
    prompt: str | None              # the prompt's text (a chat's rendered conversation); None for token ids
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]

    @property
    def finished(self) -> bool:
        return all(out.finished for out in self.outputs)

    @property
    def prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        """With ``SamplingParams.prompt_logprobs``: None for the first prompt token, then each later prompt token's
        ``TokenLogprob`` (its log-probability after the tokens before it, and the likeliest there)."""
        return self.outputs[0].prompt_logprobs

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens whose K/V the first completion found in the prefix cache (later completions of the same
        prompt usually find all of it there)."""
        return self.outputs[0].num_cached_tokens
