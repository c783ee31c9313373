"""Streaming text: token ids become text as they arrive. `TextStream` ends a request at a stop string (the text stops
just before it, or just after it with ``include_stop``; the tokens end with the one that completed it) and holds back
any tail that could still grow into one, so the streamed deltas add up to the final text."""

from __future__ import annotations

from collections.abc import Sequence

from nanospec.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"  # what a decoder writes for bytes that are not (yet) a whole UTF-8 character
MAX_UNFINISHED_TOKENS = 3  # the tokens an unfinished character can span: at most 3 of its (at most 4) bytes


class IncrementalDetokenizer:
    """Text deltas of a growing id list (vLLM's and TGI's prefix / read offsets); a delta ending in U+FFFD waits for the
    rest of its character. The prompt's last tokens are read as output would be, from a window that does not begin
    inside a character: a prompt that ends inside one leaves it unread, for the output token that completes it (as
    vLLM's ``DecodeStream``)."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None, context_tokens: int = 5,
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        prompt = list(prompt_ids or [])
        start = self._window_start(prompt, context_tokens)
        self.token_ids = prompt[:start]
        self.prefix_offset = self.read_offset = start
        self.text = ""
        for token in prompt[start:]:
            self.add([token])
        self.text = ""  # (the prompt's own)

    def _window_start(self, prompt: list[int], context_tokens: int) -> int:
        """Where to start reading the prompt: about ``context_tokens`` before its end, where a character begins: the
        text from there to one of the last tokens decodes whole (a byte-fallback decoder turns a whole run of bytes
        that begins or ends inside a character into U+FFFDs). Failing that (a prompt with U+FFFD in its text), the
        plain window."""
        latest = max(len(prompt) - context_tokens, 0)
        for start in range(latest, max(latest - MAX_UNFINISHED_TOKENS, 0) - 1, -1):
            for end in range(len(prompt), max(len(prompt) - MAX_UNFINISHED_TOKENS, start + 1) - 1, -1):
                if REPLACEMENT_CHAR not in self.tokenizer.decode(prompt[start:end], self.skip_special_tokens):
                    return start
        return latest

    def add(self, token_ids: Sequence[int], final: bool = False) -> str:
        """Append `token_ids`; return the text they complete (possibly empty), or with ``final`` all the text held
        back."""
        self.token_ids.extend(token_ids)
        skip = self.skip_special_tokens
        prefix_text = self.tokenizer.decode(self.token_ids[self.prefix_offset:self.read_offset], skip)
        new_text = self.tokenizer.decode(self.token_ids[self.prefix_offset:], skip)
        if not final and (len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR)):
            return ""
        delta = new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a sequence: return held-back text (an unfinished character decodes as U+FFFD)."""
        return self.add([], final=True)


class TextStream:
    """One request's output text, fed a token at a time; with ``detokenize`` False it stays empty (nothing is
    decoded, no stop string is found)."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], stop: list[str], include_stop: bool = False,
                 skip_special_tokens: bool = True, detokenize: bool = True):
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens) \
            if detokenize else None
        self.stop = stop
        self.include_stop = include_stop
        self.matched_stop: str | None = None  # the stop string that ended the text
        self.text = ""
        self.num_streamed = 0  # characters of ``text`` already handed out

    def add(self, token_id: int, check_stop: bool = True) -> bool:
        """Append one token's text; True if a stop string now ends in it (the text then ends just before the stop
        string). With ``check_stop`` False (up to ``min_tokens``) stop strings are not looked for: a stop string
        counts only if it ends in the text of a token added with ``check_stop``."""
        return self.detokenizer is not None and self._extend(self.detokenizer.add([token_id]), check_stop)

    def finish(self, check_stop: bool = True) -> bool:
        """At the end of the request: release text held back for an unfinished character; True if that
        completes a stop string."""
        return self.detokenizer is not None and self._extend(self.detokenizer.flush(), check_stop)

    def _extend(self, delta: str, check_stop: bool) -> bool:
        previous = len(self.text)
        self.text += delta
        if not check_stop:
            return False
        # a stop string may straddle the previous text: search from just before the delta; the earliest wins
        found = [(i, stop) for stop in self.stop if (i := self.text.find(stop, max(0, previous - len(stop) + 1))) >= 0]
        if found:
            end, self.matched_stop = min(found, key=lambda hit: hit[0])
            self.text = self.text[:end + len(self.matched_stop) * self.include_stop]
        return bool(found)

    def take_delta(self, finished: bool) -> str:
        """The text not streamed yet, less (while the request runs) a tail that could start a stop string."""
        streamable = len(self.text) if finished else len(self.text) - _stop_prefix_len(self.text, self.stop)
        delta = self.text[self.num_streamed:streamable]
        self.num_streamed = max(self.num_streamed, streamable)
        return delta


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest end of ``text`` that is the beginning of a stop string (held back)."""
    return max((n for stop in stops for n in range(1, min(len(stop) - 1, len(text)) + 1) if text.endswith(stop[:n])),
               default=0)
