"""What a finished (or streaming) request returns."""

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
class RequestOutput:
    request_id: int
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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def tau(self) -> float:
        """Mean tokens produced per target step after prefill (1.0 without speculation)."""
        decode_steps = self.num_steps - 1
        return (len(self.token_ids) - 1) / decode_steps if decode_steps > 0 else float(len(self.token_ids) > 0)
