"""Running sessions against a cluster: asyncio gRPC clients, three arrival processes, bounds.

    closed   `concurrency` users, each running sessions back to back
    poisson  sessions start at Poisson times of `rate` per second
    trace    sessions start at their (scaled) trace timestamps

A run stops launching at `max_requests` requests or `max_seconds`, whichever comes first, and
then waits for what is in flight (each request also has its own `request_timeout`). A wait for
the next Poisson or trace arrival ends at the `max_seconds` deadline, or as soon as the request
budget is spent, so neither bound is overshot by an inter-arrival gap. One channel is shared by
every request; a live progress bar shows throughput and hit rate. Requests wait for the channel
to be ready (gRPC's wait_for_ready, up to `request_timeout`), as a production client does: one
sent while the router restarts is served once it is back, not refused by a closed port (the
command's first call, the probe, still fails fast on a target that is not there).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from cluster.client_tls import ClientTls
from cluster.loadtest import chaos
from cluster.loadtest.chaos import ChaosPlan
from cluster.loadtest.records import RequestRecord
from cluster.loadtest.workloads import RequestSpec, Session
from protos.radixmesh.v1 import serving_pb2, serving_pb2_grpc

ARRIVALS = ("closed", "poisson", "trace")


@dataclass(frozen=True)
class Target:
    address: str
    token: str | None = None
    tls: ClientTls | None = None

    def channel(self) -> grpc.aio.Channel:
        options: list[tuple[str, object]] = [("grpc.max_receive_message_length", 16 << 20)]
        if self.tls is not None:
            options += self.tls.options()
            return grpc.aio.secure_channel(self.address, self.tls.credentials(), options=options)
        return grpc.aio.insecure_channel(self.address, options=options)

    @property
    def metadata(self) -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {self.token}")] if self.token else []


@dataclass(frozen=True)
class Arrivals:
    kind: str = "closed"
    concurrency: int = 8
    rate: float = 4.0
    """Sessions per second (poisson)."""
    seed: int = 0


@dataclass
class _Totals:
    requests: int = 0
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0


@dataclass
class Bounds:
    max_requests: int
    max_seconds: float = 300.0
    request_timeout: float = 120.0


def to_proto(spec: RequestSpec, session: Session, request_id: str) -> serving_pb2.GenerateRequest:
    request = serving_pb2.GenerateRequest(
        request_id=request_id,
        namespace=serving_pb2.Namespace(tenant=session.tenant, adapter=session.adapter),
        sampling=serving_pb2.SamplingParams(
            max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True
        ),
    )
    if spec.text is not None:
        request.text = spec.text
    elif spec.chat is not None:
        request.chat.messages.extend(
            serving_pb2.ChatMessage(role=r, content=c) for r, c in spec.chat
        )
    else:
        request.token_ids.ids.extend(spec.token_ids or ())
    return request


class Run:
    def __init__(
        self,
        target: Target,
        sessions: list[Session],
        arrivals: Arrivals,
        bounds: Bounds,
        console: Console | None = None,
        on_record: Callable[[RequestRecord], None] | None = None,
        chaos: ChaosPlan | None = None,
    ) -> None:
        self.target = target
        self.sessions = sessions
        self.arrivals = arrivals
        self.bounds = bounds
        self.console = console or Console(stderr=True)
        self.on_record = on_record
        self.chaos = chaos
        self.chaos_report: dict[str, object] | None = None
        self.records: list[RequestRecord] = []
        self._done = _Totals()
        """Of the completed records, for the progress bar (kept as they come, not re-summed)."""
        self.sent = 0
        self.began = 0.0
        self.duration = 0.0
        self._spent = asyncio.Event()
        """Set once `max_requests` requests have been sent."""

    def now(self) -> float:
        return time.perf_counter() - self.began

    def _budget_left(self) -> bool:
        return self.sent < self.bounds.max_requests and self.now() < self.bounds.max_seconds

    async def _pause(self, seconds: float) -> None:
        """Sleep `seconds`, but not past the `max_seconds` deadline, nor once the request budget
        is spent: a wait for the next arrival never makes the run overshoot its bounds."""
        seconds = min(seconds, self.bounds.max_seconds - self.now())
        if seconds <= 0 or self._spent.is_set():
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._spent.wait(), seconds)

    async def run(self) -> list[RequestRecord]:
        total = min(self.bounds.max_requests, sum(s.length for s in self.sessions))
        with Progress(
            TextColumn("[bold]load test[/]"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), TextColumn("{task.fields[live]}"),
            console=self.console, transient=True,
        ) as progress:  # fmt: skip
            self._task = progress.add_task("requests", total=total, live="")
            self._progress = progress
            async with self.target.channel() as channel:
                self.stub = serving_pb2_grpc.ServingStub(channel)
                self.began = time.perf_counter()
                event = chaos.ChaosEvent()
                watcher = None
                if self.chaos is not None:
                    watcher = asyncio.create_task(
                        chaos.watch(
                            self.chaos, event, self.stub, self.target.metadata, self.now,
                            self.bounds.max_seconds,
                        )
                    )  # fmt: skip
                await {
                    "closed": self._closed,
                    "poisson": self._poisson,
                    "trace": self._trace,
                }[self.arrivals.kind]()
                self.duration = self.now()
                if watcher is not None and self.chaos is not None:
                    if event.attempted_at is None:  # the requests are done: no kill now
                        watcher.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await watcher
                    self.chaos_report = chaos.account(
                        self.records, event, self.chaos, self.duration
                    )
        return self.records

    async def _closed(self) -> None:
        queue = list(reversed(self.sessions))

        async def user() -> None:
            while queue and self._budget_left():
                await self._session(queue.pop())

        await asyncio.gather(*(user() for _ in range(self.arrivals.concurrency)))

    async def _poisson(self) -> None:
        rng = random.Random(self.arrivals.seed)
        tasks = []
        for i, session in enumerate(self.sessions):
            if i:
                await self._pause(rng.expovariate(self.arrivals.rate))
            if not self._budget_left():
                break
            tasks.append(asyncio.create_task(self._session(session)))
        await asyncio.gather(*tasks)

    async def _trace(self) -> None:
        tasks = []
        for session in sorted(self.sessions, key=lambda s: s.arrival_s or 0.0):
            await self._pause((session.arrival_s or 0.0) - self.now())
            if not self._budget_left():
                break
            tasks.append(asyncio.create_task(self._session(session)))
        await asyncio.gather(*tasks)

    async def _session(self, session: Session) -> None:
        answer: str | None = None
        for turn in range(session.length):
            if not self._budget_left():
                return
            self.sent += 1
            if self.sent >= self.bounds.max_requests:
                self._spent.set()
            record = await self._request(session, turn, session.request(turn, answer))
            if not record.ok:
                return  # a conversation cannot go on without its answer
            answer = record.answer

    async def _request(self, session: Session, turn: int, spec: RequestSpec) -> RequestRecord:
        request_id = f"lt-{session.session_id}-{turn}-{self.sent}"
        record = RequestRecord(
            session.session_id, turn, request_id, session.tenant, session.adapter, self.now()
        )
        parts = []
        call = self.stub.Generate(
            to_proto(spec, session, request_id),
            metadata=self.target.metadata,
            timeout=self.bounds.request_timeout,
            wait_for_ready=True,  # as a client should: a router restarting is waited for
        )
        try:
            async for message in call:
                stamp = self.now()
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
        record.end = self.now()
        record.answer = "".join(parts)
        self.records.append(record)
        self._progress_update()
        if self.on_record is not None:
            self.on_record(record)
        return record

    def _progress_update(self) -> None:
        done, record = self._done, self.records[-1]
        if record.ok:
            done.requests += 1
            done.output_tokens += record.output_tokens
            done.prompt_tokens += record.prompt_tokens
            done.cached_prompt_tokens += record.cached_prompt_tokens
        elapsed = max(self.now(), 1e-9)
        hit = done.cached_prompt_tokens / (done.prompt_tokens or 1)
        errors = len(self.records) - done.requests
        live = f"{done.output_tokens / elapsed:7.1f} tok/s  hit {hit:6.1%}  errors {errors}"
        self._progress.update(self._task, completed=len(self.records), live=live)
