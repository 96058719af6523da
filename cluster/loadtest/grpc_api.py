"""The load test over gRPC (`--api grpc`): each request one `radixmesh.v1.Serving.Generate`
stream on a channel every request of a run shares.

Requests wait for the channel to be ready (gRPC's wait_for_ready, up to the request's
deadline), as a production client does: one sent while the router restarts is served once it
is back, not refused by a closed port (the command's first call, the probe, still fails fast on
a target that is not there). A message is a token: TTFT is the first message's arrival, an
inter-token gap the time between two messages. A failed request keeps its gRPC status name.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc

from cluster.client_tls import ClientTls
from cluster.loadtest.records import RequestRecord
from cluster.loadtest.workloads import RequestSpec, Session
from protos.radixmesh.v1 import serving_pb2, serving_pb2_grpc

TEXT_MATCH = {
    "exact": serving_pb2.TEXT_MATCH_EXACT,
    "anchored": serving_pb2.TEXT_MATCH_ANCHORED,
    "off": serving_pb2.TEXT_MATCH_OFF,
}
"""workloads.TEXT_MATCHES -> GenerateRequest.text_match."""


@dataclass(frozen=True)
class Target:
    """The router's gRPC port."""

    address: str
    token: str | None = None
    tls: ClientTls | None = None

    api = "grpc"

    def channel(self) -> grpc.aio.Channel:
        options: list[tuple[str, object]] = [("grpc.max_receive_message_length", 16 << 20)]
        if self.tls is not None:
            options += self.tls.options()
            return grpc.aio.secure_channel(self.address, self.tls.credentials(), options=options)
        return grpc.aio.insecure_channel(self.address, options=options)

    @property
    def metadata(self) -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {self.token}")] if self.token else []

    @asynccontextmanager
    async def connect(self) -> AsyncIterator[GrpcConnection]:
        async with self.channel() as channel:
            yield GrpcConnection(serving_pb2_grpc.ServingStub(channel), self.metadata)


def to_proto(spec: RequestSpec, session: Session, request_id: str) -> serving_pb2.GenerateRequest:
    request = serving_pb2.GenerateRequest(
        request_id=request_id,
        namespace=serving_pb2.Namespace(tenant=session.tenant, adapter=session.adapter),
        sampling=serving_pb2.SamplingParams(
            max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True
        ),
    )
    if session.text_match is not None:
        request.text_match = TEXT_MATCH[session.text_match]
    if spec.text is not None:
        request.text = spec.text
    elif spec.chat is not None:
        request.chat.messages.extend(
            serving_pb2.ChatMessage(role=r, content=c) for r, c in spec.chat
        )
    else:
        request.token_ids.ids.extend(spec.token_ids or ())
    return request


class GrpcConnection:
    def __init__(self, stub: serving_pb2_grpc.ServingStub, metadata: list[tuple[str, str]]):
        self.stub = stub
        self.metadata = metadata

    async def generate(
        self,
        spec: RequestSpec,
        session: Session,
        record: RequestRecord,
        now: Callable[[], float],
        timeout: float,
    ) -> None:
        parts = []
        call = self.stub.Generate(
            to_proto(spec, session, record.request_id),
            metadata=self.metadata,
            timeout=timeout,
            wait_for_ready=True,  # as a client should: a router restarting is waited for
        )
        try:
            async for message in call:
                stamp = now()
                if record.first_token is None:
                    record.first_token = stamp
                    record.prompt_tokens = message.prompt_tokens
                    record.cached_prompt_tokens = message.cached_prompt_tokens
                    record.predicted_cached_tokens = message.predicted_cached_tokens
                    record.worker = message.worker
                record.token_times.append(stamp)
                record.output_tokens += len(message.token_ids)
                parts.append(message.text)
                if message.finished:
                    record.finish_reason = message.finish_reason
        except grpc.aio.AioRpcError as err:
            record.status = err.code().name
        record.answer = "".join(parts)

    async def healthy_workers(self) -> int:
        """Workers the router reports healthy (GetStats); -1 when it does not answer (the
        router itself may be the one restarting)."""
        try:
            stats = await self.stub.GetStats(
                serving_pb2.GetStatsRequest(), metadata=self.metadata, timeout=2
            )
        except grpc.aio.AioRpcError:
            return -1
        return sum(1 for w in stats.workers if w.healthy)
