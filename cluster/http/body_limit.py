"""Request bodies over the limit (`router.max_message_bytes`, as gRPC's messages, and for a vision
model its images' allowance: cluster/http/image_parts.py) are refused with 413 before the app
parses a byte of them, and headers over `MAX_HEADER_BYTES` in all with 431 (httptools reads
headers of any size). The limit is asked for at each request: it follows the workers' model.

A refusal keeps the connection open, and uvicorn reads and drops the rest of the body, so the
client reads its 413 whole. Closing instead, with the body's bytes unread in the kernel, makes
the kernel send a reset that can overtake the answer's last segment: the OpenAI SDK then saw a
connection error (or half a chunked body) where a 413 was sent. A body declared larger than
`DISCARD_BYTES` is not worth reading to its end: its refusal closes the connection (nginx's
lingering close makes the same trade)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cluster.http.errors import HttpError

MAX_HEADER_BYTES = 32 << 10
"""Of all a request's header names and values together (nginx's default allows 32 KiB)."""
DISCARD_BYTES = 256 << 20
"""The most bytes of a refused body read and dropped to keep its connection open."""


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
        length = headers.get(b"content-length", b"")
        declared = int(length) if length.isdigit() else 0
        header_bytes = sum(len(name) + len(value) for name, value in scope["headers"])
        if header_bytes > MAX_HEADER_BYTES:
            error = HttpError(
                431, f"the request's headers are {header_bytes} bytes; at most {MAX_HEADER_BYTES}"
            )
            await self._send(scope, send, error, unread=declared)
            return
        max_bytes, source = self.limit(scope["path"], headers)
        if declared > max_bytes:
            await self._refuse(scope, send, declared, max_bytes, source, unread=declared)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: let the app see it
                await self.app(scope, _replay([message], receive), send)
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > max_bytes:  # what is left of a chunked body is unknown: dropped
                await self._refuse(scope, send, size, max_bytes, source, unread=0)
                return
            if not message.get("more_body", False):
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([body], receive), send)

    async def _refuse(
        self,
        scope: Scope,
        send: Send,
        size: int,
        max_bytes: int,
        source: str,
        *,
        unread: int,
    ) -> None:
        error = HttpError(
            413, f"the request body is {size} bytes or more; the limit is {max_bytes} ({source})"
        )
        await self._send(scope, send, error, unread=unread)

    async def _send(self, scope: Scope, send: Send, error: HttpError, *, unread: int) -> None:
        """The error, with its length; with `unread` bytes of body left past DISCARD_BYTES the
        connection closes after it, else uvicorn drops the rest of the body and keeps it."""
        content = json.dumps(self.body(scope["path"], error)).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(content)).encode()),
        ]
        if unread > DISCARD_BYTES:
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": error.status, "headers": headers})
        await send({"type": "http.response.body", "body": content})


def _replay(messages: list[Message], receive: Receive) -> Receive:
    async def replayed() -> Message:
        return messages.pop(0) if messages else await receive()

    return replayed
