"""OpenAI's embeddings API (`POST /v1/embeddings`): the request and the response, as pydantic
models. The request is strict, as the other APIs' are (an undeclared field is refused by name);
vLLM's `normalize` and `priority` extensions are accepted. The response is OpenAI's field for
field, with the chat API's `prompt_tokens_details.cached_tokens` in its usage (extra fields
pass the SDK's models)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from cluster.http.openai_schema import Body, PromptTokensDetails

MAX_INPUTS = 2048
"""Inputs in one request: OpenAI's limit."""


class EmbeddingRequest(Body):
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    """base64: each embedding's float32 values, little-endian, base64-encoded (what the
    OpenAI SDK asks for unless told otherwise, and decodes)."""
    dimensions: int | None = None
    """Keep the first this many values (a Matryoshka-trained model's shorter embedding)."""
    user: str | None = None
    """OpenAI's end-user id: accepted, not used."""
    normalize: bool = True
    """vLLM's: false leaves the hidden state's own scale."""
    priority: int | None = None
    """vLLM's: lower is served earlier, under the workers' `priority` scheduling policy."""
    cache_salt: str | None = None
    """vLLM's, as for generations: only requests of the same salt share cached KV."""
    truncate_prompt_tokens: int | None = None
    """vLLM's: only the input's last this many tokens are embedded (-1: the context length)."""
    text_match: Literal["exact", "anchored", "off"] | None = None
    """How a text input reuses the router's text index (docs/router.md), as for completions."""


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
