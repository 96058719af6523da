"""vLLM's score and rerank APIs for an embedding model, over the embeddings API:

    POST /v1/score, /score            {"text_1": str | [str], "text_2": str | [str]}
    POST /v1/rerank, /rerank, /v2/rerank   {"query": str, "documents": [str], "top_n": int}

A score is the cosine similarity of two texts' embeddings (cluster/http/embeddings.py: the last
token's final hidden state, unit length), as vLLM scores with an embedding model. `text_1` and
`text_2` pair one with many, many with one, or as many with as many, in order. Rerank scores
each document against the query and answers the best first (Jina's and Cohere's shape, as vLLM
answers it), the `top_n` first if asked, with their texts unless `return_documents` is false.

Each distinct text (at most 2,048 a call, the query included) is embedded once, routed on its
own: a document reranked again, against
another query, reads its KV from the cache of the worker that embedded it, so only its last
position is computed. A refusal names the text it is about (`documents[2]: is empty`).
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel

from cluster.http.embeddings_schema import MAX_INPUTS, EmbeddingRequest, EmbeddingUsage
from cluster.http.errors import HttpError
from cluster.http.json_answer import answer
from cluster.http.openai_responses import Counts
from cluster.http.openai_schema import Body, PromptTokensDetails
from protos.radixmesh.v1 import serving_pb2

if TYPE_CHECKING:
    from cluster.http.app import HttpApi


class ScoreRequest(Body):
    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    priority: int | None = None
    """vLLM's: lower is served earlier, under the workers' `priority` scheduling policy."""
    user: str | None = None


class RerankRequest(Body):
    query: str
    documents: list[str]
    model: str | None = None
    top_n: int | None = None
    """The best this many; unset or 0: every document."""
    return_documents: bool = True
    priority: int | None = None
    user: str | None = None


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: EmbeddingUsage


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument | None
    relevance_score: float


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


def add_routes(app: FastAPI, api: HttpApi) -> None:
    async def score(body: ScoreRequest, request: Request) -> Response:
        firsts = [body.text_1] if isinstance(body.text_1, str) else body.text_1
        seconds = [body.text_2] if isinstance(body.text_2, str) else body.text_2
        pairs = _pairs(firsts, seconds)
        names = _names("text_1", body.text_1) + _names("text_2", body.text_2)
        longer = "text_1" if len(firsts) > len(seconds) else "text_2"
        texts = [*firsts, *seconds]
        vectors, counts, model = await _embedded(api, request, body, texts, names, longer)
        a, b = vectors[: len(firsts)], vectors[len(firsts) :]
        data = [ScoreData(index=k, score=float(a[i] @ b[j])) for k, (i, j) in enumerate(pairs)]
        tokens = counts.prompt_tokens
        scored = ScoreResponse(
            id=f"score-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=model,
            data=data,
            usage=EmbeddingUsage(
                prompt_tokens=tokens,
                total_tokens=tokens,
                prompt_tokens_details=PromptTokensDetails(cached_tokens=counts.cached_tokens),
            ),
        )
        return await answer(lambda: scored, counts, len(data) > LARGE)

    async def rerank(body: RerankRequest, request: Request) -> Response:
        if not body.documents:
            raise HttpError.invalid("documents", "is empty: send at least one document")
        if body.top_n is not None and body.top_n < 0:
            raise HttpError.invalid("top_n", f"must be >= 0, got {body.top_n}")
        names = ["query", *_names("documents", body.documents)]
        texts = [body.query, *body.documents]
        vectors, counts, model = await _embedded(api, request, body, texts, names, "documents")
        scores = vectors[1:] @ vectors[0]
        ranked = sorted(range(len(body.documents)), key=lambda i: (-scores[i], i))
        results = [
            RerankResult(
                index=i,
                document=RerankDocument(text=body.documents[i]) if body.return_documents else None,
                relevance_score=float(scores[i]),
            )
            for i in ranked[: body.top_n or None]
        ]
        ranking = RerankResponse(
            id=f"rerank-{uuid.uuid4().hex}",
            model=model,
            usage=RerankUsage(total_tokens=counts.prompt_tokens),
            results=results,
        )
        return await answer(lambda: ranking, counts, len(results) > LARGE)

    for path in ("/v1/score", "/score"):
        app.add_api_route(path, score, methods=["POST"])
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        app.add_api_route(path, rerank, methods=["POST"])


def _pairs(firsts: Sequence[str], seconds: Sequence[str]) -> list[tuple[int, int]]:
    """Which text of each side each score pairs: one with many, many with one, or in order."""
    if not firsts or not seconds:
        field = "text_1" if not firsts else "text_2"
        raise HttpError.invalid(field, "is empty: send at least one text")
    if len(firsts) == 1:
        return [(0, j) for j in range(len(seconds))]
    if len(seconds) == 1:
        return [(i, 0) for i in range(len(firsts))]
    if len(firsts) != len(seconds):
        raise HttpError.invalid(
            "text_2",
            f"has {len(seconds)} texts and text_1 {len(firsts)}: send one on either side, or as "
            "many on both",
        )
    return [(i, i) for i in range(len(firsts))]


INPUT = re.compile(r"^input(?:\[(\d+)\])?")
LARGE = 256
"""Results past which the answer is encoded on a thread (off the loop every stream shares)."""


def _names(field: str, given: str | list[str]) -> list[str]:
    """What a refusal calls each text of a field: the field, or its item."""
    return [field] if isinstance(given, str) else [f"{field}[{i}]" for i in range(len(given))]


async def _embedded(
    api: HttpApi,
    request: Request,
    body: ScoreRequest | RerankRequest,
    texts: list[str],
    names: list[str],
    field: str,
) -> tuple[np.ndarray, Counts, str]:
    """Each text's unit-length embedding (a row each, in order; a text given twice is embedded
    once), the counts, and the model's name. A refusal names its text; too many distinct texts,
    `field`."""
    distinct = list(dict.fromkeys(texts))
    if len(distinct) > MAX_INPUTS:
        message = f"{len(distinct)} distinct texts in all; at most {MAX_INPUTS}"
        raise HttpError.invalid(field, message)
    where = {text: i for i, text in enumerate(distinct)}
    first_name = {text: names[i] for i, text in reversed(list(enumerate(texts)))}
    inner = EmbeddingRequest(
        input=distinct, model=body.model, priority=body.priority, user=body.user
    )
    try:
        outputs, counts, model = await api.embedded(inner, request)
    except HttpError as err:
        raise err.renamed(lambda param: _renamed(param, distinct, first_name)) from None
    rows = await asyncio.to_thread(_rows, outputs, [where[text] for text in texts])
    return rows, counts, model


def _rows(outputs: Sequence[serving_pb2.GenerateResponse], order: list[int]) -> np.ndarray:
    """The embeddings as rows, in `order` (off the loop: 2,048 of 4,096 floats take a while)."""
    width = len(outputs[0].embedding)
    rows = np.fromiter(
        (x for output in outputs for x in output.embedding), np.float64, len(outputs) * width
    ).reshape(len(outputs), width)
    return rows[order]


def _renamed(param: str, distinct: list[str], first_name: dict[str, str]) -> str | None:
    """`input[i]` (or `input`, for one text) -> the name the request gave that text."""
    found = INPUT.match(param)
    if found is None:
        return None
    index = int(found.group(1) or 0)
    return first_name[distinct[index]] if index < len(distinct) else None
