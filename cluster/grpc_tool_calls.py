"""The calls a sample's text holds, on its last message of the gRPC face (Serving.Generate),
read as the HTTP API reads them (worker/tool_calls.py), so that a gRPC client gets what an
OpenAI client gets: `GenerateResponse.tool_calls`. The text itself streams as written; a
thinking model's calls are read from its answer, after its reasoning."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator

from protos.radixmesh.v1 import serving_pb2
from worker.reasoning import CLOSE
from worker.tool_calls import read_calls


def answer(text: str) -> str:
    """A sample's text after a thinking model's reasoning, when it streamed whole (without
    `separate_reasoning`): after the first `</think>`, as worker/reasoning.py reads it, so a
    call the model only thought about is not returned."""
    return text.partition(CLOSE)[2] if CLOSE in text else text


async def with_tool_calls(
    request: serving_pb2.GenerateRequest,
    stream: AsyncGenerator[serving_pb2.GenerateResponse, None],
) -> AsyncIterator[serving_pb2.GenerateResponse]:
    """`stream`, each sample's last message carrying its calls when the request has tools
    that may be called."""
    tools = frozenset(tool.name for tool in request.tools)
    reading = bool(tools) and request.tool_choice != "none"
    texts: dict[int, list[str]] = {}
    async with contextlib.aclosing(stream):  # closed with this: the worker's call cancelled
        async for response in stream:
            if reading:
                texts.setdefault(response.index, []).append(response.text)
            if reading and response.finished:
                _, calls = read_calls(answer("".join(texts.pop(response.index))), tools)
                response.tool_calls.extend(
                    serving_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in calls
                )
            yield response
