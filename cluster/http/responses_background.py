"""Background responses (`background: true`, OpenAI's and vLLM's): the request is answered at
once with the response `queued`, stored; the generation runs on the router's event loop, apart
from the HTTP request, and stores the response as it goes (`in_progress` as it starts) and as
it ends. The client polls `GET /v1/responses/{id}` and may `POST .../cancel`.

Its events (cluster/http/responses_stream.py, as a streamed response's) go to an `EventLog`:
with `stream: true` the POST answers with them, and `GET /v1/responses/{id}?stream=true`
(`starting_after=N`) follows them from any point, while the generation runs and, within
`ENDED_LOG_BYTES`, after it ended.

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
from cluster.http.openai_responses import Counts, Responses
from cluster.http.responses_output import done
from cluster.http.responses_schema import Response
from cluster.http.responses_stream import events

Keep = Callable[[Response], Response]
"""Stores a response as it stands; returns it as stored."""
ENDED_LOG_BYTES = 32 << 20
"""The events kept of background responses that ended, most recent first."""


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
    ) -> tuple[Response, EventLog]:
        """Store `queued` and run its generation (`stream`) to the end; the response as stored,
        and its events. Refused (the stream closed) while one of its id runs, or when the store
        cannot hold it: nobody could poll it."""
        key = (tenant, queued.id)
        if key in self._running:
            await stream.aclose()
            raise HttpError(
                400,
                f"X-Request-Id: a background response of this id ({queued.id}) is running; "
                "send another request id",
            )
        stored = keep(queued)
        if not stored.store:
            await stream.aclose()
            raise HttpError.invalid(
                "background", "the response is larger than the router's whole store"
            )
        self.drop(tenant, queued.id)  # an ended one of the same id: its events are not these
        written = EventLog()
        task = asyncio.get_running_loop().create_task(
            _generate(queued, stream, tools, rename, keep, written), name=f"background {queued.id}"
        )
        self._running[key], self._logs[key] = task, written

        def finished(task: asyncio.Task[None]) -> None:
            del self._running[key], self._logs[key]
            if task.cancelled() and not written.closed:  # before its first step: still queued
                keep(done(queued, None, [], None, Counts(), cancelled=True))
            written.close()
            self._keep_ended(key, written)

        task.add_done_callback(finished)
        return stored, written

    def events(self, tenant: str, response_id: str) -> EventLog | None:
        """The events of the tenant's background response of that id, if still kept."""
        key = (tenant, response_id)
        return self._logs.get(key) or self._ended.get(key)

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
        """Cancel every generation still running (the router stopping)."""
        tasks = list(self._running.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    def _keep_ended(self, key: tuple[str, str], log: EventLog) -> None:
        if log.bytes > self._ended_log_bytes:
            return
        self._ended[key] = log
        self._ended_bytes += log.bytes
        while self._ended_bytes > self._ended_log_bytes:
            _, dropped = self._ended.popitem(last=False)
            self._ended_bytes -= dropped.bytes


async def _generate(
    queued: Response,
    stream: Responses,
    tools: frozenset[str],
    rename: Renames,
    keep: Keep,
    written: EventLog,
) -> None:
    """Run the generation, its events into `written` (the response stored by `events`)."""
    try:
        async with contextlib.aclosing(events(queued, None, stream, tools, keep, rename)) as out:
            async for chunk in out:
                written.append(chunk)
    finally:
        written.close()
