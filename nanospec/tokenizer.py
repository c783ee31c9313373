"""Text <-> token ids over Hugging Face `tokenizers`, and the chat template: the ids, text and template of transformers'
fast tokenizer."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from nanospec.chat_messages import check_messages


class Tokenizer:
    """A `tokenizers.Tokenizer` and its tokenizer_config.json; `extra_eos_token_ids` also end generation."""

    def __init__(self, backend: tokenizers.Tokenizer, config: Mapping | None = None,
                 extra_eos_token_ids: Sequence[int] = ()):
        self.backend = backend
        self.config = dict(config or {})
        self.bos_token = _token_content(self.config.get("bos_token"))
        self.eos_token = _token_content(self.config.get("eos_token"))
        self.bos_token_id = backend.token_to_id(self.bos_token) if self.bos_token is not None else None
        add_bos = self.config.get("add_bos_token")
        if add_bos is None:  # as the post-processor does
            add_bos = self.bos_token_id is not None and \
                backend.encode("", add_special_tokens=True).ids[:1] == [self.bos_token_id]
        self.add_bos_token = bool(add_bos)
        eos_ids = [backend.token_to_id(self.eos_token)] if self.eos_token is not None else []
        self.eos_token_ids = list(dict.fromkeys(i for i in [*eos_ids, *extra_eos_token_ids] if i is not None))
        self.chat_template = _pick_chat_template(self.config.get("chat_template"))
        self._compiled_template = None

    @classmethod
    def from_file(cls, tokenizer_json: str | os.PathLike, tokenizer_config: Mapping | None = None,
                  extra_eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        return cls(tokenizers.Tokenizer.from_file(str(tokenizer_json)), tokenizer_config, extra_eos_token_ids)

    @classmethod
    def from_json_str(cls, tokenizer_json: str, tokenizer_config: Mapping | None = None,
                      extra_eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        return cls(tokenizers.Tokenizer.from_str(tokenizer_json), tokenizer_config, extra_eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text` (special tokens written in it become their ids), BOS in front when the config asks."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping], add_generation_prompt: bool = True,
                            continue_final_message: bool = False) -> str:
        """Render a conversation ([{"role": ..., "content": ...}, ...]) to the prompt text, as transformers does; the
        messages are checked and read as :func:`~nanospec.chat_messages.check_messages` does for every front.
        ``continue_final_message``: the text ends with the last message's content, left open for the model to go on
        (what follows it in the rendering, e.g. the end-of-turn token, is cut), instead of opening a new turn."""
        for name, value in (("add_generation_prompt", add_generation_prompt),
                            ("continue_final_message", continue_final_message)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}")
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message continues the last message and add_generation_prompt opens a "
                             "new one: set add_generation_prompt=False")
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template (tokenizer_config.json has no 'chat_template')")
        messages = check_messages(messages)
        if self._compiled_template is None:
            self._compiled_template = _compile_chat_template(self.chat_template)
        special_tokens = {name: _token_content(self.config.get(name))
                          for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
        final = messages[-1]["content"]
        if continue_final_message:  # a mark after the last message's content shows where to cut
            messages = messages[:-1] + [{**messages[-1], "content": final + _CONTINUE_MARK}]
        text = self._compiled_template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                              **special_tokens)
        return _cut_at_mark(text, final) if continue_final_message else text

    def save(self, directory: str | os.PathLike) -> None:
        """Write tokenizer.json and tokenizer_config.json (what transformers' AutoTokenizer reads)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(directory / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False, **self.config,
                  "bos_token": self.bos_token, "eos_token": self.eos_token, "add_bos_token": self.add_bos_token}
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _token_content(token) -> str | None:
    """tokenizer_config.json writes a special token as a string or as {"content": ..., ...}."""
    return token.get("content") if isinstance(token, Mapping) else token


def _pick_chat_template(template) -> str | None:
    """Older configs hold a list of named templates; the one named "default" is the chat template."""
    if isinstance(template, list):
        return {entry["name"]: entry["template"] for entry in template}.get("default")
    return template


def _compile_chat_template(template: str) -> jinja2.Template:
    """Compile like transformers: sandboxed, trim_blocks + lstrip_blocks, its helpers and a `tojson` that keeps
    non-ASCII text and does not escape HTML."""

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return env.from_string(template)


_CONTINUE_MARK = "CONTINUE_FINAL_MESSAGE_MARK "


def _cut_at_mark(text: str, final: str) -> str:
    """``text`` up to the mark that follows the last message's content ``final`` (transformers' rule: where the
    template kept the mark's trailing space, it kept the message's white space too; where it trimmed it, the text is
    cut with its trailing white space stripped)."""
    mark = _CONTINUE_MARK.strip()
    at = text.rfind(mark)
    if at < 0 or final.strip() not in text:
        raise ValueError("continue_final_message: the last message's content does not appear in the rendered "
                         "conversation (the chat template drops or changes it)")
    return text[:at] if text.startswith(_CONTINUE_MARK, at) else text[:at].rstrip()
