"""What a conversation must be, checked in one place for every front (``LLM.chat``, the server).

A non-empty list of dicts, each with a ``role`` (:data:`ROLES`), a ``content`` (a string, or OpenAI's list of
``{"type": "text", "text": ...}`` parts) and optionally a ``name``; any other key is an error that names it. The
template gets what vLLM hands it: the parts' texts joined by newlines, the ``name`` kept.
"""

from __future__ import annotations

from collections.abc import Mapping

ROLES = ("system", "developer", "user", "assistant", "tool")
KEYS = ("role", "content", "name")


def check_messages(messages, where: str = "messages") -> list[dict]:
    """The conversation as plain ``{"role", "content"}`` dicts (and ``"name"`` where given); ValueError naming the
    first thing wrong, e.g. ``messages[1].role: must be one of ...``, ``where`` being the field's name."""
    if not isinstance(messages, (list, tuple)) or not messages:
        got = "an empty list" if isinstance(messages, (list, tuple)) else repr(messages)[:60]
        raise ValueError(f"{where}: give at least one message (a list of {{'role': ..., 'content': ...}}), "
                         f"got {got}")
    return [_check_message(m, f"{where}[{i}]") for i, m in enumerate(messages)]


def _check_message(message, where: str) -> dict:
    if not isinstance(message, Mapping):
        raise ValueError(f"{where}: a message is an object with 'role' and 'content', got {repr(message)[:60]}")
    unknown = [k for k in message if k not in KEYS]
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r} (a message has 'role', 'content' and "
                         f"optionally 'name')")
    role = message.get("role")
    if role not in ROLES:
        shown = "missing" if "role" not in message else f"got {role!r}"
        raise ValueError(f"{where}.role: must be one of {', '.join(repr(r) for r in ROLES)}; {shown}")
    if "name" in message and not isinstance(message["name"], str):
        raise ValueError(f"{where}.name: must be a string, got {message['name']!r}")
    checked = {"role": role, "content": _content(message, f"{where}.content")}
    return {**checked, "name": message["name"]} if "name" in message else checked


def _content(message: Mapping, where: str) -> str:
    if "content" not in message or message["content"] is None:
        raise ValueError(f"{where}: missing; every message needs its text")
    content = message["content"]
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str) \
                    or set(part) != {"type", "text"}:
                raise ValueError(f"{where}[{i}]: a part is {{'type': 'text', 'text': ...}} (only text is "
                                 f"supported), got {repr(part)[:60]}")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ValueError(f"{where}: must be a string or a list of {{'type': 'text', 'text': ...}} parts, "
                     f"got {repr(content)[:60]}")
