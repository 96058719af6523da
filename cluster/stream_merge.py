"""Several server streams read as one: (which stream, message) in the order messages arrive.

The router forwards a request's worker call as the client's stream; a request whose n > 1
samples were resumed one call each (cluster/stream_progress.py) has several. The first failure
of any stream ends the merge with that stream's error, and every stream still open is cancelled
when the merge ends, however it ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterable, Sequence
from typing import TypeVar

T = TypeVar("T")
_END = object()


async def merge_streams(
    streams: Sequence[AsyncIterable[T]],
) -> AsyncGenerator[tuple[int, T], None]:
    if len(streams) == 1:  # the common case: no task, no queue
        async for item in streams[0]:
            yield 0, item
        return
    arrivals: asyncio.Queue[tuple[int, object]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterable[T]) -> None:
        try:
            async for item in stream:
                arrivals.put_nowait((index, item))
        except Exception as err:  # handed to the reader, who raises it
            arrivals.put_nowait((index, err))
            return
        arrivals.put_nowait((index, _END))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            index, arrival = await arrivals.get()
            if arrival is _END:
                open_streams -= 1
            elif isinstance(arrival, Exception):
                raise arrival
            else:
                yield index, arrival  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
