"""Running sessions against a cluster: three arrival processes, bounds, a progress bar, over
either API (cluster/loadtest/grpc_api.py, cluster/loadtest/openai_api.py).

    closed   `concurrency` users, each running sessions back to back
    poisson  sessions start at Poisson times of `rate` per second
    trace    sessions start at their (scaled) trace timestamps

A run stops launching at `max_requests` requests or `max_seconds`, whichever comes first, and
then waits for what is in flight (each request also has its own `request_timeout`). A wait for
the next Poisson or trace arrival ends at the `max_seconds` deadline, or as soon as the request
budget is spent, so neither bound is overshot by an inter-arrival gap. One connection (a gRPC
channel, or an HTTP client's pool) serves every request; a live progress bar shows throughput
and hit rate.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

from cluster.loadtest import chaos
from cluster.loadtest.chaos import ChaosPlan
from cluster.loadtest.records import RequestRecord
from cluster.loadtest.workloads import RequestSpec, Session
from cluster.progress import progress_bar

ARRIVALS = ("closed", "poisson", "trace")


class Connection(Protocol):
    """One API's client, open for a run."""

    async def generate(
        self,
        spec: RequestSpec,
        session: Session,
        record: RequestRecord,
        now: Callable[[], float],
        timeout: float,
    ) -> None:
        """Send `spec` and fill `record` as its stream comes (`now()` stamps the first token
        and each message; counts, worker, finish reason, answer), within `timeout` seconds; a
        failure sets `record.status` and raises nothing."""
        ...

    async def healthy_workers(self) -> int:
        """The workers the router counts (for --chaos), -1 when it does not answer."""
        ...


class Endpoint(Protocol):
    """Where a run sends its requests: `grpc_api.Target` or `openai_api.HttpTarget`."""

    @property
    def api(self) -> str: ...

    def connect(self) -> AbstractAsyncContextManager[Connection]: ...


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


class Run:
    def __init__(
        self,
        target: Endpoint,
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
        self.connection: Connection
        """The endpoint's client, while `run` runs."""
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
        with progress_bar(
            TextColumn("[bold]load test[/]"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), TextColumn("{task.fields[live]}"),
            console=self.console, transient=True,
        ) as progress:  # fmt: skip
            self._task = progress.add_task("requests", total=total, live="")
            self._progress = progress
            async with self.target.connect() as connection:
                self.connection = connection
                self.began = time.perf_counter()
                event = chaos.ChaosEvent()
                watcher = None
                if self.chaos is not None:
                    watcher = asyncio.create_task(
                        chaos.watch(
                            self.chaos, event, connection.healthy_workers, self.now,
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
        await self.connection.generate(spec, session, record, self.now, self.bounds.request_timeout)
        record.end = self.now()
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
