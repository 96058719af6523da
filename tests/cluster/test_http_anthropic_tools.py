"""Tool use through the Anthropic Messages API, with the `anthropic` SDK as an agent calls it:
`tools` and `tool_choice` in, `tool_use` blocks out (whole and streamed), and the next turn
carrying the call and its `tool_result` served on and counted. The tiny model's weights are
random, so every well-formed call here is the constraint's doing."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import jsonschema
import pytest

from tests.cluster.local_cluster import SERVED_NAME, LocalCluster
from tests.cluster.tool_fixtures import ASK, SCHEMAS, TIME, WEATHER

MODEL = SERVED_NAME
TOOLS: list[Any] = [
    {"name": "get_weather", "description": "A forecast", "input_schema": WEATHER},
    {"name": "get_time", "input_schema": TIME},
]


@pytest.fixture
def client(cluster: LocalCluster) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=cluster.http_url, api_key="none", max_retries=0) as c:
        yield c


def tool_uses(message: anthropic.types.Message) -> list[anthropic.types.ToolUseBlock]:
    return [block for block in message.content if block.type == "tool_use"]


def ask(client: anthropic.Anthropic, **more: Any) -> anthropic.types.Message:
    request = {"model": MODEL, "max_tokens": 150, "messages": ASK, "tools": TOOLS}
    return client.messages.create(**(request | more))


def test_any_gives_tool_use_blocks_with_valid_input(
    client: anthropic.Anthropic, cluster: LocalCluster
) -> None:
    message = ask(client, tool_choice={"type": "any"}, extra_body={"temperature": 0})
    calls = tool_uses(message)
    assert calls and message.stop_reason == "tool_use", message
    assert all(block.type == "tool_use" for block in message.content)  # calls alone
    for call in calls:
        assert call.id.startswith("toolu_")
        jsonschema.validate(call.input, SCHEMAS[call.name])
    cluster.wait_idle()


def test_a_named_tool_once(client: anthropic.Anthropic, cluster: LocalCluster) -> None:
    message = ask(
        client,
        tool_choice={"type": "tool", "name": "get_time", "disable_parallel_tool_use": True},
        extra_body={"temperature": 0},
    )
    assert [c.name for c in tool_uses(message)] == ["get_time"]
    jsonschema.validate(tool_uses(message)[0].input, TIME)
    none = ask(client, tool_choice={"type": "none"}, max_tokens=8, extra_body={"temperature": 0})
    assert not tool_uses(none) and none.content[0].type == "text"
    cluster.wait_idle()


def test_a_strict_tool_is_served_as_every_tool_is(
    client: anthropic.Anthropic, cluster: LocalCluster
) -> None:
    """The SDK's `strict` and `eager_input_streaming` on a tool are accepted: every call's
    input is held to its schema anyway, and streamed whole."""
    tools = [TOOLS[0] | {"strict": True, "eager_input_streaming": True}, TOOLS[1]]
    message = ask(client, tools=tools, tool_choice={"type": "any"}, extra_body={"temperature": 0})
    calls = tool_uses(message)
    assert calls and message.stop_reason == "tool_use", message
    for call in calls:
        jsonschema.validate(call.input, SCHEMAS[call.name])
    cluster.wait_idle()


def test_the_stream_gives_the_same_message(
    client: anthropic.Anthropic, cluster: LocalCluster
) -> None:
    request: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 150,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": {"type": "any"},
        "extra_body": {"temperature": 0},
    }
    whole = client.messages.create(**request)
    with client.messages.stream(**request) as stream:
        streamed = stream.get_final_message()
    assert [(c.name, c.input) for c in tool_uses(streamed)] == [
        (c.name, c.input) for c in tool_uses(whole)
    ]
    assert [b.type for b in streamed.content] == [b.type for b in whole.content]
    assert streamed.stop_reason == "tool_use"
    cluster.wait_idle()


def test_the_next_turn_carries_the_call_and_its_result(
    client: anthropic.Anthropic, cluster: LocalCluster
) -> None:
    first = ask(
        client,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body={"temperature": 0},
    )
    (call,) = tool_uses(first)
    turns: list[Any] = [
        *ASK,
        {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": '{"sky": "clear"}'},
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]
    counted = client.messages.count_tokens(model=MODEL, messages=turns, tools=TOOLS)
    second = client.messages.create(
        model=MODEL, max_tokens=8, messages=turns, tools=TOOLS, tool_choice={"type": "none"}
    )
    prompt = second.usage.input_tokens + (second.usage.cache_read_input_tokens or 0)
    assert counted.input_tokens == prompt
    assert prompt > first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)
    assert (second.usage.cache_read_input_tokens or 0) > 0  # the first turn's prefix was cached
    cluster.wait_idle()
    assert not cluster.service.in_flight
