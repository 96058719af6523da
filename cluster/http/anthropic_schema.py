"""The Anthropic Messages API's requests and responses (text content), as pydantic models.

As for OpenAI's (openai_schema.py): undeclared parameters are refused by name, declared ones
radixmesh does not implement are refused unless they ask for nothing (`REFUSED`). `cache_control`
(on the request or a text block) is accepted: radixmesh caches every prompt prefix whether asked
or not.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from cluster.http.openai_schema import Body, Strict


class MessageParam(Strict):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class Metadata(Strict):
    user_id: str | None = None


class ToolParam(Strict):
    """A client tool (Anthropic's server tools, such as web search, have their own `type`)."""

    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None
    strict: bool | None = None
    """Accepted: every tool's input is held to its schema, strict or not (a grammar)."""
    eager_input_streaming: bool | None = None
    """Accepted: a call's input is streamed in one delta once the call is whole."""


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(Strict):
    """`thinking`: "enabled" (with `budget_tokens`) or "adaptive" shows a thinking model's
    reasoning as `thinking` blocks; "disabled" asks its template not to think
    (cluster/http/anthropic_thinking.py)."""

    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = None
    display: Literal["summarized", "omitted"] | None = None


class MessagesRequest(Body):
    model: str
    max_tokens: int
    messages: list[MessageParam]
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: Metadata | None = None
    cache_control: dict[str, Any] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    priority: int | None = None
    """vLLM's `priority` (lower first, under the `priority` scheduling policy), not Anthropic's:
    a Message Batch's requests carry `router.batch_priority` in it."""
    service_tier: Any = None
    container: Any = None
    mcp_servers: Any = None


REFUSED: dict[str, tuple[str, tuple[object, ...]]] = {
    "service_tier": ("there is one tier", ("auto", "standard_only")),
    "container": ("code execution is not supported", ()),
    "mcp_servers": ("MCP servers are not supported", ([],)),
}


class CountTokensRequest(Body):
    model: str
    messages: list[MessageParam]
    system: str | list[dict[str, Any]] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    cache_control: dict[str, Any] | None = None
    """Accepted, as on a message: the prefix cache needs no marker."""


class ThinkingBlock(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str


class TextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class MessageUsage(BaseModel):
    input_tokens: int
    """Prompt tokens not read from the cache (Anthropic counts cache reads apart)."""
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int
    """Prompt tokens served from the prefix cache."""


class Message(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ThinkingBlock | TextBlock | ToolUseBlock]
    stop_reason: str | None
    stop_sequence: str | None = None
    usage: MessageUsage


class TokenCount(BaseModel):
    input_tokens: int


class ModelInfo(BaseModel):
    """A model as the Models API describes it (`GET /v1/models` with `anthropic-version`)."""

    type: Literal["model"] = "model"
    id: str
    display_name: str
    created_at: str
    """RFC 3339, UTC."""


class ModelInfoList(BaseModel):
    data: list[ModelInfo]
    has_more: bool = False
    first_id: str | None
    last_id: str | None
