"""A background response's events as they are written, for any number of readers: the stream
its POST answers with, and each `GET /v1/responses/{id}?stream=true&starting_after=N` that
resumes it (OpenAI's, and vLLM's, way back into a stream whose connection dropped).

The events are kept encoded, one entry an event, in `sequence_number` order (responses_stream
numbers them from 0), until the log is dropped (cluster/http/responses_background.py keeps the
logs of ended responses within a bound in bytes). A generated token costs about 250 bytes of
log (its delta event), held while the response runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

EVENT_BYTES = 48
"""What Python takes to hold one event beside its bytes (a bytes object, a list slot)."""


class EventLog:
    def __init__(self, kept: bool = True) -> None:
        self.kept = kept
        """Whether the events are kept (a background response asked for without `stream`
        keeps none: there is nothing to resume)."""
        self.events: list[bytes] = []
        self.bytes = 0
        """What the kept events take, with what Python adds to hold them."""
        self.closed = False
        """No event will follow."""
        self._more = asyncio.Event()

    def append(self, chunk: bytes) -> None:
        """Add the events of one chunk (one or more `event: ...\\ndata: ...\\n\\n`)."""
        if not self.kept:
            return
        for event in chunk.split(b"\n\n"):
            if event:
                self.events.append(event + b"\n\n")
                self.bytes += len(event) + 2 + EVENT_BYTES
        self._wake()

    def close(self) -> None:
        self.closed = True
        self._wake()

    async def follow(self, after: int = -1) -> AsyncIterator[bytes]:
        """The events numbered after `after`, then each as it is written, until the log
        closes."""
        sent = after + 1
        while True:
            while sent < len(self.events):
                yield self.events[sent]
                sent += 1
            if self.closed:
                return
            more = self._more
            await more.wait()

    def _wake(self) -> None:
        self._more.set()
        self._more = asyncio.Event()
