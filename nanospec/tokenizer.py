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
    """A `tokenizers.Tokenizer` and its tokenizer_config.json; `extra_eos_token_ids` also end generation
    (``eos_token_ids``: the config's ``eos_token``, ``eos_token_id``, first, then those).
    ``add_bos_token``: whether ``encode(text, add_special_tokens=True)`` puts BOS in front."""

    def __init__(self, backend: tokenizers.Tokenizer, config: Mapping | None = None,
                 extra_eos_token_ids: Sequence[int] = ()):
        self.backend = backend
        self.config = dict(config or {})
        self._special_tokens = {name: _token_content(name, self.config.get(name))
                               for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
        self.bos_token, self.eos_token = self._special_tokens["bos_token"], self._special_tokens["eos_token"]
        self.bos_token_id = backend.token_to_id(self.bos_token) if self.bos_token is not None else None
        # tokenizer.json's post-processor adds the special tokens; transformers, given a tokenizer.json, ignores the
        # config's add_bos_token, and so do we
        self.add_bos_token = self.bos_token_id is not None and \
            backend.encode("", add_special_tokens=True).ids[:1] == [self.bos_token_id]
        self.eos_token_id = backend.token_to_id(self.eos_token) if self.eos_token is not None else None
        self.eos_token_ids = list(dict.fromkeys(i for i in [self.eos_token_id, *extra_eos_token_ids] if i is not None))
        self.chat_template = _pick_chat_template(self.config.get("chat_template"))
        # compiled now, so that a template that does not compile is refused with the model
        self._compiled_template = None if self.chat_template is None else _compile_chat_template(self.chat_template)

    def __getstate__(self) -> dict:
        """For pickling (a tensor-parallel worker gets the tokenizer): the compiled template, which holds local
        functions, is left out and compiled again on first use."""
        return {**self.__dict__, "_compiled_template": None}

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
        """Token ids of `text` (special tokens written in it become their ids). ``add_special_tokens``: with the
        tokens the tokenizer adds around a text (BOS for Llama-style tokenizers, nothing for SmolLM2's), as
        transformers' ``tokenizer(text)`` and vLLM do for a raw text prompt; a rendered chat template holds its own
        and is encoded without."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

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
        final = messages[-1]["content"]
        if continue_final_message:  # a mark after the last message's content shows where to cut
            messages = messages[:-1] + [{**messages[-1], "content": final + _CONTINUE_MARK}]
        if self._compiled_template is None:  # (unpickled)
            self._compiled_template = _compile_chat_template(self.chat_template)
        try:
            text = self._compiled_template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                  **self._special_tokens)
        except jinja2.TemplateError as error:  # raise_exception(...) in the template, an undefined function, ...
            raise ValueError(f"the chat template refused the conversation: {error}") from None
        except (TypeError, LookupError, ArithmeticError) as error:  # e.g. a string plus a number in the template
            raise ValueError(f"the chat template failed on the conversation: {type(error).__name__}: {error}") \
                from None
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


def _token_content(name: str, token) -> str | None:
    """tokenizer_config.json writes a special token as a string or as {"content": ..., ...}; anything else is a
    ValueError naming the field."""
    content = token.get("content") if isinstance(token, Mapping) else token
    if content is not None and not isinstance(content, str):
        raise ValueError(f'{name} must be a token, a string or {{"content": "..."}}, got {token!r}')
    return content


def _pick_chat_template(template) -> str | None:
    """The chat template: a string, or (older configs) a list of {"name", "template"} entries of which the one
    named "default" is the chat template. Anything else is a ValueError naming the field."""
    if isinstance(template, list):
        bad = next((entry for entry in template if not isinstance(entry, Mapping)
                    or not isinstance(entry.get("name"), str) or not isinstance(entry.get("template"), str)), None)
        if bad is not None:
            raise ValueError('chat_template: a list of templates holds {"name": ..., "template": ...} objects '
                             f"whose name and template are strings, got {bad!r}")
        return {entry["name"]: entry["template"] for entry in template}.get("default")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"chat_template must be a string (the Jinja template) or a list of named templates, "
                         f"got {template!r}")
    return template


def _compile_chat_template(template: str) -> jinja2.Template:
    """Compile like transformers: sandboxed, trim_blocks + lstrip_blocks, its helpers and a `tojson` that keeps
    non-ASCII text and does not escape HTML. A template that does not compile is a ValueError saying why."""

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as error:  # bad syntax, an unknown filter or test
        raise ValueError(f"the chat template does not compile: {error} (line {error.lineno})") from None


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
