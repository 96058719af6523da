"""Tool calls on the gRPC face, over real gRPC on loopback against a local cluster of two
tiny-model workers: each sample's last message carries the calls its text holds, the ones the
OpenAI API returns for the same request; none when no tool may be called."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import jsonschema
import openai

from cluster.client import Client, text_request
from cluster.grpc_tool_calls import with_tool_calls
from protos.radixmesh.v1 import serving_pb2
from tests.cluster.local_cluster import SERVED_NAME, LocalCluster
from tests.cluster.tool_fixtures import SCHEMAS, TIME, WEATHER

QUESTION = "What is the weather in Oslo?"


def asking(choice: str, n: int = 1, temperature: float = 0.0) -> serving_pb2.GenerateRequest:
    request = text_request(
        chat=[("user", QUESTION)], max_tokens=150, n=n, temperature=temperature, seed=7
    )
    request.tools.extend(
        serving_pb2.Tool(name=name, parameters=json.dumps(schema))
        for name, schema in (("get_weather", WEATHER), ("get_time", TIME))
    )
    request.tool_choice = choice
    request.parallel_tool_calls = False
    return request


def last_messages(cluster: LocalCluster, request: serving_pb2.GenerateRequest) -> dict[int, Any]:
    """Each sample's last message, and its whole text."""
    texts: dict[int, str] = {}
    last = {}
    for response in Client(cluster.target).generate(request, timeout=120):
        texts[response.index] = texts.get(response.index, "") + response.text
        if response.finished:
            last[response.index] = (response, texts[response.index])
    return last


def test_the_last_message_carries_the_calls_openai_returns(
    cluster: LocalCluster, client: openai.OpenAI
) -> None:
    ((last, text),) = last_messages(cluster, asking("required")).values()
    (call,) = last.tool_calls
    assert "<tool_call>" in text and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    reply = client.chat.completions.create(
        model=SERVED_NAME,
        messages=[{"role": "user", "content": QUESTION}],
        tools=[
            {"type": "function", "function": {"name": n, "parameters": s}}
            for n, s in (("get_weather", WEATHER), ("get_time", TIME))
        ],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=150,
        temperature=0,
    )
    (http_call,) = reply.choices[0].message.tool_calls or []
    assert (call.name, call.arguments) == (http_call.function.name, http_call.function.arguments)  # type: ignore[union-attr]
    cluster.wait_idle()


def test_each_sample_carries_its_own_calls(cluster: LocalCluster) -> None:
    samples = last_messages(cluster, asking("required", n=2, temperature=1.0))
    assert sorted(samples) == [0, 1]
    for last, text in samples.values():
        (call,) = last.tool_calls
        assert (
            json.loads(call.arguments)
            == json.loads(text.split("<tool_call>")[1].split("</tool_call>")[0])["arguments"]
        )
    cluster.wait_idle()


def test_no_calls_are_read_when_none_may_be_made(cluster: LocalCluster) -> None:
    for request in (asking("none"), text_request(chat=[("user", QUESTION)], max_tokens=8)):
        for last, _ in last_messages(cluster, request).values():
            assert not last.tool_calls
    cluster.wait_idle()


def test_calls_are_read_per_sample_from_the_answer_only() -> None:
    """Made-up streams of two interleaved samples: each last message carries its own sample's
    calls; a call inside a thinking model's reasoning is not one; none with tool_choice
    "none" or without tools."""
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    parts = [
        (0, "<think>maybe " + call, False),
        (1, "Sure. ", False),
        (0, " no.</think>Fine.", True),
        (1, call, True),
    ]

    async def stream() -> Any:
        for index, text, finished in parts:
            yield serving_pb2.GenerateResponse(index=index, text=text, finished=finished)

    async def lasts(request: serving_pb2.GenerateRequest) -> dict[int, list[str]]:
        out = {}
        async for response in with_tool_calls(request, stream()):
            if response.finished:
                out[response.index] = [c.name for c in response.tool_calls]
        return out

    assert asyncio.run(lasts(asking("auto"))) == {0: [], 1: ["get_time"]}
    assert asyncio.run(lasts(asking("none"))) == {0: [], 1: []}
    assert asyncio.run(lasts(text_request(chat=[("user", QUESTION)]))) == {0: [], 1: []}
