"""`prompt_alone` (echo with max_tokens 0) strips what was generated from each message, and a
sample that ended normally ends with "length"; one that failed stays failed, so the response
is an error, not the prompt with its logprobs missing."""

from __future__ import annotations

import asyncio

import pytest

from cluster.http.errors import GenerationFailed
from cluster.http.openai_responses import Counts, Responses, read
from cluster.http.prompt_logprobs import prompt_alone
from protos.radixmesh.v1 import serving_pb2


async def messages(*items: serving_pb2.GenerateResponse) -> Responses:
    for item in items:
        yield item


async def drained(stream: Responses) -> list[serving_pb2.GenerateResponse]:
    return [m async for m in read(prompt_alone(stream), Counts())]


def test_what_was_generated_goes_and_a_normal_end_is_length() -> None:
    done = serving_pb2.GenerateResponse(
        request_id="r", token_ids=[7], text="x", finished=True, finish_reason="stop"
    )
    (got,) = asyncio.run(drained(messages(done)))
    assert (list(got.token_ids), got.text, got.finish_reason) == ([], "", "length")


def test_a_failure_stays_a_failure() -> None:
    failed = serving_pb2.GenerateResponse(request_id="r", finished=True, finish_reason="error")
    with pytest.raises(GenerationFailed):
        asyncio.run(drained(messages(failed)))
