"""OpenAI's Responses API (`POST /v1/responses`): its requests and the response object, as
pydantic models (the fields radixmesh serves; the SDK's `responses.create`, `.stream` and
`.parse` read what is here).

As for chat completions (openai_schema.py): an undeclared parameter is refused by name, and a
declared one radixmesh does not implement is refused unless it asks for nothing (`REFUSED`).
A response is stored unless `store: false` says not to (OpenAI's default; the router keeps
them in memory, cluster/http/response_store.py), and `previous_response_id` continues a stored
one.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from cluster.http.openai_schema import Body, Effort, Strict


class FunctionTool(Strict):
    """A function the model may call (OpenAI's built-in tools have types of their own)."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    """Accepted either way: the arguments always satisfy the parameters' schema."""


class NamedFunction(Strict):
    type: Literal["function"]
    name: str


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None


class ReasoningConfig(Strict):
    effort: Effort | None = None
    """Given to the chat template as `reasoning_effort` ("none" also as `enable_thinking:
    false`), as chat completions' `reasoning_effort`."""
    summary: Literal["auto", "concise", "detailed"] | None = None
    """Accepted; no summary is written: a thinking model's reasoning comes whole, in the
    reasoning item's `content` (as vLLM serves it)."""
    generate_summary: Literal["auto", "concise", "detailed"] | None = None
    """The older name of `summary`."""
    context: Literal["auto"] | None = None
    """Which turns' reasoning the model sees again: the chat template decides (it gets every
    reasoning item sent back), so only "auto"."""
    mode: Literal["standard"] | None = None
    """One way of running is served."""


class ResponsesRequest(Body):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool | None = False
    user: str | None = None
    safety_identifier: str | None = None
    store: bool | None = None
    """None: stored when the router keeps responses (router.response_store_bytes > 0)."""
    previous_response_id: str | None = None
    """A stored response this one continues: its conversation comes before `input` (its
    `instructions` do not)."""
    conversation: Any = None
    """A conversation (cluster/http/conversations.py), by id or `{"id": ...}`: its items come
    before `input`, and this response's input and output are added to it as it ends."""
    metadata: dict[str, str] | None = None
    """Up to 16 pairs, keys of up to 64 characters, values of up to 512, as at OpenAI; returned
    with the response."""
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = None
    """"reasoning.encrypted_content" and "message.output_text.logprobs"
    (cluster/http/responses_output.py)."""
    truncation: Literal["auto", "disabled"] | None = None
    """"auto": a conversation refused as over the context loses turns from its beginning
    (cluster/http/responses_truncation.py); else it is refused, never cut."""
    background: bool | None = None
    """Answered at once, `queued`, and generated apart from the request
    (cluster/http/responses_background.py): needs the response stored."""
    max_tool_calls: int | None = Field(default=None, ge=1)
    """Accepted and returned: it bounds calls of OpenAI's built-in tools, and radixmesh has
    none (function calls are the client's, which it does not bound)."""
    service_tier: Any = None
    prompt: Any = None
    prompt_cache_key: str | None = None
    """Accepted, as on chat completions: the router routes every prompt to its cache."""
    prompt_cache_retention: Literal["in-memory", "in_memory", "24h"] | None = None
    """Accepted, as on chat completions."""
    cache_salt: str | None = None
    """vLLM's, as on chat completions: only requests of the same salt share cached KV."""
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    """How many of the likeliest tokens each position's logprob lists, with `include:
    ["message.output_text.logprobs"]` (without it, no logprobs are returned, as vLLM does)."""
    priority: int | None = None
    """vLLM's: lower is served earlier (engine.scheduling_policy "priority")."""


REFUSED: dict[str, tuple[str, tuple[object, ...]]] = {
    # parameter: (why it is refused, the values that ask for nothing and are accepted)
    "service_tier": ("there is one tier", ("auto", "default")),
    "prompt": ("stored prompts are not supported", ()),
}


# -- the response object ---------------------------------------------------------------------
class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    """A thinking model's reasoning, whole (vLLM's; OpenAI's own models give summaries)."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = []
    content: list[ReasoningText]
    encrypted_content: str | None = None
    """With `include: ["reasoning.encrypted_content"]`: the reasoning, encoded
    (cluster/http/responses_output.py `sealed`), for a client to send back."""
    status: Literal["in_progress", "completed", "incomplete"]


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class FunctionCallItem(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class InputTokensDetails(BaseModel):
    cached_tokens: int
    """Prompt tokens served from the prefix cache."""
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str
    message: str


class Response(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
    """"queued": a background response not started; "cancelled": cancelled, or its stream's
    client went away before it ended (as stored)."""
    model: str
    output: list[ReasoningItem | OutputMessage | FunctionCallItem]
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: ResponseError | None = None
    instructions: str | None = None
    metadata: dict[str, str] = {}
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    parallel_tool_calls: bool = True
    tool_choice: Any = "auto"
    tools: list[Any] = []
    text: dict[str, Any] = {"format": {"type": "text"}}
    reasoning: dict[str, Any] | None = None
    store: bool = False
    previous_response_id: str | None = None
    conversation: dict[str, str] | None = None
    """The conversation it was made in (`{"id": ...}`)."""
    background: bool = False
    truncation: Literal["auto", "disabled"] = "disabled"
    seal: bool = Field(default=False, exclude=True)
    """radixmesh's, never sent: reasoning items carry `encrypted_content` (the request's
    `include`)."""
