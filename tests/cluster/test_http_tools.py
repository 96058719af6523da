"""Tool calling through the OpenAI API, with the `openai` SDK as an agent calls it: tools and
tool_choice in, `tool_calls` out (whole and streamed), the SDK's pydantic tools parsed back, and
a conversation that carries calls and their results served on. The tiny model's weights are
random, so every well-formed call in these answers is the constraint's doing."""

from __future__ import annotations

import json
from typing import Literal

import httpx2 as httpx
import jsonschema
import openai
from pydantic import BaseModel, Field

from cluster.http.openai_schema import ChatMessage
from tests.cluster.local_cluster import SERVED_NAME, LocalCluster
from tests.cluster.tool_fixtures import ASK, SCHEMAS, TIME, WEATHER

MODEL = SERVED_NAME
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "A forecast", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]


class Lookup(BaseModel):
    """Look a word up."""

    word: Literal["cache", "page", "tree"]
    limit: int = Field(ge=1, le=9)


def assert_valid_calls(calls: list) -> None:  # type: ignore[type-arg]
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_gives_tool_calls_and_no_content(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=ASK,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="required",
        n=3,
        temperature=1.0,
        seed=4,
        max_tokens=120,
    )
    for choice in reply.choices:
        assert_valid_calls(choice.message.tool_calls or [])
        if choice.finish_reason == "tool_calls":
            assert choice.message.content is None
        else:  # the random model may go on calling: the call max_tokens cut stays text
            assert choice.finish_reason == "length", choice
            assert (choice.message.content or "").lstrip().startswith("<tool_call>")
    assert "tool_calls" in {c.finish_reason for c in reply.choices}
    cluster.wait_idle()


def test_a_named_function_and_one_call_at_most(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    named = client.chat.completions.create(
        model=MODEL,
        messages=ASK,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=150,
        temperature=1.0,
        seed=1,
    )
    calls = named.choices[0].message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_time"]
    assert_valid_calls(calls)
    single = client.chat.completions.create(
        model=MODEL,
        messages=ASK,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="required",
        parallel_tool_calls=False,
        n=3,
        max_tokens=120,
        temperature=1.0,
        seed=2,
    )
    assert all(len(c.message.tool_calls or []) == 1 for c in single.choices)
    cluster.wait_idle()


def test_streamed_calls_accumulate_as_the_sdk_reads_them(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    kwargs = dict(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=120,
        temperature=1.0,
        seed=6,
    )
    whole = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    with client.chat.completions.stream(**kwargs) as stream:  # type: ignore[arg-type]
        for _ in stream:
            pass
        streamed = stream.get_final_completion()
    expected = whole.choices[0].message.tool_calls or []
    got = streamed.choices[0].message.tool_calls or []
    assert [(c.function.name, c.function.arguments) for c in got] == [
        (c.function.name, c.function.arguments) for c in expected
    ]
    assert streamed.choices[0].finish_reason == "tool_calls"
    cluster.wait_idle()


def test_the_sdks_pydantic_tool_is_parsed_back(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    reply = client.chat.completions.parse(
        model=MODEL,
        messages=ASK,  # type: ignore[arg-type]
        tools=[openai.pydantic_function_tool(Lookup)],
        tool_choice="required",
        max_tokens=150,
        temperature=1.0,
        seed=3,
    )
    (call,) = reply.choices[0].message.tool_calls or []
    assert isinstance(call.function.parsed_arguments, Lookup)
    cluster.wait_idle()


def test_tokenize_counts_the_tools_and_the_tool_turns(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    """vLLM's /tokenize with tools and a conversation of calls and results: the ids a request
    is served with (its usage's prompt tokens)."""
    turns = [
        *ASK,
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
    ]
    url = f"{cluster.http_url}/tokenize"
    bare = httpx.post(url, json={"model": MODEL, "messages": ASK}).json()["count"]
    counted = httpx.post(url, json={"model": MODEL, "messages": turns, "tools": TOOLS}).json()
    served = client.chat.completions.create(
        model=MODEL,
        messages=turns,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="none",
        max_tokens=1,
    )
    assert served.usage is not None
    assert counted["count"] == served.usage.prompt_tokens > bare + 100
    cluster.wait_idle()


def test_a_conversation_with_calls_and_results_goes_on(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    """An agent's second turn: its call and the tool's result sent back, answered as text
    (tool_choice none) and counted as prompt; then the tools' description leaves the prompt
    when no tools are given."""
    first = client.chat.completions.create(
        model=MODEL,
        messages=ASK,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        temperature=0,
    )
    message = first.choices[0].message
    (call,) = message.tool_calls or []
    turns = [
        *ASK,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear", "c": 4}'},
    ]
    second = client.chat.completions.create(
        model=MODEL,
        messages=turns,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="none",
        max_tokens=8,
        temperature=0,
    )
    assert second.choices[0].message.tool_calls is None
    assert isinstance(second.choices[0].message.content, str)
    assert second.usage is not None and first.usage is not None
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    cluster.wait_idle()
    assert not cluster.service.in_flight


def test_a_streamed_call_ends_its_choice_in_a_chunk_of_its_own(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    """As OpenAI's streams end a choice: the SDK's stream helper tells a call's arguments done
    only once a later chunk of its choice comes, so the finish reason comes after the calls."""
    tools: list = [{"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
    with client.chat.completions.stream(
        model=SERVED_NAME,
        messages=[{"role": "user", "content": "What time is it?"}],
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_completion_tokens=200,
        temperature=0,
    ) as stream:
        done = [e for e in stream if e.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls or []
    assert [e.name for e in done] == ["get_time"]
    assert done[0].arguments == call.function.arguments
    assert final.choices[0].finish_reason == "tool_calls"
    cluster.wait_idle()


class Zone(BaseModel):
    zone: Literal["UTC", "CET"]


def test_a_message_the_sdk_parsed_can_be_sent_back(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    """`parse` leaves `parsed` on the message and `parsed_arguments` on each call, which the
    SDK sends back with it in the next turn: ignored, as OpenAI's chat API ignores them."""
    messages: list = [{"role": "user", "content": "Which zone?"}]
    answered = client.chat.completions.parse(
        model=SERVED_NAME, messages=messages, response_format=Zone, max_completion_tokens=100
    )
    assert answered.choices[0].message.parsed is not None
    called = client.chat.completions.parse(
        model=SERVED_NAME,
        messages=messages,
        tools=[openai.pydantic_function_tool(Zone)],
        tool_choice="required",
        parallel_tool_calls=False,
        max_completion_tokens=200,
    )
    (call,) = called.choices[0].message.tool_calls or []
    assert call.function.parsed_arguments is not None
    turns = [
        *messages,
        answered.choices[0].message,
        {"role": "user", "content": "And the call?"},
        called.choices[0].message,
        {"role": "tool", "tool_call_id": call.id, "content": "12:00"},
    ]
    again = client.chat.completions.create(model=SERVED_NAME, messages=turns, max_tokens=2)
    assert again.choices[0].message is not None
    kept = ChatMessage.model_validate(called.choices[0].message.model_dump()).model_dump()
    assert "parsed" not in kept and "parsed_arguments" not in json.dumps(kept)  # not stored
    cluster.wait_idle()
