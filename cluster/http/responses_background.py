"""Background responses (`background: true`, OpenAI's and vLLM's): the request is answered at
once with the response `queued`, stored; the generation runs on the router's event loop, apart
from the HTTP request, and stores the response as it goes (`in_progress` as it starts) and as
it ends. The client polls `GET /v1/responses/{id}` and may `POST .../cancel`.

With `stream: true` its events (cluster/http/responses_stream.py, as a streamed response's)
are kept in an `EventLog`: the POST answers with them, and `GET /v1/responses/{id}?stream=true`
(`starting_after=N`) follows them from any point, while the generation runs and, within
`ENDED_LOG_BYTES` with the running ones', after it ended.

A generation that is refused (a prompt over the context, say) or fails ends the response
`failed`, with the error; a cancelled one ends it `cancelled`, with what it wrote. Either way
the worker's call is closed and its pages freed, as for a client that leaves a stream.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import Callable

from cluster.http.errors import HttpError, Renames
from cluster.http.event_log import EventLog
from cluster.http.openai_responses import Responses
from cluster.http.responses_schema import Response
from cluster.http.responses_stream import events
from cluster.http.token_texts import TokenTexts

Keep = Callable[[Response], Response]
"""Stores a response as it stands; returns it as stored."""
ENDED_LOG_BYTES = 32 << 20
"""The events kept of background responses that ended, most recent first, while these and
the running ones' take no more."""


class BackgroundResponses:
    """The background generations running, and the events of each, by (tenant, response id)."""

    def __init__(self, ended_log_bytes: int = ENDED_LOG_BYTES) -> None:
        self._running: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._logs: dict[tuple[str, str], EventLog] = {}
        """Of the generations running."""
        self._ended: OrderedDict[tuple[str, str], EventLog] = OrderedDict()
        """Of those that ended, least recent first, within `ended_log_bytes`."""
        self._ended_log_bytes = ended_log_bytes
        self._ended_bytes = 0
        self._closing = False

    def __len__(self) -> int:
        return len(self._running)

    async def start(
        self,
        tenant: str,
        queued: Response,
        stream: Responses,
        tools: frozenset[str],
        rename: Renames,
        keep: Keep,
        streamed: bool = False,
        texts: TokenTexts | None = None,
    ) -> tuple[Response, EventLog]:
        """Store `queued` and run its generation (`stream`) to the end; the response as stored,
        and its events (kept when `streamed`, to be resumed). Refused (the stream closed)
        while one of its id runs, when the store cannot hold it (nobody could poll it), and
        once the router is stopping."""
        key = (tenant, queued.id)
        refusal = None
        if self._closing:
            refusal = HttpError(503, "the router is stopping; retry on another")
        elif key in self._running:
            refusal = HttpError(
                400,
                f"X-Request-Id: a background response of this id ({queued.id}) is running; "
                "send another request id",
            )
        stored = keep(queued) if refusal is None else queued
        if refusal is None and not stored.store:
            refusal = HttpError.invalid(
                "background", "the response is larger than the router's whole store"
            )
        if refusal is not None:
            await stream.aclose()
            raise refusal
        self.drop(tenant, queued.id)  # an ended one of the same id: its events are not these
        written = EventLog(kept=streamed)
        task = asyncio.get_running_loop().create_task(
            _generate(queued, stream, tools, rename, keep, written, texts),
            name=f"background {queued.id}",
        )
        self._running[key], self._logs[key] = task, written

        def finished(task: asyncio.Task[None]) -> None:
            del self._running[key], self._logs[key]
            written.close()  # first: whatever follows, no reader waits on it
            if written.kept:
                self._keep_ended(key, written)

        task.add_done_callback(finished)
        await asyncio.sleep(0)  # its first step (created, in_progress, stored) before anything
        # can cancel it: a cancellation then always finds the events' handler, which stores it
        return stored, written

    def events(self, tenant: str, response_id: str) -> EventLog | None:
        """The events of the tenant's background response of that id, if still kept."""
        key = (tenant, response_id)
        written = self._logs.get(key) or self._ended.get(key)
        return written if written is not None and written.kept else None

    async def cancel(self, tenant: str, response_id: str) -> bool:
        """Cancel the tenant's running generation of that id and wait for it to store the
        response `cancelled`; False when none of that id is running."""
        task = self._running.get((tenant, response_id))
        if task is None:
            return False
        task.cancel()
        await asyncio.wait([task])
        return True

    def drop(self, tenant: str, response_id: str) -> None:
        """Forget the events of an ended response (deleted, or its id used again)."""
        log = self._ended.pop((tenant, response_id), None)
        if log is not None:
            self._ended_bytes -= log.bytes

    async def close(self) -> None:
        """Cancel every generation still running, and refuse new ones (the router stopping)."""
        self._closing = True
        tasks = list(self._running.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    def _keep_ended(self, key: tuple[str, str], log: EventLog) -> None:
        """Keep an ended log, the least recent dropped first, while the ended and the running
        logs hold no more than the bound."""
        running = sum(each.bytes for each in self._logs.values())
        if running + log.bytes > self._ended_log_bytes:
            return
        self._ended[key] = log
        self._ended_bytes += log.bytes
        while running + self._ended_bytes > self._ended_log_bytes:
            _, dropped = self._ended.popitem(last=False)
            self._ended_bytes -= dropped.bytes


async def _generate(
    queued: Response,
    stream: Responses,
    tools: frozenset[str],
    rename: Renames,
    keep: Keep,
    written: EventLog,
    texts: TokenTexts | None = None,
) -> None:
    """Run the generation, its events into `written` (the response stored by `events`; the
    log closed by the task's done-callback, however it ends)."""
    generated = events(queued, None, stream, tools, keep, rename, texts)
    async with contextlib.aclosing(generated) as out:
        async for chunk in out:
            written.append(chunk)
