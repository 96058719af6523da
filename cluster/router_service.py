"""radixmesh.v1.Serving: the public API, served by the router.

Generate: refuse at once when too many requests are in flight (RESOURCE_EXHAUSTED: backpressure,
not an out-of-memory crash); check and tokenise the request (cluster/requests.py) on a thread,
so that a large prompt never stalls the event loop every other stream runs on; hash its prompt
into routing blocks, let the policy pick a worker, and forward the worker's stream. The client's
deadline and cancellation pass through: a client that goes away cancels the worker call, and
the worker frees the request's pages.

A worker that fails (its process died, its node went away) is detached and what is left of the
request goes to another: the request itself if the client has nothing yet, else each unfinished
sample resumed from the tokens the client already has (cluster/stream_progress.py), so the
client's stream goes on with the next token, exactly as if nothing had happened. At most
`router.max_retries` other workers are tried; then the client gets one UNAVAILABLE.

Status codes: INVALID_ARGUMENT (the message names the field), PERMISSION_DENIED (tenant not
allowed for the token), UNAUTHENTICATED (see auth.py), RESOURCE_EXHAUSTED, UNAVAILABLE (no
healthy worker, or every worker tried failed), DEADLINE_EXCEEDED, CANCELLED.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import grpc

from cache import CacheNamespace
from cluster.adapter_admin import AdapterAdmin
from cluster.auth import allowed_tenant
from cluster.config import ANY_TENANT, ClusterConfig
from cluster.grpc_tool_calls import with_tool_calls
from cluster.policies import router_config
from cluster.request_latency import CallClock, RouterLatencies
from cluster.requests import (
    PreparedRequest,
    TenantRefused,
    prepare,
    request_namespace,
    salt_unkept,
)
from cluster.serving_call import Caller, ServingError
from cluster.stream_merge import merge_streams
from cluster.stream_progress import StreamProgress
from cluster.stream_timing import StreamTiming
from cluster.tenant_usage import TenantUsageBook
from cluster.text_prompts import TextPrompts
from cluster.worker_links import ChannelClosed, WorkerLink, WorkerLinks, responses
from protos.radixmesh.v1 import serving_pb2, serving_pb2_grpc, worker_pb2
from router.interface import RouteDecision, RouteRequest
from worker.error_details import refusal_of
from worker.errors import ContextOverflow, InvalidRequest
from worker.validation import RequestLimits, crowded

log = logging.getLogger(__name__)
ANSWER_JOIN_WAIT_S = 1.0
"""How long a text prompt waits for its namespace's last answers to join the text index."""
WORKER_FAILURES = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.CANCELLED,
)
"""How a worker's call ends when the worker failed, not the request: the router tries another.
CANCELLED is a worker's server stopping under calls that had sent nothing yet (a process
killed, or a drain's grace over); the router's own cancellations never reach it as errors."""


def no_failure(err: ServingError) -> bool:
    """`generate`'s default `uncounted`: every failure is counted with its call."""
    return False


def every_failure(err: ServingError) -> bool:
    """`uncounted` for the steps of a call counted whole (`RouterService.metered_whole`)."""
    return True


@dataclass
class InFlight:
    tenant: str | None
    """The request's cache tenant: only a token for it (or for "*") may abort the request."""
    worker: str = ""
    """The worker serving it ("" until routed)."""
    worker_ids: list[str] = field(default_factory=list)
    """The ids it runs under there (one per resumed sample once migrated with n > 1)."""


@dataclass
class RouterCounters:
    routed: int = 0
    retried: int = 0
    """Times a request went to another worker after its worker failed before the first token."""
    migrated: int = 0
    """Times a request was resumed on another worker after its worker failed mid-stream."""
    predicted_cached_tokens: int = 0
    actual_cached_tokens: int = 0
    by_status: dict[str, int] = field(default_factory=dict)
    decision_seconds: float = 0.0
    http_responses: dict[tuple[str, int], int] = field(default_factory=dict)
    """HTTP answers by route and status (cluster/http/app.py)."""


