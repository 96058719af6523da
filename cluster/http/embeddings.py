"""`POST /v1/embeddings` (OpenAI's API, as vLLM serves it for embedding models): each input is
one embedding request (serving.proto's `pooling`), routed on its own as any prompt is, so an
input that shares a prefix with what a worker has seen goes there and reads that prefix's KV
from its cache; only the rest is computed. Its embedding is the last token's final hidden
state (worker/pooling.py).

The router runs at most half its in-flight calls (`router.max_in_flight`) of embedding inputs
at a time, all requests together (`embedding_calls`): a request of 2,048 inputs waits its turn
input by input, and leaves room for chats; an input refused for load pauses and is tried again
(`overload_pauses`). Any other refusal or failure ends the request, every input still running
cancelled, and names the input (`input[3]: is empty`)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import random
import time
from collections.abc import Callable, Iterator, Sequence

import grpc
import numpy as np

from cluster.http.embeddings_schema import (
    MAX_INPUTS,
    Embedding,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from cluster.http.errors import GenerationFailed, HttpError
from cluster.http.openai_params import check_range, prompt_requests
from cluster.http.openai_responses import Counts, Responses, read
from cluster.http.openai_schema import PromptTokensDetails
from cluster.http.several_prompts import prompts_of
from cluster.serving_call import ServingError
from protos.radixmesh.v1 import serving_pb2


def embedding_calls(max_in_flight: int) -> int:
    """How many embedding inputs the router runs at once, all requests together: half its
    in-flight calls (`router.max_in_flight`), so a burst of embeddings neither fills the
    workers' queues nor leaves no room for chats (each input waits its turn, none is refused
    for it)."""
    return max(1, max_in_flight // 2)


OVERLOADED = grpc.StatusCode.RESOURCE_EXHAUSTED
OVERLOAD_WAIT_S = 20.0
"""How long an input refused for load is tried again before the request fails with it (429)."""
OVERLOAD_PAUSE_S = 0.05
"""The first pause before trying it again; each next one doubles, up to a second."""
INPUT_FIELDS = frozenset({"prompt", "prompt_token_ids", "input"})
"""What the serving core calls an input when it refuses one."""
_UINT32 = (1, 2**32 - 1)


def embedding_requests(
    body: EmbeddingRequest, request_id: str, tenant: str
) -> list[serving_pb2.GenerateRequest]:
    """One embedding request per input: `request_id`, or `{request_id}-{i}` for input i of
    several."""
    inputs = prompts_of(body.input)
    if len(inputs) > MAX_INPUTS:
        raise HttpError.invalid(
            "input", f"{len(inputs)} inputs in one request; send 1 to {MAX_INPUTS}"
        )
    pooling = serving_pb2.PoolingParams(normalize=body.normalize)
    if body.dimensions is not None:
        check_range("dimensions", [body.dimensions], _UINT32)
        pooling.dimensions = body.dimensions
    name = functools.partial(input_name, inputs=len(inputs))
    return prompt_requests(inputs, request_id, tenant, body, name, pooling=pooling)


def input_name(index: int, inputs: int) -> str:
    return "input" if inputs == 1 else f"input[{index}]"


async def embed_all(
    start: Callable[[serving_pb2.GenerateRequest], Responses],
    messages: Sequence[serving_pb2.GenerateRequest],
    counts: Counts,
    gate: asyncio.Semaphore,
) -> list[serving_pb2.GenerateResponse]:
    """Each message's finished response (with its embedding), in order, each started once
    `gate` lets it. The first refusal (an HttpError naming its input) or failure cancels the
    rest."""

    async def one(index: int, message: serving_pb2.GenerateRequest) -> serving_pb2.GenerateResponse:
        waits = overload_pauses()
        while True:
            async with gate:  # held for an attempt, not for the pause after a refusal
                try:
                    return await _embedding(start(message), counts)
                except ServingError as err:
                    pause = next(waits, None) if err.code == OVERLOADED else None
                    if pause is None:
                        raise _refused(err, input_name(index, len(messages))) from err
            await asyncio.sleep(pause)

    tasks = [asyncio.ensure_future(one(i, m)) for i, m in enumerate(messages)]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _refused(err: ServingError, name: str) -> HttpError:
    """The refusal of one input, the field called what the request calls that input."""
    return HttpError.of(err).renamed(lambda field: name if field in INPUT_FIELDS else None)


def overload_pauses(wait_s: float | None = None) -> Iterator[float]:
    """The pauses before an input refused for load (its workers' queues or the router's
    in-flight limit full: RESOURCE_EXHAUSTED) is tried again: from `OVERLOAD_PAUSE_S`, doubling
    to a second, each with up to a quarter more at random (inputs refused together do not come
    back together), until `wait_s` (OVERLOAD_WAIT_S) have passed. An input of a large request
    so waits for room
    instead of failing the inputs already embedded (a worker that died leaves the others less
    room); a batch's request waits longer (cluster/http/batches.py)."""
    wait_s = OVERLOAD_WAIT_S if wait_s is None else wait_s
    pause, give_up = OVERLOAD_PAUSE_S, time.monotonic() + wait_s
    while time.monotonic() < give_up:
        yield pause * (1 + random.random() / 4)
        pause = min(2 * pause, 1.0)


async def _embedding(stream: Responses, counts: Counts) -> serving_pb2.GenerateResponse:
    async with contextlib.aclosing(read(stream, counts)) as responses:
        async for response in responses:
            if response.finished:
                if not response.embedding:
                    raise GenerationFailed(
                        f"{response.request_id} ended ({response.finish_reason}) with no embedding"
                    )
                return response
    raise GenerationFailed("an embedding's stream ended before its embedding")


def embedding_response(
    outputs: Sequence[serving_pb2.GenerateResponse], counts: Counts, form: str, model: str
) -> EmbeddingResponse:
    data = [
        Embedding(index=i, embedding=_encoded(output.embedding, form))
        for i, output in enumerate(outputs)
    ]
    usage = EmbeddingUsage(
        prompt_tokens=counts.prompt_tokens,
        total_tokens=counts.prompt_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=counts.cached_tokens),
    )
    return EmbeddingResponse(data=data, model=model, usage=usage)


def _encoded(values: Sequence[float], form: str) -> list[float] | str:
    if form == "float":
        return list(values)
    return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode("ascii")
