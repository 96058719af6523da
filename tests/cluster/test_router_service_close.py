"""Closing a call's stream closes the worker call under it before `aclose` returns, not when the
garbage collector gets to it: its `finally` (the worker call cancelled, the call out of
`in_flight` and the admission counts, the policy told) has run by then. Several prompts close
the others' streams this way when one fails, and the Responses API's truncation its first."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from cluster.config import ANY_TENANT
from cluster.router_service import RouterService
from cluster.serving_call import Caller
from protos.radixmesh.v1 import serving_pb2


def test_closing_a_calls_stream_closes_the_worker_call_under_it_at_once() -> None:
    happened: list[str] = []

    async def served(*args: Any) -> AsyncGenerator[serving_pb2.GenerateResponse, None]:
        try:
            for index in range(3):
                yield serving_pb2.GenerateResponse(index=index)
        finally:
            happened.append("worker call ended")

    async def client() -> None:
        service = object.__new__(RouterService)  # only the stream's own code runs
        service._generate = served  # type: ignore[method-assign,assignment]
        stream = service.generate(serving_pb2.GenerateRequest(), Caller(ANY_TENANT))
        assert (await anext(stream)).index == 0
        await stream.aclose()
        happened.append("closed")

    asyncio.run(client())
    assert happened == ["worker call ended", "closed"]
