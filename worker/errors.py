"""Typed errors of the worker: what the servicer maps to gRPC statuses."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request that can never be served as sent; the message names the field."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        super().__init__(f"{field}: {problem}")


class PromptTooLarge(InvalidRequest):
    """A prompt over the operator's size limit (`max_prompt_chars`): refused before any work
    (HTTP 413 on the router's HTTP API; INVALID_ARGUMENT on gRPC, as any bad field)."""


class EngineOverloaded(RuntimeError):
    """Too many requests are waiting; try again later (backpressure, not a failure)."""


class EngineStopped(RuntimeError):
    """The engine is not running (stopped, or its thread died)."""
