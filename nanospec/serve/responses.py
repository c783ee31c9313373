"""OpenAI's response shapes, built from nanospec's ``CompletionOutput`` s: completions, chat completions, their
stream chunks (server-sent events), log-probabilities, usage and errors."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import replace

from nanospec.outputs import CompletionOutput, TokenLogprob
from nanospec.tokenizer import Tokenizer


# characters JSON keeps as they are that str.splitlines (httpx's iter_lines, so many SSE clients) ends a line at
_LINE_BREAKS = str.maketrans({c: f"\\u{ord(c):04x}" for c in "\x85\u2028\u2029"})


def sse(payload: dict | str) -> str:
    """One server-sent event: ``data: <json>`` and a blank line (``data: [DONE]`` ends a stream); the JSON is one
    line to any client (the characters str.splitlines breaks at are escaped)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False).translate(_LINE_BREAKS)
    return f"data: {data}\n\n"


def error_body(status: int, message: str, error_type: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": status}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Formatter:
    """Builds one HTTP request's responses: its id, creation time and model name are fixed at construction."""

    def __init__(self, tokenizer: Tokenizer, model: str, chat: bool, token_ids: bool = False,
                 echo: list[str] | None = None, n: int = 1, echo_only: bool = False):
        self.tokenizer = tokenizer
        self.model = model
        self.chat = chat
        self.token_ids = token_ids  # add each choice's token ids (vLLM's return_token_ids)
        self.echo = echo  # completions' echo: each prompt's text (choice i * n + c is prompt i's)
        self.n = n
        self.echo_only = echo_only  # echo with max_tokens 0: what is made is not shown
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"  # unique, as vLLM's
        self.created = int(time.time())

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def shown(self, out: CompletionOutput) -> CompletionOutput:
        """What a choice shows of an output: all of it, or with ``echo_only`` none of what was made (a finish by stop
        or length is "length": max_tokens 0 was reached)."""
        if not self.echo_only:
            return out
        finish_reason = "length" if out.finish_reason in ("stop", "length") else out.finish_reason
        return replace(out, text="", delta_text="", token_ids=[], logprobs=None if out.logprobs is None else [],
                       finish_reason=finish_reason, stop_reason=None)

    # ---------------------------------------------------------------- log-probabilities
    def echo_of(self, out: CompletionOutput, index: int) -> tuple[str, list[int], list] | None:
        """What choice ``index`` echoes: (its prompt's text, token ids, ``prompt_logprobs``), or None."""
        if self.echo is None:
            return None
        return self.echo[index // self.n], out.prompt_token_ids, out.prompt_logprobs

    def logprobs(self, entries: list[TokenLogprob] | None, text_offset: int = 0,
                 echo: tuple[str, list[int], list] | None = None) -> dict | None:
        """Completions: parallel lists (with ``echo``, the prompt's first: its first token's log-probability is
        null); chat: a list of {token, logprob, bytes, top_logprobs}."""
        if entries is None:
            return None
        if self.chat:
            def item(token_id, logprob):
                token = self._token(token_id)
                return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

            return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, v) for t, v in e.top]}
                                for e in entries]}
        token_ids = [e.token_id for e in entries]
        if echo is not None:  # the prompt first: its first entry is None (no log-probability), so its ids come apart
            _, prompt_ids, prompt_logprobs = echo
            token_ids, entries = prompt_ids + token_ids, prompt_logprobs + entries
        values = [e.logprob if e else None for e in entries]
        tops = [{self._token(t): v for t, v in e.top} if e else None for e in entries]
        tokens = [self._token(t) for t in token_ids]
        offsets = []
        for token in tokens:
            offsets.append(text_offset)
            text_offset += len(token)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    # ---------------------------------------------------------------- whole responses
    def response(self, outputs: list[CompletionOutput], prompt_tokens: int) -> dict:
        """The non-streaming response; ``outputs[i]`` is choice ``i``."""
        outputs = [self.shown(out) for out in outputs]
        choices = []
        for index, out in enumerate(outputs):
            echo = self.echo_of(out, index)
            logprobs = self.logprobs(out.logprobs, echo=echo)
            if self.chat:
                choices.append({"index": index, "message": {"role": "assistant", "content": out.text},
                                "logprobs": logprobs, "finish_reason": out.finish_reason})
            else:
                choices.append({"index": index, "text": (echo[0] if echo else "") + out.text, "logprobs": logprobs,
                                "finish_reason": out.finish_reason})
            choices[-1]["stop_reason"] = out.stop_reason  # vLLM's: the stop string or token id that ended it
            if self.token_ids:
                choices[-1].update(prompt_token_ids=out.prompt_token_ids, token_ids=out.token_ids)
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices,
                "usage": usage(prompt_tokens, sum(len(o.token_ids) for o in outputs))}

    # ---------------------------------------------------------------- stream chunks
    def chunk(self, choices: list[dict], stream_usage: str | None, usage_: dict, last: bool = False) -> dict:
        """A stream chunk; with ``stream_usage`` (``SamplingFields.stream_usage``) its ``usage``: ``usage_`` where
        that chunk carries it, else null."""
        body = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices}
        if stream_usage is not None:
            body["usage"] = usage_ if last or stream_usage == "every" else None
        return body

    def role_choice(self, index: int) -> dict:
        """Chat streams open each choice with the assistant's role (OpenAI does)."""
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None, "stop_reason": None}

    def delta_choice(self, index: int, text: str, new_tokens: list[int], new_logprobs: list[TokenLogprob] | None,
                     text_offset: int, reason: str | None, stop_reason: str | int | None = None,
                     echo: tuple[str, list[int], list] | None = None) -> dict:
        """One choice's chunk; ``echo`` (a completion's first chunk) puts the prompt first."""
        logprobs = self.logprobs(new_logprobs, text_offset, echo)
        text = (echo[0] if echo else "") + text
        if self.chat:
            choice = {"index": index, "delta": {"content": text} if text or reason is None else {},
                      "logprobs": logprobs, "finish_reason": reason, "stop_reason": stop_reason}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason,
                      "stop_reason": stop_reason}
        if self.token_ids:
            choice["token_ids"] = new_tokens
        return choice
