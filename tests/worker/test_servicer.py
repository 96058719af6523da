"""The worker's gRPC adapter in-process: streamed outputs, KV events, errors mapped to statuses."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest

from protos.radixmesh.v1 import serving_pb2, worker_pb2, worker_pb2_grpc
from tests.worker.helpers import LLAMA, served
from worker.engine import Engine, EngineConfig
from worker.error_details import refusal_of
from worker.errors import ContextOverflow
from worker.tiny_model import tiny_model


@contextlib.asynccontextmanager
async def _serve() -> AsyncIterator[tuple[worker_pb2_grpc.WorkerStub, Engine]]:
    engine = Engine(tiny_model(LLAMA, seed=2), None, EngineConfig(num_pages=64, page_size=4))
    async with served(engine) as stub:
        yield stub, engine


def _request(
    request_id: str, tokens: list[int], max_tokens: int
) -> worker_pb2.WorkerGenerateRequest:
    sampling = serving_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return worker_pb2.WorkerGenerateRequest(
        request_id=request_id, token_ids=tokens, sampling=sampling
    )


def test_generate_streams_outputs_and_kv_events_reach_a_subscriber() -> None:
    async def scenario() -> None:
        async with _serve() as (stub, engine):
            events = stub.StreamKvEvents(worker_pb2.StreamKvEventsRequest())
            await stub.Describe(worker_pb2.DescribeRequest())  # the subscription is in place
            await asyncio.sleep(0.1)
            responses = [r async for r in stub.Generate(_request("a", list(range(1, 14)), 5))]
            assert sum(len(r.token_ids) for r in responses) == 5
            assert responses[-1].finished and responses[-1].finish_reason == "length"
            assert all(r.worker == "w0" for r in responses)
            batch = await asyncio.wait_for(events.read(), timeout=5)
            assert batch.worker == "w0" and batch.events[0].kind == "stored"
            events.cancel()
            assert engine.cache.pool.num_private == 0

    asyncio.run(scenario())


def test_a_bad_request_is_invalid_argument_naming_the_field() -> None:
    async def scenario() -> None:
        async with _serve() as (stub, _):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.Generate(_request("bad", [1, 2, 99_999], 4)):
                    pass
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "prompt_token_ids" in (err.value.details() or "")
            assert refusal_of(err.value) == ("prompt_token_ids", None)
            with pytest.raises(grpc.aio.AioRpcError) as err:  # more than the context holds
                async for _ in stub.Generate(_request("long", [1, 2, 3], 10**6)):
                    pass
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert refusal_of(err.value) == ("max_tokens", ContextOverflow.reason)

    asyncio.run(scenario())