class RouterService(serving_pb2_grpc.ServingServicer):
    def __init__(self, links: WorkerLinks, config: ClusterConfig) -> None:
        self.links = links
        self.config = config.router
        self.engine = config.engine
        self.security = config.security
        self.counters = RouterCounters()
        self.latencies = RouterLatencies()
        """Each call's times as its client saw them (cluster/request_latency.py)."""
        self.unmetered = RouterLatencies()
        """Where the calls not metered are timed: never exported."""
        self.tenants = TenantUsageBook(config.metrics.max_tenants)
        """What each tenant's calls used (the metrics' `tenant` label, GetStats)."""
        self.adapter_admin = AdapterAdmin(links, config)
        """Loads and unloads LoRA adapters on every worker (the Admin RPCs, the HTTP API)."""
        self.in_flight: dict[str, InFlight] = {}
        """request id -> its tenant and the worker serving it."""
        self.whole_calls = 0
        """Calls metered whole running (`metered_whole`: beam searches), which a drain waits
        for as for `in_flight`: between two of its steps a search has nothing there."""
        self.forwarded_at = 0.0
        """When the last message of any generation went to its client (time.perf_counter): a
        busy router's sign of life (cluster/http/generation_probe.py)."""
        self.priorities: Counter[int] = Counter()
        """The priorities of the calls counted against router.max_in_flight: every call from
        its check to its end, tokenising included. A call counts those of its priority or a
        more urgent one, so lower-priority work never turns a more urgent call away."""
        self.text_prompts: TextPrompts | None = None
        """The router's text index (cluster/text_prompts.py), built with the first text prompt."""
        self._text_prompts_failed: object = None
        """The tokenizer the text index could not be built for (not tried again)."""
        self.answers_joining: dict[CacheNamespace, set[asyncio.Task[None]]] = {}
        """Answers being added to the text index, by namespace."""
        # the rate the policies are built with (cluster/policies.py) stands until one is learned
        rates = router_config(config)
        self.timing = StreamTiming(
            lambda: self.links.policy,
            rates.prefill_rate,
            host_rate=rates.host_rate,
            disk_rate=rates.disk_rate,
            peer_rate=rates.peer_rate,
        )

    # -- Generate ------------------------------------------------------------------------------
    async def Generate(
        self, request: serving_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[serving_pb2.GenerateResponse]:
        caller = Caller.within(allowed_tenant(context, self.security), context.time_remaining())
        try:
            self._check_size(request)
            async for response in with_tool_calls(request, self.generate(request, caller)):
                yield response
        except ServingError as err:
            await context.abort(err.code, err.message, err.trailing_metadata())

    def _check_size(self, request: serving_pb2.GenerateRequest) -> None:
        """The gRPC server takes messages of router.max_message_bytes plus the images' allowance
        (cluster/config.py `grpc_message_bytes`); all but the images must fit the first."""
        size = request.ByteSize() - sum(len(image) for image in request.images)
        if size > self.config.max_message_bytes:
            self._count(grpc.StatusCode.RESOURCE_EXHAUSTED.name)  # a call that never began
            raise self._error(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the request is {size} bytes besides its images; at most "
                f"{self.config.max_message_bytes} (router.max_message_bytes)",
            )

    async def generate(
        self,
        request: serving_pb2.GenerateRequest,
        caller: Caller,
        fill_context: bool = False,
        image_fields: Sequence[str] = (),
        fill_cap: int | None = None,
        metered: bool = True,
        uncounted: Callable[[ServingError], bool] = no_failure,
    ) -> AsyncGenerator[serving_pb2.GenerateResponse, None]:
        """Serve one request, whatever face it came through: the stream of the worker's
        messages, or ServingError. Closing the stream early cancels the worker's call (the
        worker frees the request's pages). `fill_context`, `image_fields`, `fill_cap`: see
        cluster/requests.py `prepare`. Not `metered` (a probe's generation, SGLang's
        `log_metrics: false`): left out of the calls counted by status, their latencies and
        the tenants' usage (a refusal or failure is still counted under its status). A
        ServingError ends the call counted under its status, once, unless `uncounted` says
        whoever made the call counts it (each step of a beam search, counted as one call by
        `metered_whole`; a first attempt refused for its length, and then cut and sent
        again: cluster/http/responses_truncation.py)."""
        served = self._generate(request, caller, fill_context, image_fields, fill_cap, metered)
        try:
            async with contextlib.aclosing(served):  # closed with this: the worker call too
                async for response in served:
                    yield response
        except ServingError as err:
            if not uncounted(err):
                self._count(err.code.name)
            raise

    async def _generate(
        self,
        request: serving_pb2.GenerateRequest,
        caller: Caller,
        fill_context: bool,
        image_fields: Sequence[str],
        fill_cap: int | None,
        metered: bool,
    ) -> AsyncGenerator[serving_pb2.GenerateResponse, None]:
        """`generate`, its failures not yet counted."""
        # under fcfs every request is 0 here (a priority is refused later, in prepare)
        mine = request.priority if self.engine.scheduling_policy == "priority" else 0
        limit = self.config.max_in_flight
        says = "the limit is {} (router.max_in_flight)"
        why = crowded(self.priorities.items(), mine, limit, says)
        if why:  # refused before any tokenising
            raise self._error(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{why}; retry later")
        self.priorities[mine] += 1  # until the call ends, however it ends
        try:
            admitted = self._admitted(
                request, caller, fill_context, image_fields, fill_cap, metered
            )
            async with contextlib.aclosing(admitted):  # closed with this: the worker call too
                async for response in admitted:
                    yield response
        finally:
            self.priorities[mine] -= 1
            if not self.priorities[mine]:
                del self.priorities[mine]

    async def _admitted(
        self,
        request: serving_pb2.GenerateRequest,
        caller: Caller,
        fill_context: bool,
        image_fields: Sequence[str],
        fill_cap: int | None = None,
        metered: bool = True,
    ) -> AsyncGenerator[serving_pb2.GenerateResponse, None]:
        """`generate` once the request counts against router.max_in_flight."""
        latencies = self.latencies if metered else self.unmetered
        clock = latencies.call(embedding=request.HasField("pooling"))
        prepared = await self._prepare(
            request, caller, fill_context, image_fields, fill_cap=fill_cap
        )
        if prepared.request_id in self.in_flight:
            raise self._error(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request_id: {prepared.request_id!r} is already running",
                field="request_id",
            )
        entry = self.in_flight[prepared.request_id] = InFlight(prepared.namespace.tenant)
        progress = StreamProgress(prepared)
        done, failed = False, False
        served = self._serve(prepared, entry, caller, progress)
        try:
            async with contextlib.aclosing(served):  # closed with this: the worker call ends
                async for response in served:
                    clock.forwarded(response)
                    self.forwarded_at = clock.latest
                    if not done and all(sample.finished for sample in progress.samples):
                        done = True  # registered before the client has the last message
                        self._remember_answers(prepared, progress)
                    yield response
        except ServingError:
            failed = True  # counted under its status by `generate`
            raise
        finally:
            self.in_flight.pop(prepared.request_id, None)
            usage = clock.usage()
            if usage is not None and metered:  # however it ended: what was forwarded was used
                self.tenants.add(prepared.namespace.tenant, *usage)
            if done and not failed and metered:  # a client that stopped reading at the last
                self._ended(clock)  # message (an embedding's, over HTTP) is served all the same

    async def metered_whole(
        self,
        stream: AsyncIterator[serving_pb2.GenerateResponse],
        tenant: str | None,
        calls: int,
        samples: int,
    ) -> AsyncGenerator[serving_pb2.GenerateResponse, None]:
        """Meter, as `generate` meters a call, what requests not metered served and what
        reaches the client all at once: a beam search's best beams, found by step requests
        of their own. Each `samples` consecutive sample indices are one call, counted in the
        tenant's usage and timed once its messages come, so that the usage and the latencies
        hold the `calls` calls clients made, not the steps that served them."""
        clocks = [self.latencies.call(embedding=False) for _ in range(calls)]
        self.whole_calls += 1
        try:
            found = [response async for response in stream]
        except ServingError as err:  # its steps' are not counted: the call's is, once
            self._count(err.code.name)
            raise
        except Exception:  # a step's sample failed on its worker, as a call's that ends INTERNAL
            self._count(grpc.StatusCode.INTERNAL.name)
            raise
        finally:
            self.whole_calls -= 1
        for response in found:
            clocks[response.index // samples].forwarded(response)
        for clock in clocks:
            usage = clock.usage()
            if usage is not None:
                self.tenants.add(tenant, *usage)
                self._ended(clock)
        for response in found:
            yield response

    def _ended(self, clock: CallClock) -> None:
        """Count a call whose every sample's last message reached the router, by how its
        samples ended (an error or an abort on the worker ends a stream, not the call), and
        time it if it ended well."""
        outcome = clock.outcome()
        self._count(outcome)
        if outcome == "OK":
            clock.ended()

    def request_limits(self) -> RequestLimits | None:
        """What a request may be: the workers' model, the operator's limits (None: no worker)."""
        model = self.links.limits
        if model is None:
            return None
        vision = model.vision
        return RequestLimits.of(
            model.vocab_size,
            model.max_model_len,
            self.engine,
            vision.spec if vision else None,
            vision.limits if vision else None,
            hidden_size=model.hidden_size,
            cache_salts=model.cache_salts,
        )

    async def count_prompt(
        self,
        request: serving_pb2.GenerateRequest,
        caller: Caller,
        image_fields: Sequence[str] = (),
    ) -> list[int]:
        """The prompt ids `request` would be served with, its images placed and expanded, after
        the checks a request gets but those of its length against the context and of its
        sampling (a count may exceed the context; ServingError naming the field), without
        serving it or touching the text index (token counting: Anthropic's count_tokens, vLLM's
        /tokenize)."""
        prepared = await self._prepare(
            request, caller, True, image_fields, index_text=False, counting=True
        )
        return list(prepared.token_ids)

    async def _prepare(
        self,
        request: serving_pb2.GenerateRequest,
        caller: Caller,
        fill_context: bool,
        image_fields: Sequence[str],
        index_text: bool = True,
        counting: bool = False,
        fill_cap: int | None = None,
    ) -> PreparedRequest:
        limits = self.request_limits()
        if limits is None or not self.links.links:
            raise self._error(grpc.StatusCode.UNAVAILABLE, "no healthy worker")
        tenant, tokenizer = caller.tenant, self.links.tokenizer
        adapters = self.links.adapters()
        args = (request, tokenizer, limits, tenant, fill_context)
        try:
            ids = request.WhichOneof("prompt") == "token_ids"
            if ids and not (request.images or request.suffix):  # nothing to tokenise or decode
                return prepare(*args, None, adapters, counting=counting, fill_cap=fill_cap)
            texts = None
            # ids (with a suffix) and an image prompt bypass the text index
            if index_text and not (ids or request.images):
                texts = await self._text_prompts()
                await self._answers_joined(request, caller, adapters)
            return await asyncio.to_thread(
                prepare, *args, texts, adapters, image_fields, counting=counting, fill_cap=fill_cap
            )
        except InvalidRequest as err:
            code = grpc.StatusCode.INVALID_ARGUMENT
            anthropic = err.anthropic if isinstance(err, ContextOverflow) else None
            raise self._error(
                code, str(err), field=err.field, reason=err.reason, anthropic=anthropic
            ) from err
        except TenantRefused as err:
            raise self._error(grpc.StatusCode.PERMISSION_DENIED, str(err)) from err

    async def _text_prompts(self) -> TextPrompts | None:
        """The text index of the workers' tokenizer (a new one when the tokenizer changes).
        Built on a thread: checking the tokenizer reads its whole JSON."""
        tokenizer, section = self.links.tokenizer, self.config.text_index
        if tokenizer is None or section.max_chars == 0:
            return None
        if tokenizer is self._text_prompts_failed:
            return None
        if self.text_prompts is None or self.text_prompts.tokenizer is not tokenizer:
            try:
                self.text_prompts = await asyncio.to_thread(
                    TextPrompts, tokenizer, section.mode, section.max_chars, section.min_fraction
                )
            except Exception:  # never worth failing a request: tokenise in full instead
                log.exception("text index off: it could not be built for this tokenizer")
                self._text_prompts_failed = tokenizer
                return None
        return self.text_prompts

    def clear_text_index(self) -> None:
        if self.text_prompts is not None:
            self.text_prompts.clear()

    def _remember_answers(self, prepared: PreparedRequest, progress: StreamProgress) -> None:
        """A finished text prompt's answers join the text index, on a thread, registered
        before the last message goes out: the namespace's next text prompt waits for them (a
        client sends its next turn as soon as it has this one's last message)."""
        turn, texts = prepared.text_turn, self.text_prompts
        if turn is None or texts is None:
            return
        samples = [sample.token_ids for sample in progress.samples]
        task = asyncio.get_running_loop().create_task(
            asyncio.to_thread(texts.finished, turn, samples)
        )
        pending = self.answers_joining.setdefault(prepared.namespace, set())
        pending.add(task)

        def joined(task: asyncio.Task[None]) -> None:
            pending.discard(task)
            if not pending and self.answers_joining.get(prepared.namespace) is pending:
                del self.answers_joining[prepared.namespace]

        task.add_done_callback(joined)

    async def _answers_joined(
        self, request: serving_pb2.GenerateRequest, caller: Caller, adapters: dict[str, str]
    ) -> None:
        """Until the answers of the namespace's finished requests are in the text index (at most
        ANSWER_JOIN_WAIT_S: they take milliseconds)."""
        namespace = request_namespace(request, caller.tenant, adapters)
        pending = self.answers_joining.get(namespace)
        if pending:
            await asyncio.wait(set(pending), timeout=ANSWER_JOIN_WAIT_S)

    async def _serve(
        self,
        prepared: PreparedRequest,
        entry: InFlight,
        caller: Caller,
        progress: StreamProgress,
    ) -> AsyncGenerator[serving_pb2.GenerateResponse, None]:
        assert self.links.hasher is not None
        hashes = tuple(self.links.hasher.hashes(prepared.routing_keys, prepared.namespace))
        route = RouteRequest(
            prepared.request_id,
            prepared.namespace,
            hashes,
            len(prepared.token_ids),
            prepared.priority,
        )
        failure = ""
        for attempt in range(self.config.max_retries + 1):
            if not self.links.links:
                left = f"{failure}; no healthy worker is left" if failure else "no healthy worker"
                raise self._error(grpc.StatusCode.UNAVAILABLE, left)
            if attempt and progress.started:
                self.counters.migrated += 1
            elif attempt:
                self.counters.retried += 1
            began = time.perf_counter()
            decision = self.links.policy.route(route)
            self.counters.decision_seconds += time.perf_counter() - began
            link = self.links.links[decision.worker]
            if prepared.namespace.salt is not None and not link.info.cache_salts:
                self.links.policy.finished(link.name, prepared.request_id)
                raise self._refused_salt()  # the worker attached after the request was checked
            self.counters.routed += 1
            self.counters.predicted_cached_tokens += decision.predicted_cached_tokens
            requests = progress.worker_requests(
                decision.predicted_cached_tokens, hashes, self._kv_peer(route, decision)
            )
            entry.worker, entry.worker_ids = link.name, [r.request_id for r in requests]
            calls = [link.stub.Generate(r, timeout=caller.time_remaining()) for r in requests]
            try:
                async for response in self._forward(link, calls, requests, progress):
                    yield response
                return
            except (grpc.aio.AioRpcError, ChannelClosed) as err:
                failure = await self._worker_failed(link, err, progress, attempt)
            finally:
                for call in calls:  # a no-op on a stream that ended; frees the worker's pages
                    call.cancel()
                if self.links.links.get(link.name) is link:  # not detached (or replaced) since
                    self.links.policy.finished(link.name, prepared.request_id)

    def _refused_salt(self) -> ServingError:
        refusal = salt_unkept()
        return self._error(grpc.StatusCode.INVALID_ARGUMENT, str(refusal), field=refusal.field)

    def _kv_peer(self, route: RouteRequest, decision: RouteDecision) -> worker_pb2.KvPeer | None:
        """The worker holding at least `peer_kv_min_tokens` more of the prompt in memory than
        the one chosen, if any (router.peer_kv_min_tokens; worker/peer_reads.py)."""
        least = self.config.peer_kv_min_tokens
        if not least:
            return None
        holder = self.links.policy.deeper_holder(route, decision.worker, least)
        if holder is None:
            return None
        link = self.links.links.get(holder[0])
        if link is None:
            return None
        return worker_pb2.KvPeer(worker=link.name, address=link.address, positions=holder[1])

    async def _forward(
        self,
        link: WorkerLink,
        calls: list[grpc.aio.UnaryStreamCall],
        requests: list[worker_pb2.WorkerGenerateRequest],
        progress: StreamProgress,
    ) -> AsyncIterator[serving_pb2.GenerateResponse]:
        """Relay one worker's stream(s) to the client, keeping `progress` of what it has."""
        public_id = progress.prepared.request_id
        dispatches = [self.timing.dispatched(link.name, len(r.token_ids)) for r in requests]
        answered = False
        try:
            async for which, response in merge_streams([responses(call) for call in calls]):
                self.timing.responded(
                    dispatches[which],
                    response.index,
                    len(response.token_ids),
                    response.cached_prompt_tokens,
                    response.host_cached_tokens,
                    response.disk_cached_tokens,
                    response.peer_cached_tokens,
                )
                if not answered:
                    answered = True
                    if self.links.links.get(link.name) is link:
                        self.links.policy.prefill_done(link.name, public_id)
                    if not progress.started:
                        self.counters.actual_cached_tokens += response.cached_prompt_tokens
                progress.record(response)
                response.request_id = public_id  # a worker runs each call under its own id
                yield response
        finally:
            for dispatch in dispatches:
                self.timing.ended(dispatch)

    async def _worker_failed(
        self,
        link: WorkerLink,
        err: grpc.aio.AioRpcError | ChannelClosed,
        progress: StreamProgress,
        attempt: int,
    ) -> str:
        """Detach a failed worker and say what failed (the caller tries another), or end the
        call: the worker refused the request for a reason of its own, or no attempt is left."""
        attached = self.links.links.get(link.name) is link
        if isinstance(err, grpc.aio.AioRpcError):
            code, details = err.code(), err.details() or str(err.code())
            if code not in WORKER_FAILURES and attached:  # detached: its channel was closed
                field, reason = refusal_of(err)
                raise self._error(code, details, field=field, reason=reason)
        else:
            details = str(err)
        request_id = progress.prepared.request_id
        log.warning("worker %s failed on %s: %s", link.name, request_id, details)
        if attached:
            await self.links.detach(link.name)
        when = "mid-stream" if progress.started else "before the first token"
        failure = f"worker {link.name} failed {when} ({details})"
        if attempt == self.config.max_retries:
            raise self._error(
                grpc.StatusCode.UNAVAILABLE,
                f"{failure} and {self.config.max_retries} other worker(s) were tried "
                "(router.max_retries)",
            )
        return failure

    def _error(
        self,
        code: grpc.StatusCode,
        details: str,
        *,
        field: str | None = None,
        reason: str | None = None,
        anthropic: str | None = None,
    ) -> ServingError:
        """The error to raise (counted under its status where its call ends: `generate`)."""
        return ServingError(code, details, field=field, reason=reason, anthropic=anthropic)

    def busy(self) -> bool:
        """Whether a call is running: one taken (`priorities`, from before its prompt is
        tokenised, where `in_flight` has it only after), or a call metered whole between two
        of its steps."""
        return bool(self.priorities or self.whole_calls)

    def count_failure(self, err: ServingError) -> None:
        """Count under its status a failure a call's maker counts (`generate`'s `uncounted`)."""
        self._count(err.code.name)

    def _count(self, status: str) -> None:
        self.counters.by_status[status] = self.counters.by_status.get(status, 0) + 1

    # -- Abort and GetStats --------------------------------------------------------------------
    async def Abort(
        self, request: serving_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> serving_pb2.AbortResponse:
        tenant = allowed_tenant(context, self.security)
        return serving_pb2.AbortResponse(found=await self.abort(request.request_id, tenant))

    async def abort(self, request_id: str, tenant: str) -> bool:
        """End a request in flight (its samples finish with reason `abort`) if `tenant` may:
        its own, or any for a token bound to every tenant. Whether one was found."""
        entry = self.in_flight.get(request_id)
        if entry is None or tenant not in (ANY_TENANT, entry.tenant):  # not another tenant's
            return False
        link = self.links.links.get(entry.worker)
        if link is None:
            return False
        answers = [
            await link.stub.Abort(serving_pb2.AbortRequest(request_id=worker_id))
            for worker_id in entry.worker_ids
        ]
        return any(a.found for a in answers)

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
        tenants, uncounted = self._tenant_stats(allowed_tenant(context, self.security))
        return serving_pb2.GetStatsResponse(
            vocab_size=limits.vocab_size if limits else 0,
            max_model_len=limits.max_model_len if limits else 0,
            policy=self.links.policy.name,
            requests_routed=c.routed,
            requests_retried=c.retried,
            requests_migrated=c.migrated,
            requests_in_flight=len(self.in_flight),
            predicted_cached_tokens=c.predicted_cached_tokens,
            actual_cached_tokens=c.actual_cached_tokens,
            workers=workers,
            index_bytes=self.links.policy.index_bytes(),
            text_index=self._text_index_stats(),
            tenants=tenants,
            uncounted_tenant_requests=uncounted,
        )

    def _tenant_stats(self, allowed: str) -> tuple[list[serving_pb2.TenantStats], int]:
        """The tenants' usage a caller may see: every tenant's with a token for "*", else its
        own tenant's alone."""
        every = allowed == ANY_TENANT
        rows = [
            serving_pb2.TenantStats(
                tenant=name,
                requests=usage.requests,
                prompt_tokens=usage.prompt_tokens,
                cached_tokens=usage.cached_tokens,
                generated_tokens=usage.generated_tokens,
            )
            for name, usage in self.tenants.tenants.items()
            if every or name == allowed
        ]
        return rows, self.tenants.uncounted_requests if every else 0

    def _text_index_stats(self) -> serving_pb2.TextIndexStats:
        texts = self.text_prompts
        if texts is None:
            return serving_pb2.TextIndexStats(mode=self.config.text_index.mode)
        t, index = texts.counters, texts.index.stats()
        return serving_pb2.TextIndexStats(
            mode=texts.mode(serving_pb2.TEXT_MATCH_DEFAULT),
            chars=index.chars,
            nodes=index.nodes,
            prompts=t.prompts,
            prompt_chars=t.prompt_chars,
            reused_chars=t.reused_chars,
            tokenized_chars=t.tokenized_chars,
            backoff_tokens=t.backoff_tokens,
            evicted_chars=index.evicted_chars,
        )
