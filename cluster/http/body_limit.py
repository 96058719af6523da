"""Request bodies over the limit (`router.max_message_bytes`, as gRPC's messages, and for a vision
model its images' allowance: cluster/http/image_parts.py) are refused with 413 before the app
parses a byte of them, and headers over `MAX_HEADER_BYTES` in all with 431 (httptools reads
headers of any size). The limit is asked for at each request: it follows the workers' model."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cluster.http.errors import HttpError

MAX_HEADER_BYTES = 32 << 10
"""Of all a request's header names and values together (nginx's default allows 32 KiB)."""


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
        header_bytes = sum(len(name) + len(value) for name, value in scope["headers"])
        if header_bytes > MAX_HEADER_BYTES:
            error = HttpError(
                431, f"the request's headers are {header_bytes} bytes; at most {MAX_HEADER_BYTES}"
            )
            await self._send(scope, send, error)
            return
        headers = dict(scope["headers"])
        max_bytes, source = self.limit(scope["path"], headers)
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            await self._refuse(scope, send, int(declared), max_bytes, source)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: let the app see it
                await self.app(scope, _replay([message], receive), send)
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > max_bytes:
                await self._refuse(scope, send, size, max_bytes, source)
                return
            if not message.get("more_body", False):
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([body], receive), send)

    async def _refuse(
        self, scope: Scope, send: Send, size: int, max_bytes: int, source: str
    ) -> None:
        error = HttpError(
            413, f"the request body is {size} bytes or more; the limit is {max_bytes} ({source})"
        )
        await self._send(scope, send, error)

    async def _send(self, scope: Scope, send: Send, error: HttpError) -> None:
        content = json.dumps(self.body(scope["path"], error)).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        await send({"type": "http.response.start", "status": error.status, "headers": headers})
        await send({"type": "http.response.body", "body": content})


def _replay(messages: list[Message], receive: Receive) -> Receive:
    async def replayed() -> Message:
        return messages.pop(0) if messages else await receive()

    return replayed
