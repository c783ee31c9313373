"""The request bodies the server accepts (OpenAI's fields plus vLLM's sampling extras), checked by pydantic.

Types are strict (``"1"`` is not a number, ``true`` is not an int, an int is a float), ``null`` leaves a field out
(its default applies; a message's field too), unknown fields are refused (a field the server would otherwise ignore,
say ``tools``, is an error that names it), and each sampling field ends up in a :class:`nanospec.SamplingParams`,
whose own checks run too. Every failure becomes an HTTP 400 whose ``param`` names the field.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, field_validator, model_validator

from nanospec.sampling_params import MAX_LOGPROBS, MAX_N, SamplingParams

Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]  # (strict floats take ints: 1 is a fine temperature)
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict()]
TokenIds = list[Annotated[int, Strict(), Field(ge=0)]]


def _without_nulls(data: Any) -> Any:
    """A field given as ``null`` is a field left out (OpenAI's optional fields are nullable: its clients send
    ``"temperature": null`` for "the default", and ``"tool_calls": null`` in an assistant's message)."""
    return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


# checked by nanospec.chat_messages, as LLM.chat checks them, once each message's nulls are left out
Messages = Annotated[Any, BeforeValidator(lambda m: [_without_nulls(x) for x in m] if isinstance(m, list) else m)]


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_left_out(cls, data: Any) -> Any:
        return _without_nulls(data)


class StreamOptions(Body):
    include_usage: Bool = False
    continuous_usage_stats: Bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


class SamplingFields(Body):
    """What both completion endpoints share. ``max_tokens`` None: the endpoint's default (see there)."""
    model: Str | None = None
    max_tokens: Int | None = Field(None, ge=1)
    temperature: Float = Field(1.0, ge=0)
    top_p: Float = Field(1.0, gt=0, le=1)
    top_k: Int = Field(-1, ge=-1)  # vLLM's: -1 or 0 keep every token
    min_p: Float = Field(0.0, ge=0, le=1)  # vLLM's
    n: Int = Field(1, ge=1, le=MAX_N)
    stream: Bool = False
    stream_options: StreamOptions | None = None
    stop: Str | list[Str] | None = None
    stop_token_ids: TokenIds | None = None
    seed: Int | None = None
    presence_penalty: Float = Field(0.0, ge=-2, le=2)
    frequency_penalty: Float = Field(0.0, ge=-2, le=2)
    repetition_penalty: Float = Field(1.0, gt=0)
    logit_bias: dict[Str, Float] | None = None  # OpenAI's: token id (as a string) -> bias in [-100, 100]
    min_tokens: Int = Field(0, ge=0)
    ignore_eos: Bool = False
    include_stop_str_in_output: Bool = False  # vLLM's
    skip_special_tokens: Bool = True  # vLLM's
    allowed_token_ids: TokenIds | None = None  # vLLM's
    bad_words: list[Str] | None = None  # vLLM's
    user: Str | None = None  # accepted, unused
    return_token_ids: Bool = False  # vLLM's: each choice also carries its token ids (a chunk: the new ones)

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, options: StreamOptions, info) -> StreamOptions:
        """As vLLM: stream_options (not null) needs ``stream: true``."""
        if info.data.get("stream") is False:
            raise ValueError("stream_options can only be given with stream: true")
        return options

    def sampling_params(self, max_tokens: int, logprobs: int | None, defaults: dict | None = None) -> SamplingParams:
        """Every sampling field the request gives, and for those it leaves out ``defaults`` (the model's, see
        nanospec.model.generation_config) or else the API's. Raises ValueError (naming the field) for combinations
        pydantic cannot see, e.g. min_tokens > max_tokens."""
        defaults = defaults or {}

        def field(name: str):
            return getattr(self, name) if name in self.model_fields_set or name not in defaults else defaults[name]

        top_k = field("top_k")
        return SamplingParams(
            temperature=field("temperature"), top_p=field("top_p"), top_k=top_k,
            min_p=field("min_p"), max_tokens=max_tokens, min_tokens=self.min_tokens, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output, skip_special_tokens=self.skip_special_tokens,
            n=self.n, logprobs=logprobs,
            presence_penalty=field("presence_penalty"), frequency_penalty=field("frequency_penalty"),
            repetition_penalty=field("repetition_penalty"),
            logit_bias=None if self.logit_bias is None else {_token_id(k): b for k, b in self.logit_bias.items()},
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words)

    @property
    def stream_usage(self) -> str | None:
        """Which stream chunks carry the usage: None (none), "last" (include_usage: a last chunk of its own) or
        "every" (continuous_usage_stats too: every chunk its choice's usage so far, and the last chunk)."""
        options = self.stream_options
        if options is None or not options.include_usage:
            return None
        return "every" if options.continuous_usage_stats else "last"


def _token_id(key: str) -> int:
    """A logit_bias key as a token id: at most 20 ASCII digits (no vocabulary's ids are longer; int() refuses a
    string of over 4300)."""
    if not (key.isascii() and key.isdigit() and len(key) <= 20):
        shown = repr(key) if len(key) <= 40 else f"{key[:40]!r}... ({len(key)} characters)"
        raise ValueError(f"logit_bias: {shown} is not a token id (the keys are token ids as strings, e.g. \"50256\")")
    return int(key)


class CompletionRequest(SamplingFields):
    """``/v1/completions``: one prompt (text or token ids) or a list of them; ``max_tokens`` defaults to 16. ``echo``:
    each choice's text starts with its prompt, and with ``logprobs`` so do its log-probabilities (the first prompt
    token's is null); with ``max_tokens`` 0 (OpenAI's and vLLM's) that is all it holds. ``add_special_tokens``
    (vLLM's): a text prompt gets the tokenizer's special tokens (BOS where it adds one)."""
    prompt: Str | list[Str] | TokenIds | list[TokenIds]
    max_tokens: Int | None = Field(None, ge=0)  # 0: with echo only (the server checks)
    logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: Bool = False
    add_special_tokens: Bool = True

    def prompts(self) -> list[str | list[int]]:
        """Each prompt: a string or a list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        return list(prompt)


class ChatCompletionRequest(SamplingFields):
    """``/v1/chat/completions``: ``max_tokens`` (or ``max_completion_tokens``) defaults to what the context (or a
    smaller KV pool) leaves after the prompt; ``logprobs`` is a bool and ``top_logprobs`` the count, as OpenAI has them;
    ``add_special_tokens`` (vLLM's): the rendered chat gets the tokenizer's special tokens too (the template writes
    its own)."""
    messages: Messages = None
    add_special_tokens: Bool = False
    add_generation_prompt: Bool = True  # vLLM's: open the assistant's turn
    continue_final_message: Bool = False  # vLLM's: go on with the last message (add_generation_prompt false)
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: Bool = False
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(Body):
    """``/tokenize``: the ids the completion endpoints would feed for ``prompt``, or for ``messages`` rendered
    with the chat template (and the assistant's turn opened). ``add_special_tokens`` (vLLM's): whether the text gets
    the tokenizer's special tokens (BOS where it adds one); left out, a prompt does and rendered messages do not."""
    model: Str | None = None
    prompt: Str | None = None
    messages: Messages = None
    add_special_tokens: Bool | None = None


class DetokenizeRequest(Body):
    model: Str | None = None
    tokens: TokenIds
