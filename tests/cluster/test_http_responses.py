"""OpenAI's Responses API on the router, driven by the `openai` SDK's `responses.create`,
`.stream` and `.parse` over real HTTP on loopback, against a local cluster of two tiny-model
workers: text, instructions and a conversation of items, the stream's events adding up to the
whole response, function calls and their outputs sent back, structured text, and refusals by
name."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

import httpx2 as httpx
import jsonschema
import openai
import pytest
from openai._models import construct_type_unchecked
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent
from pydantic import BaseModel

from cluster.http import responses_output, responses_stream
from cluster.http.responses_schema import ResponsesRequest
from protos.radixmesh.v1 import serving_pb2
from tests.cluster.local_cluster import SERVED_NAME, LocalCluster
from tests.cluster.tool_fixtures import SCHEMAS, TIME, WEATHER

MODEL = SERVED_NAME
TOOLS: list[Any] = [
    {"type": "function", "name": "get_weather", "description": "A forecast", "parameters": WEATHER},
    {"type": "function", "name": "get_time", "parameters": TIME},
]
QUESTION = "What is the weather in Oslo?"


class Tier(BaseModel):
    tier: Literal["device", "host", "disk"]
    warm: bool


def test_a_text_response_has_openais_shape_and_its_cache_hits(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    first = client.responses.create(
        model=MODEL, input=QUESTION, instructions="Be brief.", max_output_tokens=8, temperature=0
    )
    assert first.object == "response" and first.id.startswith("resp_")
    assert first.model == MODEL and first.instructions == "Be brief."
    (item,) = first.output
    assert item.type == "message" and item.role == "assistant"
    assert first.output_text == item.content[0].text
    assert first.usage is not None and first.usage.output_tokens >= 1
    if first.status == "incomplete":
        assert first.incomplete_details is not None
        assert first.incomplete_details.reason == "max_output_tokens"
        assert first.usage.output_tokens == 8
    again = client.responses.create(
        model=MODEL, input=QUESTION, instructions="Be brief.", max_output_tokens=8, temperature=0
    )
    assert again.output_text == first.output_text  # greedy
    assert again.usage is not None and again.usage.input_tokens_details.cached_tokens > 0
    raw = httpx.post(
        f"{cluster.http_url}/v1/responses",
        json={"model": MODEL, "input": QUESTION, "max_output_tokens": 4},
    )
    openai.types.responses.Response.model_validate(raw.json())  # every field the SDK requires
    cluster.wait_idle()


def test_items_are_the_conversation(client: openai.OpenAI, cluster: LocalCluster) -> None:
    """The same conversation as a string, and as message items with text parts."""
    plain = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=4, temperature=0)
    items = client.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
        max_output_tokens=4,
        temperature=0,
    )
    assert items.output_text == plain.output_text
    assert items.usage is not None and plain.usage is not None
    assert items.usage.input_tokens == plain.usage.input_tokens
    cluster.wait_idle()


def test_the_stream_adds_up_to_the_response(client: openai.OpenAI, cluster: LocalCluster) -> None:
    request: dict[str, Any] = {
        "model": MODEL,
        "input": QUESTION,
        "max_output_tokens": 24,
        "temperature": 0,
    }
    whole = client.responses.create(**request)
    kinds, deltas, last = [], [], None
    with client.responses.stream(**request) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            last = event
    assert kinds[:2] == ["response.created", "response.in_progress"]
    # OpenAI ends a response max_output_tokens cut with response.incomplete (the SDK's
    # get_final_response wants response.completed, so the last event's response is read)
    assert kinds[-1] == f"response.{whole.status}"
    assert last is not None and hasattr(last, "response")
    streamed = last.response
    assert "".join(deltas) == streamed.output_text == whole.output_text
    assert streamed.status == whole.status
    assert [item.type for item in streamed.output] == [item.type for item in whole.output]
    cluster.wait_idle()


def test_function_calls_out_and_their_outputs_back(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    first = client.responses.create(
        model=MODEL,
        input=QUESTION,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=150,
        max_tool_calls=1,  # bounds built-in tools' calls (none here): accepted, returned
        temperature=0,
    )
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.call_id.startswith("call_") and first.status == "completed"
    assert first.max_tool_calls == 1
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    with client.responses.stream(
        model=MODEL,
        input=QUESTION,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=150,
        temperature=0,
    ) as stream:
        streamed = stream.get_final_response()
    (streamed_call,) = [item for item in streamed.output if item.type == "function_call"]
    assert (streamed_call.name, streamed_call.arguments) == (call.name, call.arguments)
    second = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": QUESTION},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "clear"}'},
        ],
        tools=TOOLS,
        tool_choice="none",
        max_output_tokens=4,
        temperature=0,
    )
    assert [item.type for item in second.output] == ["message"]
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens
    cluster.wait_idle()


def test_parse_gives_the_pydantic_model(client: openai.OpenAI, cluster: LocalCluster) -> None:
    for seed_prompt in ("Which tier?", "Another tier?"):
        parsed = client.responses.parse(
            model=MODEL, input=seed_prompt, text_format=Tier, max_output_tokens=60, temperature=1.0
        )
        assert isinstance(parsed.output_parsed, Tier), parsed.output_text
    cluster.wait_idle()


def test_a_stream_that_fails_ends_with_response_failed() -> None:
    """A worker that fails mid-stream: the events end with `response.failed` carrying the
    error, as OpenAI ends such a stream, and the SDK's accumulator takes them."""
    shell = responses_output.shell(ResponsesRequest(model=MODEL, input=QUESTION), "resp_x", MODEL)
    first = serving_pb2.GenerateResponse(index=0, text="Hel", token_ids=[5], worker="worker-0")
    failing = serving_pb2.GenerateResponse(
        index=0, finished=True, finish_reason="error", token_ids=[6], worker="worker-0"
    )

    async def rest() -> Any:
        yield failing

    async def collect() -> list[dict[str, Any]]:
        out = []
        async for raw in responses_stream.events(shell, first, rest(), frozenset()):
            out += [  # a chunk may hold several events
                json.loads(line.removeprefix("data: "))
                for line in raw.decode().split("\n")
                if line.startswith("data: ")
            ]
        return out

    events = asyncio.run(collect())
    assert [e["type"] for e in events][-1] == "response.failed"
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and "failed on worker-0" in failed["error"]["message"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    state = ResponseStreamState(input_tools=openai.omit, text_format=openai.omit)
    for event in events:
        state.handle_event(construct_type_unchecked(type_=ResponseStreamEvent, value=event))


@pytest.mark.parametrize(
    ("change", "param", "words"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "is not a stored response"),
        ({"previous_response_id": 7}, "previous_response_id", "string"),
        ({"store": "yes"}, "store", "boolean"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "17 pairs; at most 16"),
        ({"metadata": {"k" * 65: "v"}}, "metadata", "over 64 characters"),
        ({"metadata": {"k": "v" * 513}}, "metadata.k", "over 512 characters"),
        ({"metadata": {"k": 1}}, "metadata.k", "string"),
        ({"conversation": "conv_1"}, "conversation", "is not a conversation of this tenant"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "web_search"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type", "'item_reference'"),
        (
            {"input": [{"type": "reasoning", "summary": []}]},
            "input",
            "no message or function call",
        ),
        (
            {"input": [{"type": "reasoning", "summary": [], "content": [{"type": "text"}]}]},
            "input[0].content[0]",
            "must be a reasoning_text part",
        ),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "'tool'"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]",
            "only input_text and output_text",
        ),
        ({"max_output_tokens": 0}, "max_output_tokens", "must be in"),
        ({"max_tool_calls": 0}, "max_tool_calls", "greater than or equal to 1"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
            "text.format.schema",
            "does not compile",
        ),
        ({"reasoning": {"effort": "maximal"}}, "reasoning.effort", "'maximal'"),
        ({"input": [{"role": ["user"], "content": "x"}]}, "input[0].role", "is not one of"),
        (
            {
                "input": [
                    {"role": "user", "content": "x"},
                    {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"},
                ]
            },
            "input[1].arguments",
            "is not JSON",
        ),
        (
            {
                "input": [
                    {
                        "type": "function_call_output",
                        "call_id": "c",
                        "output": [{"type": "input_image", "text": "x"}],
                    }
                ]
            },
            "input[0].output",
            "only input_text parts",
        ),
        (
            {"text": {"format": {"type": "json_schema", "schema": {}}}},
            "text.format.name",
            "required",
        ),
        (
            {"text": {"format": {"type": "json_schema", "name": "x"}}},
            "text.format.schema",
            "required",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
            "tool_choice.name",
            "'nope' is not one of the tools",
        ),
        (
            {"instructions": "Be brief.", "input": [{"role": "user", "content": "x" * 10_000}]},
            "input",
            "maximum context length",
        ),
    ],
)
def test_refusals_name_the_field(
    cluster: LocalCluster, change: dict[str, Any], param: str, words: str
) -> None:
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": 4} | change
    answer = httpx.post(f"{cluster.http_url}/v1/responses", json=body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param, error
    assert words in error["message"]
    cluster.wait_idle()
    assert not cluster.service.in_flight
