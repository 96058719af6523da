"""Background responses (`background: true`, OpenAI's and vLLM's): the request is answered at
once with the response `queued`, stored; the generation runs on the router's event loop, apart
from the HTTP request, and stores the response as it goes (`in_progress` at its first token)
and as it ends. The client polls `GET /v1/responses/{id}` and may `POST .../cancel`.

A generation that is refused (a prompt over the context, say) or fails ends the response
`failed`, with the error; a cancelled one ends it `cancelled`, with what it wrote. Either way
the worker's call is closed and its pages freed, as for a client that leaves a stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from cluster.http.errors import GenerationFailed, HttpError, Renames
from cluster.http.openai_responses import Counts, Responses, read
from cluster.http.responses_output import done
from cluster.http.responses_schema import Response
from cluster.serving_call import ServingError
from worker.tool_calls import read_calls

log = logging.getLogger(__name__)
ERROR_CODES = {400: "invalid_prompt", 413: "invalid_prompt", 429: "rate_limit_exceeded"}
"""A refusal's status -> the code of OpenAI's ResponseError (else "server_error")."""
Keep = Callable[[Response], Response]
"""Stores a response as it stands; returns it as stored."""


@dataclass
class _Written:
    """What a generation wrote so far, and whether its end was stored."""

    text: list[str] = field(default_factory=list)
    thought: list[str] = field(default_factory=list)
    finish: str | None = None
    counts: Counts = field(default_factory=Counts)
    ended: bool = False


class BackgroundResponses:
    """The background generations running, by (tenant, response id)."""

    def __init__(self) -> None:
        self._running: dict[tuple[str, str], asyncio.Task[None]] = {}

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
    ) -> Response:
        """Store `queued` and run its generation (`stream`) to the end; the response as stored.
        Refused (the stream closed) while one of its id runs, or when the store cannot hold it:
        nobody could poll it."""
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
        written = _Written()
        task = asyncio.get_running_loop().create_task(
            _generate(queued, stream, tools, rename, keep, written), name=f"background {queued.id}"
        )
        self._running[key] = task

        def finished(task: asyncio.Task[None]) -> None:
            self._running.pop(key, None)
            if task.cancelled() and not written.ended:  # before its first step: still queued
                keep(_ended(queued, written, cancelled=True))

        task.add_done_callback(finished)
        return stored

    async def cancel(self, tenant: str, response_id: str) -> bool:
        """Cancel the tenant's running generation of that id and wait for it to store the
        response `cancelled`; False when none of that id is running."""
        task = self._running.get((tenant, response_id))
        if task is None:
            return False
        task.cancel()
        await asyncio.wait([task])
        return True

    async def close(self) -> None:
        """Cancel every generation still running (the router stopping)."""
        tasks = list(self._running.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)


async def _generate(
    queued: Response,
    stream: Responses,
    tools: frozenset[str],
    rename: Renames,
    keep: Keep,
    written: _Written,
) -> None:
    failure, code = None, "server_error"
    try:
        async with contextlib.aclosing(read(stream, written.counts)) as responses:
            async for response in responses:
                if not written.text and not written.thought:
                    keep(queued.model_copy(update={"status": "in_progress"}))
                written.text.append(response.text)
                written.thought.append(response.reasoning_text)
                if response.finished:
                    written.finish = response.finish_reason
    except (ServingError, GenerationFailed) as err:
        refusal = HttpError.of(err).renamed(rename)
        failure, code = refusal.message, ERROR_CODES.get(refusal.status, code)
    except asyncio.CancelledError:
        written.ended = True
        keep(_ended(queued, written, cancelled=True))
        raise
    except Exception as err:  # a bug: the response must still end, and say so
        log.exception("background response %s failed", queued.id)
        failure = f"the router failed generating it: {type(err).__name__}: {err}"
    written.ended = True
    keep(_ended(queued, written, tools if failure is None else frozenset(), failure, code))


def _ended(
    queued: Response,
    written: _Written,
    tools: frozenset[str] = frozenset(),
    failure: str | None = None,
    code: str = "server_error",
    cancelled: bool = False,
) -> Response:
    text = "".join(written.text)
    content, calls = read_calls(text, tools) if tools else (text, [])
    return done(
        queued, content or None, calls, written.finish, written.counts,
        failure=failure, thought="".join(written.thought), cancelled=cancelled,
        failure_code=code,
    )  # fmt: skip
