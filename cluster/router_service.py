"""radixmesh.v1.Serving: the public API, served by the router.

Generate: check and tokenise the request (cluster/requests.py), refuse it at once when too many
are in flight (RESOURCE_EXHAUSTED: backpressure, not an out-of-memory crash), hash its prompt into
routing blocks, let the policy pick a worker, and forward the worker's stream. The client's
deadline and cancellation pass through: a client that goes away cancels the worker call, and the
worker frees the request's pages. A worker that fails before the first token is detached and the
request is retried on another; after the first token the request ends with UNAVAILABLE (its
tokens cannot be taken back).

Status codes: INVALID_ARGUMENT (the message names the field), PERMISSION_DENIED (tenant not
allowed for the token), UNAUTHENTICATED (see auth.py), RESOURCE_EXHAUSTED, UNAVAILABLE (no
healthy worker, or the worker failed mid-stream), DEADLINE_EXCEEDED, CANCELLED.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from cluster.auth import allowed_tenant
from cluster.config import ANY_TENANT, ClusterConfig
from cluster.policies import router_config
from cluster.requests import PreparedRequest, TenantRefused, prepare
from cluster.stream_timing import StreamTiming
from cluster.worker_links import WorkerLinks
from protos.radixmesh.v1 import serving_pb2, serving_pb2_grpc, worker_pb2
from router.interface import RouteRequest
from worker.errors import InvalidRequest
from worker.validation import PromptTokenizer
from worker.wire import namespace_to_proto, sampling_to_proto

log = logging.getLogger(__name__)
WORKER_FAILURES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)


@dataclass
class InFlight:
    tenant: str | None
    """The request's cache tenant: only a token for it (or for "*") may abort the request."""
    worker: str = ""
    """The worker serving it ("" until routed)."""


@dataclass
class RouterCounters:
    routed: int = 0
    retried: int = 0
    predicted_cached_tokens: int = 0
    actual_cached_tokens: int = 0
    by_status: dict[str, int] = field(default_factory=dict)
    decision_seconds: float = 0.0


