"""A stub radixmesh.v1.Serving that streams canned tokens as fast as it can (no model).

It measures the load-test harness itself: run it in its own process, point the harness at it,
and whatever throughput the harness reports is the harness's own ceiling.
`python -m cluster.loadtest.stub_server --port P [--tokens-per-message 1]`.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator

import grpc

from protos.radixmesh.v1 import serving_pb2, serving_pb2_grpc
from worker.grpc_server import start_server


class StubServing(serving_pb2_grpc.ServingServicer):
    def __init__(self, tokens_per_message: int = 1) -> None:
        self.per_message = tokens_per_message

    async def Generate(
        self, request: serving_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[serving_pb2.GenerateResponse]:
        total = request.sampling.max_tokens if request.sampling.HasField("max_tokens") else 16
        prompt = len(request.token_ids.ids) or len(request.text.split()) or 1
        sent = 0
        while sent < total:
            n = min(self.per_message, total - sent)
            sent += n
            yield serving_pb2.GenerateResponse(
                request_id=request.request_id,
                token_ids=list(range(n)),
                text=" tok" * n,
                finished=sent == total,
                finish_reason="length" if sent == total else "",
                prompt_tokens=prompt,
                cached_prompt_tokens=prompt // 2,
                worker="stub",
            )

    async def GetStats(
        self, request: serving_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> serving_pb2.GetStatsResponse:
        return serving_pb2.GetStatsResponse(policy="stub", vocab_size=49_152, max_model_len=4096)


async def serve(port: int, tokens_per_message: int) -> None:
    register = [
        (
            serving_pb2_grpc.add_ServingServicer_to_server,
            StubServing(tokens_per_message),
            "radixmesh.v1.Serving",
        )
    ]
    server = await start_server(register, "127.0.0.1", port)
    print(f"stub serving on 127.0.0.1:{server.port}", flush=True)
    await server.server.wait_for_termination()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--tokens-per-message", type=int, default=1)
    args = parser.parse_args()
    asyncio.run(serve(args.port, args.tokens_per_message))
