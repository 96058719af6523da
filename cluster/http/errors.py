"""Refusals on the HTTP API: a status and a message naming what was wrong, written as each API's
clients expect their errors (OpenAI's error object; Anthropic's) and counted by status.

The serving core speaks gRPC status codes (cluster/serving_call.py); `HTTP_STATUS` is the one
table from those to HTTP statuses.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grpc

from cluster.serving_call import ServingError
from worker.errors import ContextOverflow, PromptTooLarge

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.FAILED_PRECONDITION: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
"""OpenAI's code for a prompt (with max_tokens) over the model's context."""
RETRY_AFTER_S = 1
"""What a 429 or 503 tells the client to wait (Retry-After), in seconds."""

_OPENAI_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}
_ANTHROPIC_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


Renames = Callable[[str], str | None]
"""A refused field as the serving core names it -> as the request named it (None: the same)."""


def renames(fields: Mapping[str, str], patterns: Sequence[tuple[str, str]] = ()) -> Renames:
    """`fields` by name, then the first of `patterns` (a regular expression over the whole
    name, and its replacement) that matches."""
    compiled = [(re.compile(pattern), replacement) for pattern, replacement in patterns]

    def rename(param: str) -> str | None:
        if param in fields:
            return fields[param]
        for pattern, replacement in compiled:
            if pattern.fullmatch(param):
                return pattern.sub(replacement, param)
        return None

    return rename


class GenerationFailed(RuntimeError):
    """A worker ended a sample with an error (its message says which): 500, or an error event
    in a stream already begun."""


class HttpError(Exception):
    """A request answered with `status` and `message` (naming the field, `param`, if any)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        code: str | None = None,
        anthropic: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        """OpenAI's error code, where it has one for the refusal (`context_length_exceeded`)."""
        self.anthropic = anthropic
        """The message in Anthropic's words, for its API (None: `message`)."""
        self.extra_headers = headers or {}
        """Headers the answer must carry besides Retry-After (a 405's Allow)."""

    @classmethod
    def of(cls, err: ServingError | GenerationFailed) -> HttpError:
        """The answer to a refusal of the serving core, or to a failed generation."""
        if isinstance(err, GenerationFailed):
            return cls(500, str(err))
        status = 413 if err.reason == PromptTooLarge.reason else HTTP_STATUS.get(err.code, 500)
        param = err.message.partition(":")[0] if status in (400, 413) else None
        code = CONTEXT_LENGTH_EXCEEDED if err.reason == ContextOverflow.reason else None
        param = param if param and " " not in param else None
        return cls(status, err.message, param, code=code, anthropic=err.anthropic)

    def renamed(self, rename: Renames) -> HttpError:
        """This refusal with its field called what the request called it (the serving core
        names `sampling.structured.json_schema` what a body sent as `response_format...`)."""
        name = rename(self.param) if self.param is not None else None
        if self.param is not None and name is not None:
            self.message = name + self.message.removeprefix(self.param)
            self.param = name
        return self

    @classmethod
    def invalid(cls, param: str, problem: str) -> HttpError:
        return cls(400, f"{param}: {problem}", param)

    def headers(self) -> dict[str, str]:
        retry = {"Retry-After": str(RETRY_AFTER_S)} if self.status in (429, 503) else {}
        return retry | self.extra_headers

    def openai_body(self) -> dict[str, Any]:
        kind = _OPENAI_TYPE.get(self.status, "server_error")
        error = {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        return {"error": error}

    def anthropic_body(self) -> dict[str, Any]:
        kind = _ANTHROPIC_TYPE.get(self.status, "api_error")
        message = self.anthropic or self.message
        if self.code == CONTEXT_LENGTH_EXCEEDED and not self.anthropic:  # a worker's, relayed
            message = f"prompt is too long: {message}"
        return {"type": "error", "error": {"type": kind, "message": message}}
