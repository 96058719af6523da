"""Typed errors of the worker: what the servicer maps to gRPC statuses."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request that can never be served as sent; the message names the field."""

    reason: str | None = None
    """Why, for a program to tell, where a client may act on it (worker/error_details.py)."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        super().__init__(f"{field}: {problem}")


class PromptTooLarge(InvalidRequest):
    """A prompt over the operator's size limit (`max_prompt_chars`): refused before any work
    (HTTP 413 on the router's HTTP API; INVALID_ARGUMENT on gRPC, as any bad field)."""

    reason = "PROMPT_TOO_LARGE"


class ContextOverflow(InvalidRequest):
    """The prompt leaves no room to generate in the model's context, or less than max_tokens
    asks: a shorter prompt (or max_tokens) would be served. OpenAI's `context_length_exceeded`,
    which clients read to drop the oldest turns of a conversation. `anthropic` says it in
    Anthropic's words, which its clients parse (the Anthropic API answers with it)."""

    reason = "CONTEXT_LENGTH_EXCEEDED"

    def __init__(self, field: str, problem: str, anthropic: str) -> None:
        super().__init__(field, problem)
        self.anthropic = anthropic


class EngineOverloaded(RuntimeError):
    """Too many requests are waiting; try again later (backpressure, not a failure)."""


class EngineStopped(RuntimeError):
    """The engine is not running (stopped, or its thread died)."""
