"""A whole (not streamed) answer as JSON, with the headers saying which worker served it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from fastapi.responses import Response
from pydantic import BaseModel

from cluster.http.openai_responses import Counts


async def answer(build: Callable[[], BaseModel], counts: Counts, large: bool) -> Response:
    """A whole response as JSON. One with logprobs can be megabytes (20 alternatives for each of
    thousands of tokens): it is built and encoded on a thread, off the loop every stream shares."""

    def encode() -> bytes:
        return build().model_dump_json().encode()

    body = await asyncio.to_thread(encode) if large else encode()
    return Response(body, media_type="application/json", headers=counts.served_by())
