"""Several prompts in one completions request (OpenAI's legacy API takes a list of them;
lm-evaluation-harness sends its batch that way): one generation a prompt, run at once, their
messages merged into one stream whose choices are numbered as vLLM numbers them,

    choice index = prompt index x n + sample index

A refusal of any prompt refuses the request before anything is sent: the merged stream yields
only once every prompt has its first message.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Sequence
from typing import TypeVar

from cluster.http.errors import HttpError
from cluster.stream_merge import merge_streams
from protos.radixmesh.v1 import serving_pb2

T = TypeVar("T")

Responses = AsyncGenerator[serving_pb2.GenerateResponse, None]
Prompt = str | list[int]

MAX_PROMPTS = 256
"""Prompts one request may hold; each is a generation in flight of its own."""


def check_count(count: int, field: str) -> None:
    """400 naming `field` unless a request holds 1 to MAX_PROMPTS prompts."""
    if not 1 <= count <= MAX_PROMPTS:
        raise HttpError.invalid(field, f"{count} prompts in one request; send 1 to {MAX_PROMPTS}")


def prompts_of(prompt: str | list[int] | list[str] | list[list[int]]) -> list[Prompt]:
    """The request's prompts: a text, token ids, or a list of either."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt or isinstance(prompt[0], int):
        return [[p for p in prompt if isinstance(p, int)]]
    return [p for p in prompt if isinstance(p, (str, list))]


def renumbered(
    message: serving_pb2.GenerateResponse, prompt: int, n: int
) -> serving_pb2.GenerateResponse:
    message.index = prompt * n + message.index
    return message


async def merged(streams: Sequence[Responses], n: int) -> Responses:
    """The prompts' streams as one, choices renumbered, every prompt's first message before
    any other (cluster/stream_merge.py merges the rest). Closing it closes them all."""
    try:
        if len(streams) == 1:  # nothing to wait for or renumber
            async for message in streams[0]:
                yield message
            return
        for prompt, first in enumerate(await _firsts(streams)):
            yield renumbered(first, prompt, n)
        async with contextlib.aclosing(merge_streams(streams)) as rest:
            async for prompt, message in rest:
                yield renumbered(message, prompt, n)
    finally:
        for stream in streams:  # each closed even if another's close fails
            with contextlib.suppress(Exception):
                await stream.aclose()


async def _firsts(streams: Sequence[Responses]) -> list[serving_pb2.GenerateResponse]:
    """Each stream's first message, awaited together; the first failure cancels the rest."""

    async def first(stream: Responses) -> serving_pb2.GenerateResponse:
        return await anext(stream)

    return await every([first(s) for s in streams])


async def every(work: Sequence[Awaitable[T]]) -> list[T]:
    """Each awaited together; on the first failure (or a cancellation), the rest are cancelled
    and awaited (their worker calls closed) before it is raised as it was."""
    tasks = [asyncio.ensure_future(each) for each in work]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
