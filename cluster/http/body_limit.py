"""Request bodies over the limit (`router.max_message_bytes`, as gRPC's messages, and for a vision
model its images' allowance: cluster/http/image_parts.py) are refused with 413 before the app
parses a byte of them, and headers over `MAX_HEADER_BYTES` in all with 431 (httptools reads
headers of any size). The limit is asked for at each request: it follows the workers' model.

A refusal reads the rest of the body first, and drops it: closing with the body's bytes unread
in the kernel makes the kernel send a reset that can overtake the answer's last segment (the
OpenAI SDK then saw a connection error, or half a chunked body, where a 413 was sent), and
answering first leaves uvicorn dropping the rest itself, with its idle timer off and no bound.
The read is bounded as nginx bounds its lingering close: `DISCARD_SECONDS` in all, at most
`DISCARD_GAP_S` between two reads, and here `DISCARD_BYTES`. Past a bound, or for a body
declared larger than `DISCARD_BYTES`, the answer closes the connection; it closes it too when
the client waits for `100 Continue` before sending a body it was never asked for.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cluster.http.errors import HttpError

MAX_HEADER_BYTES = 32 << 10
"""Of all a request's header names and values together (nginx's default allows 32 KiB)."""
DISCARD_BYTES = 256 << 20
"""The most bytes of a refused body read and dropped before its answer."""
DISCARD_SECONDS = 30.0
"""The longest a refused body is read for (nginx's lingering_time)."""
DISCARD_GAP_S = 5.0
"""The longest wait for the next piece of a refused body (nginx's lingering_timeout)."""


class BodyLimit:
    def __init__(
        self,
        app: ASGIApp,
        limit: Callable[[str, dict[bytes, bytes]], tuple[int, str]],
        body: Callable[[str, HttpError], Any],
    ):
        self.app = app
        self.limit = limit
        """The most bytes a body to a path, with these headers, may have now, and what sets it
        (named in the 413)."""
        self.body = body
        """The error body for a path (each API writes its errors its own way)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        declared = _declared(headers)
        header_bytes = sum(len(name) + len(value) for name, value in scope["headers"])
        if header_bytes > MAX_HEADER_BYTES:
            error = HttpError(
                431, f"the request's headers are {header_bytes} bytes; at most {MAX_HEADER_BYTES}"
            )
            await self._refuse(scope, receive, send, error, headers)
            return
        max_bytes, source = self.limit(scope["path"], headers)
        says = "the request body is {} bytes or more; the limit is {} ({})"
        if declared > max_bytes:
            error = HttpError(413, says.format(declared, max_bytes, source))
            await self._refuse(scope, receive, send, error, headers)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: let the app see it
                await self.app(scope, _replay([message], receive), send)
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > max_bytes:
                error = HttpError(413, says.format(size, max_bytes, source))
                await self._refuse(scope, receive, send, error, headers, begun=True, more=more)
                return
            if not more:
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([body], receive), send)

    async def _refuse(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        error: HttpError,
        headers: dict[bytes, bytes],
        *,
        begun: bool = False,
        more: bool = True,
    ) -> None:
        """Answer `error` once what is left of the body is read and dropped (`begun`: some of
        it was read, `more`: and not all), within the DISCARD bounds; past them, with a client
        that waits for `100 Continue` before a body it was never asked for, or with a body
        declared larger than DISCARD_BYTES, the answer closes the connection."""
        declared = _declared(headers)
        chunked = b"chunked" in headers.get(b"transfer-encoding", b"").lower()
        waits = headers.get(b"expect", b"").lower() == b"100-continue"
        if not more or not (declared or chunked):
            close = False  # nothing left to read
        elif declared > DISCARD_BYTES or (waits and not begun):
            close = True
        else:
            close = not await _dropped(receive)
        content = json.dumps(self.body(scope["path"], error)).encode()
        answer = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(content)).encode()),
        ]
        if close:
            answer.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": error.status, "headers": answer})
        await send({"type": "http.response.body", "body": content})


def _declared(headers: dict[bytes, bytes]) -> int:
    """The body's length as its Content-Length says; 0 without one (or a chunked body)."""
    length = headers.get(b"content-length", b"")
    return int(length) if length.isdigit() else 0


async def _dropped(receive: Receive) -> bool:
    """Read the rest of a body and drop it: whether it ended within the DISCARD bounds."""
    loop = asyncio.get_running_loop()
    deadline, dropped = loop.time() + DISCARD_SECONDS, 0
    while dropped <= DISCARD_BYTES:
        wait = min(DISCARD_GAP_S, deadline - loop.time())
        if wait <= 0:
            return False
        try:
            message = await asyncio.wait_for(receive(), wait)
        except TimeoutError:
            return False
        if message["type"] != "http.request":  # the client went away
            return False
        dropped += len(message.get("body", b""))
        if not message.get("more_body", False):
            return True
    return False


def _replay(messages: list[Message], receive: Receive) -> Receive:
    async def replayed() -> Message:
        return messages.pop(0) if messages else await receive()

    return replayed
