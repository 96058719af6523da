"""What makes a request servable, checked the same way wherever it is checked.

The router checks a request before routing it (so a bad one costs no worker a thing) and the
worker checks it again on arrival; both call these functions, so they cannot disagree. Every
refusal is an `InvalidRequest` naming the field.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from worker.errors import InvalidRequest
from worker.request import GenerateRequest


class PromptTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> str: ...


def prompt_ids(request: GenerateRequest, tokenizer: PromptTokenizer | None) -> list[int]:
    """The prompt's token ids, from ids as given, text (encoded) or chat (template, encoded)."""
    given = [
        name
        for name in ("prompt_token_ids", "prompt", "messages")
        if getattr(request, name) is not None
    ]
    if len(given) != 1:
        raise InvalidRequest(
            "prompt", f"give exactly one of token ids, text or messages; got {given}"
        )
    if request.prompt_token_ids is not None:
        return list(request.prompt_token_ids)
    if tokenizer is None:
        raise InvalidRequest(given[0], "this model has no tokenizer; send token ids")
    if request.prompt is not None:
        return tokenizer.encode(request.prompt)
    assert request.messages is not None
    for i, message in enumerate(request.messages):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("content"), str)
            or not message.get("role")
        ):
            raise InvalidRequest(f"messages[{i}]", "needs a role and a text content")
    try:
        text = tokenizer.apply_chat_template(list(request.messages))
    except ValueError as err:  # no template, or the template refused the conversation
        raise InvalidRequest("messages", str(err)) from err
    return tokenizer.encode(text, add_special_tokens=False)


def validate(
    request: GenerateRequest, prompt: Sequence[int], vocab_size: int, max_model_len: int
) -> None:
    """The prompt and the sampling parameters fit the model."""
    if not prompt:
        raise InvalidRequest("prompt", "is empty")
    bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(
            "prompt_token_ids", f"token {bad} is outside the vocabulary [0, {vocab_size})"
        )
    if len(prompt) >= max_model_len:
        raise InvalidRequest(
            "prompt",
            f"{len(prompt)} tokens leave no room to generate in a context of {max_model_len}",
        )
    request.sampling.validate(vocab_size, max_model_len - len(prompt))
