"""What the router's serving core needs of a call, whatever face it came through (gRPC or HTTP):
who is calling (the tenant their token allows), until when, and how a refusal is said.

The core (cluster/router_service.py `RouterService.generate`) raises `ServingError` with a gRPC
status code, the vocabulary both faces share: the gRPC face aborts the call with it, the HTTP
face answers the matching HTTP status (cluster/http/errors.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc

from cluster.config import ANY_TENANT
from worker.error_details import Metadata, details_metadata


class ServingError(Exception):
    """A call the router ends with `code`; the message names what was wrong."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        *,
        field: str | None = None,
        reason: str | None = None,
        anthropic: str | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field
        """The request's field refused, if one was (the message begins with it)."""
        self.reason = reason
        """Why, for programs (worker/errors.py): PROMPT_TOO_LARGE (HTTP 413),
        CONTEXT_LENGTH_EXCEEDED (OpenAI's `context_length_exceeded`); None for the others."""
        self.anthropic = anthropic
        """The message in Anthropic's words, where its clients parse them (a context
        overflow); None: the message."""

    def trailing_metadata(self) -> Metadata:
        """The gRPC trailer that carries the field and the reason (worker/error_details.py)."""
        return details_metadata(self.code, self.message, self.field, self.reason)


@dataclass(frozen=True, slots=True)
class Caller:
    tenant: str = ANY_TENANT
    """The tenant the caller's token allows ("*": any, also when no token is configured)."""
    deadline: float | None = None
    """time.monotonic() by which the caller wants its answer; None: no deadline."""

    @classmethod
    def within(cls, tenant: str, timeout: float | None) -> Caller:
        return cls(tenant, None if timeout is None else time.monotonic() + timeout)

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