class RouterService(serving_pb2_grpc.ServingServicer):
    def __init__(
        self,
        links: WorkerLinks,
        tokenizer: PromptTokenizer | None,
        config: ClusterConfig,
    ) -> None:
        self.links = links
        self.tokenizer = tokenizer
        self.config = config.router
        self.security = config.security
        self.counters = RouterCounters()
        self.in_flight: dict[str, InFlight] = {}
        """request id -> its tenant and the worker serving it."""
        # the rate the policies are built with (cluster/policies.py) stands until one is learned
        self.timing = StreamTiming(lambda: self.links.policy, router_config(config).prefill_rate)

    # -- Generate ------------------------------------------------------------------------------
    async def Generate(
        self, request: serving_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[serving_pb2.GenerateResponse]:
        if len(self.in_flight) >= self.config.max_in_flight:  # refused before any tokenising
            await self._abort(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{len(self.in_flight)} requests in flight, the limit is "
                f"{self.config.max_in_flight}; retry later",
            )
        prepared = await self._prepare(request, context)
        if prepared.request_id in self.in_flight:
            await self._abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request_id: {prepared.request_id!r} is already running",
            )
        entry = self.in_flight[prepared.request_id] = InFlight(prepared.namespace.tenant)
        try:
            async for response in self._serve(prepared, entry, context):
                yield response
            self._count("OK")
        finally:
            self.in_flight.pop(prepared.request_id, None)

    async def _prepare(
        self, request: serving_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> PreparedRequest:
        limits = self.links.limits
        if limits is None or not self.links.links:
            await self._abort(context, grpc.StatusCode.UNAVAILABLE, "no healthy worker")
        assert limits is not None
        try:
            tenant = allowed_tenant(context, self.security)
            return prepare(request, self.tokenizer, limits, tenant)
        except InvalidRequest as err:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except TenantRefused as err:
            await self._abort(context, grpc.StatusCode.PERMISSION_DENIED, str(err))
        raise AssertionError("unreachable: context.abort raises")

    async def _serve(
        self, prepared: PreparedRequest, entry: InFlight, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[serving_pb2.GenerateResponse]:
        assert self.links.hasher is not None
        hashes = tuple(self.links.hasher.hashes(prepared.token_ids, prepared.namespace))
        route = RouteRequest(
            prepared.request_id, prepared.namespace, hashes, len(prepared.token_ids)
        )
        for attempt in range(self.config.max_retries + 1):
            if not self.links.links:
                await self._abort(context, grpc.StatusCode.UNAVAILABLE, "no healthy worker")
            began = time.perf_counter()
            decision = self.links.policy.route(route)
            self.counters.decision_seconds += time.perf_counter() - began
            self.counters.routed += 1
            self.counters.predicted_cached_tokens += decision.predicted_cached_tokens
            link = self.links.links[decision.worker]
            entry.worker = link.name
            call = link.stub.Generate(
                worker_pb2.WorkerGenerateRequest(
                    request_id=prepared.request_id,
                    token_ids=list(prepared.token_ids),
                    namespace=namespace_to_proto(prepared.namespace),
                    sampling=sampling_to_proto(prepared.sampling),
                    predicted_cached_tokens=decision.predicted_cached_tokens,
                ),
                timeout=context.time_remaining(),
            )
            started = False
            dispatch = self.timing.dispatched(link.name, route.num_tokens)
            try:
                async for response in call:
                    self.timing.responded(
                        dispatch,
                        response.index,
                        len(response.token_ids),
                        response.cached_prompt_tokens,
                    )
                    if not started:
                        started = True
                        if self.links.links.get(link.name) is link:
                            self.links.policy.prefill_done(link.name, prepared.request_id)
                        self.counters.actual_cached_tokens += response.cached_prompt_tokens
                    yield response
                return
            except grpc.aio.AioRpcError as err:
                if err.code() not in WORKER_FAILURES:
                    await self._abort(context, err.code(), err.details() or str(err.code()))
                log.warning("worker %s failed on %s: %s", link.name, prepared.request_id, err)
                await self.links.detach(link.name)
                if started or attempt == self.config.max_retries:
                    await self._abort(
                        context,
                        grpc.StatusCode.UNAVAILABLE,
                        f"worker {link.name} failed "
                        f"{'mid-stream' if started else 'before the first token'}: "
                        f"{err.details()}",
                    )
                self.counters.retried += 1
            finally:
                self.timing.ended(dispatch)
                call.cancel()  # a no-op when the stream ended; frees the worker's pages otherwise
                if self.links.links.get(link.name) is link:  # not detached (or replaced) since
                    self.links.policy.finished(link.name, prepared.request_id)

    async def _abort(
        self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str
    ) -> None:
        self._count(code.name)
        await context.abort(code, details)

    def _count(self, status: str) -> None:
        self.counters.by_status[status] = self.counters.by_status.get(status, 0) + 1

    # -- Abort and GetStats --------------------------------------------------------------------
    async def Abort(
        self, request: serving_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> serving_pb2.AbortResponse:
        entry = self.in_flight.get(request.request_id)
        tenant = allowed_tenant(context, self.security)
        if entry is None or tenant not in (ANY_TENANT, entry.tenant):  # not another tenant's
            return serving_pb2.AbortResponse(found=False)
        link = self.links.links.get(entry.worker)
        if link is None:
            return serving_pb2.AbortResponse(found=False)
        return await link.stub.Abort(serving_pb2.AbortRequest(request_id=request.request_id))

    async def GetStats(
        self, request: serving_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> serving_pb2.GetStatsResponse:
        links = list(self.links.links.values())
        answers = await asyncio.gather(
            *(link.stub.GetStats(request, timeout=5) for link in links), return_exceptions=True
        )
        workers = []
        for link, answer in zip(links, answers, strict=True):
            if isinstance(answer, BaseException):
                workers.append(serving_pb2.WorkerStats(worker=link.name, healthy=False))
            else:
                answer.address = link.address
                workers.append(answer)
        c = self.counters
        limits = self.links.limits
        return serving_pb2.GetStatsResponse(
            vocab_size=limits.vocab_size if limits else 0,
            max_model_len=limits.max_model_len if limits else 0,
            policy=self.links.policy.name,
            requests_routed=c.routed,
            requests_retried=c.retried,
            requests_in_flight=len(self.in_flight),
            predicted_cached_tokens=c.predicted_cached_tokens,
            actual_cached_tokens=c.actual_cached_tokens,
            workers=workers,
            index_bytes=self.links.policy.index_bytes(),
        )
