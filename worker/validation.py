"""What makes a request servable, checked the same way wherever it is checked. Imports no torch.

The router checks a request before routing it (so a bad one costs no worker a thing) and the
worker checks it again on arrival; both call these functions with the same `RequestLimits`, so
they cannot disagree. Every refusal is an `InvalidRequest` naming the field. Text is measured
against `max_prompt_chars` before it is tokenised, and a text longer than
`HEAD_CHARS_PER_TOKEN` characters per token of context is tokenised in full only if its head
fits: a prompt too long to serve costs at most a context's worth of tokeniser time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from worker.errors import InvalidRequest, PromptTooLarge
from worker.request import GenerateRequest
from worker.sampling_params import MAX_N, StopLimits

DEFAULT_MAX_PROMPT_CHARS = 1 << 20
HEAD_CHARS_PER_TOKEN = 16
"""Prose runs 3-5 characters a token: a text this long per token of context is tried by its head
first. (Only the cost depends on it: a text whose head fits is always tokenised whole.)"""
HEAD_SLACK_TOKENS = 16
"""Cutting a text may split its last word into more tokens than it has whole."""


class LimitSettings(Protocol):
    """The operator's request limits, as the engine's config and the cluster's engine section
    both spell them."""

    @property
    def max_stop_strings(self) -> int: ...

    @property
    def max_stop_chars(self) -> int: ...

    @property
    def max_prompt_chars(self) -> int: ...


class PromptTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> str: ...


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What the model and the operator allow one request."""

    vocab_size: int
    max_model_len: int
    stop: StopLimits = field(default_factory=StopLimits)
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS
    """Characters of a text prompt, or of all a chat's message contents together."""

    @classmethod
    def of(cls, vocab_size: int, max_model_len: int, settings: LimitSettings) -> RequestLimits:
        """The model's limits with the operator's: what the router and every worker check."""
        stop = StopLimits(settings.max_stop_strings, settings.max_stop_chars)
        return cls(vocab_size, max_model_len, stop, settings.max_prompt_chars)


def prompt_ids(
    request: GenerateRequest, tokenizer: PromptTokenizer | None, limits: RequestLimits
) -> list[int]:
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
        _check_chars("prompt", len(request.prompt), limits)
        return _encode("prompt", request.prompt, tokenizer, limits)
    assert request.messages is not None
    if not request.messages:
        raise InvalidRequest("messages", "is empty; send at least one message")
    chars = 0
    for i, message in enumerate(request.messages):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("content"), str)
            or not message.get("role")
        ):
            raise InvalidRequest(f"messages[{i}]", "needs a role and a text content")
        chars += len(message["content"])
    _check_chars("messages", chars, limits)
    try:
        text = tokenizer.apply_chat_template(list(request.messages))
    except ValueError as err:  # no template, or the template refused the conversation
        raise InvalidRequest("messages", str(err)) from err
    return _encode("messages", text, tokenizer, limits, add_special_tokens=False)


def _encode(
    name: str,
    text: str,
    tokenizer: PromptTokenizer,
    limits: RequestLimits,
    add_special_tokens: bool = True,
) -> list[int]:
    """The text's ids; refused by its head alone when that already overflows the context."""
    head = HEAD_CHARS_PER_TOKEN * limits.max_model_len
    if len(text) > head:
        probe = getattr(tokenizer, "probe", tokenizer)  # the router's text index: not through it
        tokens = len(probe.encode(text[:head], add_special_tokens=add_special_tokens))
        if tokens > limits.max_model_len + HEAD_SLACK_TOKENS:
            raise InvalidRequest(
                name,
                f"{len(text)} characters overflow a context of {limits.max_model_len} tokens "
                f"(the first {head} alone are {tokens} tokens)",
            )
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def _check_chars(name: str, chars: int, limits: RequestLimits) -> None:
    if chars > limits.max_prompt_chars:
        raise PromptTooLarge(
            name,
            f"{chars} characters; the limit is {limits.max_prompt_chars} (max_prompt_chars)",
        )


def validate(request: GenerateRequest, prompt: Sequence[int], limits: RequestLimits) -> None:
    """The prompt and the sampling parameters fit the model. For a resumed sample the prompt
    ends with tokens already generated: they count against max_tokens, not the prompt."""
    if not prompt:
        raise InvalidRequest("prompt", "is empty")
    generated = _check_resume(request, len(prompt))
    original = len(prompt) - generated
    if original >= limits.max_model_len:  # before the scan below: a huge prompt costs no loop
        raise InvalidRequest(
            "prompt",
            f"{original} tokens leave no room to generate in a context of {limits.max_model_len}",
        )
    vocab_size = limits.vocab_size
    bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(
            "prompt_token_ids", f"token {bad} is outside the vocabulary [0, {vocab_size})"
        )
    request.sampling.validate(vocab_size, limits.max_model_len - original, limits.stop)


def _check_resume(request: GenerateRequest, prompt_len: int) -> int:
    """How many of the prompt's tokens were generated before (0 unless resumed)."""
    resume = request.resume
    if resume is None:
        return 0
    if request.sampling.n != 1:
        raise InvalidRequest("sampling.n", "a resumed sample is resumed alone: n must be 1")
    if not 0 <= resume.sample_index < MAX_N:
        raise InvalidRequest("resume.sample_index", f"must be in [0, {MAX_N})")
    if not 0 <= resume.generated < prompt_len:
        raise InvalidRequest(
            "resume.generated", f"{resume.generated} of a {prompt_len}-token sequence"
        )
    if resume.generated >= request.sampling.max_tokens:
        raise InvalidRequest(
            "resume.generated",
            f"{resume.generated} tokens already reach max_tokens {request.sampling.max_tokens}",
        )
    return resume.generated
