"""Server-sent events that stop the moment the client goes away.

Starlette's StreamingResponse notices a disconnect only when a write fails (ASGI 2.4 servers), so
a stream waiting on a long prefill would hold its request, and the worker's pages, until its next
token. `EventStream` listens for the disconnect while it streams and cancels the stream then:
the serving core's cleanup cancels the worker call and the worker frees the request's pages.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


class EventStream(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], headers: dict[str, str] | None = None) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})}
        super().__init__(events, headers=headers)
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def run(job: Callable[[], Awaitable[None]]) -> None:
                    try:
                        await job()
                    except OSError:  # the client went away while we wrote to it
                        pass
                    finally:
                        group.cancel_scope.cancel()

                group.start_soon(run, lambda: self.stream_response(send))
                await run(lambda: self.listen_for_disconnect(receive))
        finally:
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()


async def until_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """`awaitable`'s result, or ClientGone as soon as the client disconnects (the work is then
    cancelled, and with it the request's worker call)."""
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
    if work.cancelled():
        raise ClientGone()
    return work.result()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
