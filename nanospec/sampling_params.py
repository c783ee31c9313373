"""How to sample one request; every field is checked for type and range on construction, so bad values fail
before any work (a bool is not a number, a string is not a number)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace


MAX_N = 128  # completions per prompt
MAX_LOGPROBS = 20  # most likely tokens reported per emitted token (OpenAI's top_logprobs limit)
FLOAT32_MAX = 3.4028234663852886e38  # the sampler holds temperature and repetition_penalty as float32


@dataclass
class SamplingParams:
    """Sampling settings of one request, vLLM's names and meanings (docs/sampling.md). ``temperature`` 0 is greedy;
    ``max_tokens`` None generates until the context ends; ``min_p`` keeps the tokens at least ``min_p`` times as
    likely as the likeliest (0: off); ``top_k`` -1 or 0 (or at least the vocabulary) keeps every token; ``stop``
    strings end the text before them (after them with ``include_stop_str_in_output``); ``skip_special_tokens`` leaves
    special tokens out of the text; ``stop_token_ids`` end it like eos (the token is kept, its text only with
    ``include_stop_str_in_output``); ``min_tokens`` holds eos, stop tokens and stop strings off (a stop string counts
    once it ends past the text of the first ``min_tokens`` tokens); ``speculate`` False opts out of speculation;
    ``n`` completions, choice ``i`` seeded ``seed + i``; ``logprobs`` k reports the target's raw log-probabilities of
    each token and its k likeliest, ``prompt_logprobs`` k the same for each prompt token after the first (its prefill
    then skips the prefix cache); ``allowed_token_ids`` keeps only those tokens; ``bad_words`` are never completed
    (each word's last token is banned where the output ends with the rest of it); ``logit_bias`` {token id: b} adds b
    (in [-100, 100]) to that token's logit; these and the penalties as vLLM's, before temperature
    (:mod:`nanospec.sampling.penalties`); ``detokenize`` False leaves ``text`` empty (the token ids only; no ``stop``
    strings then, as vLLM)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    speculate: bool = True
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    detokenize: bool = True
    stop_list: list[str] = field(init=False, repr=False)

    def __post_init__(self):
        if not _is_number(self.temperature) or not 0 <= self.temperature <= FLOAT32_MAX:
            raise ValueError(f"temperature must be a number in [0, {FLOAT32_MAX:.4g}] (float32's range), "
                             f"got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or an integer >= 1, got {self.top_k!r}")
        self.top_k = -1 if self.top_k == 0 else self.top_k
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1 (or None: to the context's end), "
                             f"got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0 or (self.max_tokens is not None
                                                                   and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        stop = [self.stop] if isinstance(self.stop, str) else [] if self.stop is None else self.stop
        if not isinstance(stop, (list, tuple)) or any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        self.stop_list = list(stop)
        ids = self.stop_token_ids if self.stop_token_ids is not None else []
        if not isinstance(ids, (list, tuple)) or any(not _is_int(t) or t < 0 for t in ids):
            raise ValueError(f"stop_token_ids must be a list of token ids (ints >= 0), got {self.stop_token_ids!r}")
        self.stop_token_ids = list(ids)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "speculate", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.stop_list and not self.detokenize:
            raise ValueError(f"stop strings are matched in the text, so they need detokenize=True; got "
                             f"stop={self.stop!r} with detokenize=False")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be None or an integer in [0, {MAX_LOGPROBS}], "
                             f"got {self.prompt_logprobs!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= FLOAT32_MAX:
            raise ValueError(f"repetition_penalty must be a number in (0, {FLOAT32_MAX:.4g}] (float32's range), "
                             f"got {self.repetition_penalty!r}")
        bias = self.logit_bias if self.logit_bias is not None else {}
        if not isinstance(bias, dict) or any(not _is_int(t) or t < 0 or not _is_number(b) or not -100 <= b <= 100
                                             for t, b in bias.items()):
            raise ValueError(f"logit_bias must be a dict of token id (int >= 0) to a number in [-100, 100], "
                             f"got {self.logit_bias!r}")
        self.logit_bias = dict(bias) or None
        allowed = self.allowed_token_ids
        if allowed is not None and (not isinstance(allowed, (list, tuple)) or not allowed
                                    or any(not _is_int(t) or t < 0 for t in allowed)):
            raise ValueError(f"allowed_token_ids must be None or a non-empty list of token ids (ints >= 0), "
                             f"got {allowed!r}")
        self.allowed_token_ids = list(allowed) if allowed is not None else None
        bad = self.bad_words
        if bad is not None and (not isinstance(bad, (list, tuple)) or any(not isinstance(w, str) or not w.strip()
                                                                         for w in bad)):
            raise ValueError(f"bad_words must be None or a list of words (non-blank strings), got {bad!r}")
        self.bad_words = list(bad or ()) or None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def for_choice(self, index: int) -> SamplingParams:
        """The parameters of choice ``index`` of ``n``: one completion, seeded ``seed + index`` (vLLM's rule)."""
        seed = self.seed + index if self.seed is not None else None
        return replace(self, n=1, seed=seed)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
