"""Request bodies over the limit (`router.max_message_bytes`, as gRPC's messages) are refused with
413 before the app parses a byte of them."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cluster.http.errors import HttpError


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, body: Callable[[str, HttpError], Any]):
        self.app = app
        self.max_bytes = max_bytes
        self.body = body
        """The error body for a path (each API writes its errors its own way)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, send, int(declared))
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: let the app see it
                await self.app(scope, _replay([message], receive), send)
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._refuse(scope, send, size)
                return
            if not message.get("more_body", False):
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([body], receive), send)

    async def _refuse(self, scope: Scope, send: Send, size: int) -> None:
        error = HttpError(
            413,
            f"the request body is {size} bytes or more; the limit is {self.max_bytes} "
            "(router.max_message_bytes)",
        )
        content = json.dumps(self.body(scope["path"], error)).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": content})


def _replay(messages: list[Message], receive: Receive) -> Receive:
    async def replayed() -> Message:
        return messages.pop(0) if messages else await receive()

    return replayed
