"""OpenAI's Batch API objects (`openai.types.Batch`), and a batch's input file read into its
requests.

An input file is JSON Lines, one request a line: `{"custom_id": ..., "method": "POST", "url":
<the batch's endpoint>, "body": {...}}`. The file as a whole is checked when the batch is
created: a line that is not such an object, a `custom_id` used twice, another endpoint, or a
streamed or background body fails the batch, with one error per line at fault (OpenAI's
`errors`, each naming its line, 1-based). What a body asks is checked when its request runs,
by the endpoint itself: a refusal is that request's line in the error file, and the other
requests run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field

from cluster.http.openai_schema import Strict

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
"""What a batch may call: the generations and the embeddings this router serves."""
MESSAGES = "/v1/messages"
"""What an Anthropic Message Batch calls (cluster/http/message_batches.py): its requests are
kept as an input file's lines for this endpoint, which OpenAI's batches may not name."""
MAX_REQUESTS = 50_000
"""Requests in one batch: OpenAI's limit."""
MAX_MESSAGE_REQUESTS = 100_000
"""Requests in one Anthropic Message Batch: Anthropic's limit."""
MAX_ERRORS = 100
"""Errors a failed batch lists (the first ones, by line)."""
COMPLETION_WINDOW = "24h"


class BatchCreateRequest(Strict):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: dict[str, Any] | None = None
    """OpenAI's: when the output files expire. Accepted; files here last until deleted or the
    router restarts."""


class BatchError(BaseModel):
    code: str
    message: str
    line: int | None = None
    param: str | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError] = Field(default_factory=list)


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class BatchUsage(BaseModel):
    """What the completed requests used (OpenAI's): `input_tokens_details.cached_tokens` is the
    part of their prompts the workers served from cache."""

    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int = 0


class Batch(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    input_file_id: str
    completion_window: str
    status: Literal[
        "validating",
        "failed",
        "in_progress",
        "finalizing",
        "completed",
        "expired",
        "cancelling",
        "cancelled",
    ] = "validating"
    created_at: int
    expires_at: int | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    expired_at: int | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: BatchErrors | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    usage: BatchUsage | None = None
    metadata: dict[str, str] | None = None
    model: str | None = None


@dataclass(frozen=True)
class BatchLine:
    """One request of a batch."""

    number: int
    """Its line in the input file, from 1."""
    custom_id: str
    body: dict[str, Any]


def read_lines(content: bytes, endpoint: str) -> tuple[list[BatchLine], list[BatchError]]:
    """The file's requests, or the errors that fail the batch (the first MAX_ERRORS)."""
    lines: list[BatchLine] = []
    errors: list[BatchError] = []
    seen: dict[str, int] = {}
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as err:
        return [], [BatchError(code="invalid_file", message=f"the file is not UTF-8: {err}")]
    # JSON Lines end at "\n" only: str.splitlines would also cut at U+2028 and the like, which
    # JSON text may hold unescaped
    rows = (raw.removesuffix("\r") for raw in text.split("\n"))
    numbered = [(i, raw) for i, raw in enumerate(rows, 1) if raw.strip()]
    if not numbered:
        return [], [BatchError(code="empty_file", message="the file holds no request")]
    most = MAX_MESSAGE_REQUESTS if endpoint == MESSAGES else MAX_REQUESTS
    if len(numbered) > most:
        message = f"the file holds {len(numbered)} requests; at most {most}"
        return [], [BatchError(code="too_many_requests", message=message)]
    for number, raw in numbered:
        try:
            lines.append(_line(number, raw, endpoint, seen))
        except _BadLine as bad:
            message = f"line {number}: {bad.message}"
            errors.append(BatchError(code=bad.code, message=message, line=number, param=bad.param))
    return lines, errors[:MAX_ERRORS]


class _BadLine(Exception):
    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


def _line(number: int, raw: str, endpoint: str, seen: dict[str, int]) -> BatchLine:
    try:
        item = json.loads(raw)
    except json.JSONDecodeError as err:
        raise _BadLine("invalid_json_line", f"not JSON ({err})") from err
    if not isinstance(item, dict):
        raise _BadLine("invalid_request", "a request is a JSON object")
    unknown = sorted(set(item) - {"custom_id", "method", "url", "body"})
    if unknown:
        raise _BadLine("invalid_request", f"unknown field {unknown[0]!r}", unknown[0])
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise _BadLine("missing_custom_id", "custom_id must be a non-empty string", "custom_id")
    if custom_id in seen:
        message = f"custom_id {custom_id!r} is line {seen[custom_id]}'s too"
        raise _BadLine("duplicate_custom_id", message, "custom_id")
    seen[custom_id] = number
    if item.get("method") != "POST":
        raise _BadLine("invalid_method", f"method must be POST, got {item.get('method')!r}")
    if item.get("url") != endpoint:
        message = f"url {item.get('url')!r} is not the batch's endpoint {endpoint!r}"
        raise _BadLine("mismatched_url", message, "url")
    body = item.get("body")
    if not isinstance(body, dict):
        raise _BadLine("invalid_request", "body must be a JSON object", "body")
    if body.get("stream"):
        raise _BadLine("invalid_request", "a batch request cannot stream", "body.stream")
    if body.get("background"):  # it would answer at once and run outside the batch's bound
        raise _BadLine(
            "invalid_request", "a batch request cannot run in the background", "body.background"
        )
    return BatchLine(number, custom_id, body)


def prompt_key(line: BatchLine) -> str:
    """What a request's prompt begins with, as one string, for `prefix_order`: its model (an
    adapter's cache is its own), then the parts of the body a prompt is made of, in about the
    order the prompt puts them: a stored conversation it continues, instructions (Anthropic's
    `system`), the messages
    (a system message's content first: JSON keys are sorted, `content` before `role`), the
    prompt or input, then the tools (chat templates put them after the system message, or
    last)."""
    body = line.body
    parts = [
        body.get("model"),
        body.get("cache_salt"),  # vLLM's: a salt's requests share only with each other
        body.get("previous_response_id"),
        body.get("instructions"),
        body.get("system"),
        body.get("messages"),
        body.get("prompt"),
        body.get("input"),
        body.get("tools"),
    ]
    return json.dumps(parts, ensure_ascii=False, sort_keys=True, separators=(",", ":"))


def prefix_order(lines: list[BatchLine]) -> list[BatchLine]:
    """The requests sorted by `prompt_key`: the order of a walk of the keys' prefix tree, so
    that requests whose keys share a prefix (and so, mostly, their prompts) run one after
    another while it is cached, whatever the file's order. Ties keep the file's order."""
    return sorted(lines, key=prompt_key)
