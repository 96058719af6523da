"""A chat whose last message is continued instead of answered: the assistant's turn a client
began (Anthropic's prefill, a final assistant message; vLLM's `continue_final_message`).

The template renders the conversation without a generation prompt, the last message's text
followed by a mark no text holds; the rendered text is cut at the mark, so the message's
end-of-turn tokens go and the model writes on from where its text stops. (transformers finds
the message's text itself in the rendered conversation, at its last occurrence, which for a
short text like "i" can be inside the end-of-turn token `<|im_end|>`; the mark cannot.)
Imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from worker.errors import InvalidRequest

MARK = "\ue000radixmesh:continue\ue000"
"""Private-use characters around a name: in no text a client sends, and kept by templates,
which write a message's content as they get it."""


def final_text(message: Mapping[str, Any]) -> str:
    """The text of a message's content (a string, or the text of its parts)."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list | tuple):
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, dict)
            and part.get("type") == "text"
            and isinstance(part.get("text"), str)
        )
    return ""


def _marked(message: Mapping[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": content + MARK}
    parts = list(content) if isinstance(content, list | tuple) else []
    return {**message, "content": [*parts, {"type": "text", "text": MARK}]}


def continued(
    render: Callable[[list[dict[str, Any]]], str], messages: Sequence[dict[str, Any]]
) -> str:
    """The conversation through `render` (the template, no generation prompt), cut right after
    the last message's text. Refused when there is no text, or the template does not write
    it as given."""
    if not final_text(messages[-1]).strip():
        raise InvalidRequest("messages", "the last message is empty: there is nothing to continue")
    if any(MARK in final_text(m) for m in messages):
        raise InvalidRequest("messages", "a message holds the continuation mark U+E000")
    rendered = render([*messages[:-1], _marked(messages[-1])])
    if rendered.count(MARK) != 1:
        raise InvalidRequest(
            "messages",
            "the chat template does not write the last message's text as given, so it cannot "
            "be continued",
        )
    return rendered[: rendered.index(MARK)]
