"""A real HTTP/1.1 server on 127.0.0.1 that answers every request with the same canned reply:
for testing how a client reads responses that go wrong, over a real socket instead of a mock
transport.

    bound     at once, on an ephemeral port: `url` is known, but until `listen()` the kernel
              refuses every connection (ECONNREFUSED), as a server not up yet does
    reply     the status line, the headers, then each of `chunks` as one chunk of a chunked
              body, written and drained in turn; `cut` closes the connection after them
              without the terminating zero-length chunk (the body broken mid-way)
    seen      every request read (method, target, lower-cased headers, body), in order

It runs in the caller's event loop (asyncio.start_server) and closes each connection after its
reply (`connection: close`). It must never interpret what it sends: the bytes are the test's.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from dataclasses import dataclass, field
from http import HTTPStatus
from types import TracebackType


@dataclass(frozen=True)
class Reply:
    status: int = 200
    chunks: tuple[bytes, ...] = ()
    content_type: str = "text/event-stream"
    headers: dict[str, str] = field(default_factory=dict)
    cut: bool = False
    """Close the connection after `chunks` without ending the chunked body."""

    def head(self) -> bytes:
        lines = [
            f"HTTP/1.1 {self.status} {HTTPStatus(self.status).phrase}",
            f"content-type: {self.content_type}",
            "transfer-encoding: chunked",
            "connection: close",
            *(f"{name}: {value}" for name, value in self.headers.items()),
        ]
        return "".join(line + "\r\n" for line in lines).encode("latin-1") + b"\r\n"


@dataclass(frozen=True)
class Seen:
    method: str
    target: str
    headers: dict[str, str]
    body: bytes


class HttpStub:
    """`async with HttpStub(reply) as stub:` listens at once; `HttpStub(reply, listening=False)`
    refuses connections until `await stub.listen()`."""

    def __init__(self, reply: Reply, listening: bool = True) -> None:
        self.reply = reply
        self.listening = listening
        self.seen: list[Seen] = []
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.bind(("127.0.0.1", 0))  # bound, not listening: connecting is refused
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        self._server: asyncio.Server | None = None

    async def listen(self) -> None:
        self._server = await asyncio.start_server(self._answer, sock=self._socket)

    async def __aenter__(self) -> HttpStub:
        if self.listening:
            await self.listen()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._server is None:
            self._socket.close()
            return
        self._server.close()
        await self._server.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # ConnectionError: the client hung up before the reply was written (it stopped reading
        # after an error event); there is nobody left to answer.
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            self.seen.append(await _read_request(reader))
            writer.write(self.reply.head())
            for piece in self.reply.chunks:
                writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                await writer.drain()
            if not self.reply.cut:
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def _read_request(reader: asyncio.StreamReader) -> Seen:
    """One request with a Content-Length body (or none), as httpx sends them."""
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
    request_line, *lines = head.split("\r\n")[:-2]
    method, target, _ = request_line.split(" ", 2)
    headers = {}
    for line in lines:
        name, value = line.split(":", 1)
        headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return Seen(method, target, headers, body)
