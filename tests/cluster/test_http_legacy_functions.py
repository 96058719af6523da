"""OpenAI's legacy function calling (`functions`, `function_call`, role "function"), as the
`openai` SDK sends it: served as the tools request it is equivalent to, the same call given
back as `message.function_call` with finish_reason "function_call" (whole and streamed), a
conversation of legacy calls and results read as tool calls and tool messages, and each bad
shape refused naming its field. The tiny model's weights are random: every well-formed call is
the constraint's doing."""

from __future__ import annotations

import json
from typing import Any

import httpx2 as httpx
import jsonschema
import openai
import pytest

from cluster.http.errors import HttpError
from cluster.http.legacy_functions import modern
from cluster.http.openai_schema import ChatCompletionRequest
from tests.cluster.local_cluster import SERVED_NAME, LocalCluster
from tests.cluster.test_http_errors import assert_openai_error
from tests.cluster.tool_fixtures import ASK, TIME, WEATHER

MODEL = SERVED_NAME
FUNCTIONS = [
    {"name": "get_weather", "description": "A forecast", "parameters": WEATHER},
    {"name": "get_time", "parameters": TIME},
]
TOOLS = [{"type": "function", "function": f} for f in FUNCTIONS]
SAMPLED: dict[str, Any] = {"max_tokens": 150, "temperature": 1.0, "seed": 3}


def test_a_named_function_is_called_as_the_tools_request_calls_it(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    old = client.chat.completions.create(
        model=MODEL,
        messages=ASK,  # type: ignore[arg-type]
        functions=FUNCTIONS,  # type: ignore[arg-type]
        function_call={"name": "get_time"},
        **SAMPLED,
    )
    new = client.chat.completions.create(
        model=MODEL,
        messages=ASK,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False,
        **SAMPLED,
    )
    (choice,) = old.choices
    call = choice.message.function_call
    assert call is not None and call.name == "get_time"
    jsonschema.validate(json.loads(call.arguments), TIME)
    assert choice.message.tool_calls is None and choice.message.content is None
    assert choice.finish_reason == "function_call"
    (called,) = new.choices[0].message.tool_calls or []
    assert (called.function.name, called.function.arguments) == (call.name, call.arguments)
    assert old.usage is not None and new.usage is not None
    assert old.usage.prompt_tokens == new.usage.prompt_tokens  # the same prompt, tools and all
    cluster.wait_idle()


def test_auto_answers_as_the_tools_request_does(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    """Choice for choice, `function_call` "auto" answers what tools with tool_choice "auto"
    and `parallel_tool_calls: false` answer: the same text, the same finish. The random model
    writes no call of its own accord, so the calls compared here are none; the named choice's
    tests above compare calls. "none" calls nothing."""
    ask: dict[str, Any] = {"model": MODEL, "messages": ASK, "n": 4, **SAMPLED}
    old = client.chat.completions.create(functions=FUNCTIONS, function_call="auto", **ask)
    new = client.chat.completions.create(tools=TOOLS, parallel_tool_calls=False, **ask)
    for legacy, tools in zip(old.choices, new.choices, strict=True):
        assert legacy.message.tool_calls is None
        assert legacy.message.content == tools.message.content
        call, called = legacy.message.function_call, tools.message.tool_calls or []
        assert [(c.function.name, c.function.arguments) for c in called] == (
            [(call.name, call.arguments)] if call is not None else []
        )
        finish = "function_call" if tools.finish_reason == "tool_calls" else tools.finish_reason
        assert legacy.finish_reason == finish
    plain = client.chat.completions.create(
        model=MODEL,
        messages=ASK,  # type: ignore[arg-type]
        functions=FUNCTIONS,  # type: ignore[arg-type]
        function_call="none",
        max_tokens=8,
        temperature=0,
    )
    assert plain.choices[0].message.function_call is None
    assert isinstance(plain.choices[0].message.content, str)
    cluster.wait_idle()


def test_the_streamed_call_is_the_whole_ones(client: openai.OpenAI, cluster: LocalCluster) -> None:
    kwargs: dict[str, Any] = dict(
        model=MODEL,
        messages=ASK,
        functions=FUNCTIONS,
        function_call={"name": "get_weather"},
        **SAMPLED,
    )
    whole = client.chat.completions.create(**kwargs).choices[0]
    name, arguments, finish = "", "", None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            assert choice.delta.tool_calls is None
            if choice.delta.function_call is not None:  # the SDK's legacy reader adds them up
                name += choice.delta.function_call.name or ""
                arguments += choice.delta.function_call.arguments or ""
            finish = choice.finish_reason or finish
    assert whole.message.function_call is not None
    assert (name, arguments) == (
        whole.message.function_call.name,
        whole.message.function_call.arguments,
    )
    jsonschema.validate(json.loads(arguments), WEATHER)
    assert finish == whole.finish_reason == "function_call"
    cluster.wait_idle()


def test_a_conversation_of_legacy_calls_is_the_tools_conversation(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    """The call and its result, sent back the legacy way, make the prompt the same
    conversation sent as a tool call and a tool message does: the same tokens, the same
    greedy answer."""
    call = {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}
    result = '{"sky": "clear"}'
    old_turns = [
        *ASK,
        {"role": "assistant", "content": None, "function_call": call},
        {"role": "function", "name": "get_weather", "content": result},
    ]
    new_turns = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": call}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": result},
    ]
    greedy: dict[str, Any] = {"model": MODEL, "max_tokens": 150, "temperature": 0}
    old = client.chat.completions.create(
        messages=old_turns,  # type: ignore[arg-type]
        functions=FUNCTIONS,  # type: ignore[arg-type]
        function_call={"name": "get_time"},
        **greedy,
    )
    new = client.chat.completions.create(
        messages=new_turns,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False,
        **greedy,
    )
    assert old.usage is not None and new.usage is not None
    assert old.usage.prompt_tokens == new.usage.prompt_tokens
    call = old.choices[0].message.function_call
    (called,) = new.choices[0].message.tool_calls or []
    assert call is not None
    assert (call.name, call.arguments) == (called.function.name, called.function.arguments)
    counted = httpx.post(
        f"{cluster.http_url}/tokenize",
        json={"model": MODEL, "messages": old_turns, "tools": TOOLS},
        timeout=30,
    )
    assert counted.status_code == 200, counted.text
    assert counted.json()["count"] == old.usage.prompt_tokens  # /tokenize reads them too
    cluster.wait_idle()


CALL = {"name": "f", "arguments": "{}"}
PARTS = [{"type": "text", "text": "x"}]
BAD = [
    ({"functions": FUNCTIONS, "tools": TOOLS}, "functions", "not both"),
    ({"function_call": {"name": "get_time"}}, "function_call", "give functions"),
    ({"functions": FUNCTIONS, "function_call": {"name": "nope"}}, "function_call.name", "nope"),
    ({"functions": FUNCTIONS, "function_call": "auto", "tool_choice": "auto"}, "tool_choice", ""),
    ({"functions": FUNCTIONS, "tool_choice": "required"}, "tool_choice", "give function_call"),
    ({"functions": [{"name": "f", "parameters": {"type": "no"}}]}, "functions[0].parameters", ""),
    ({"function_call": "always"}, "function_call", ""),
    ({"functions": FUNCTIONS, "parallel_tool_calls": True}, "parallel_tool_calls", "one call"),
    ({"functions": FUNCTIONS, "response_format": {"type": "json_object"}}, "functions", "give one"),
    ({"functions": [{"name": f"f{i}"} for i in range(129)]}, "functions", "at most"),
    (
        {"messages": [{"role": "user", "content": "hi", "function_call": CALL}]},
        "messages[0].function_call",
        "assistant",
    ),
    ({"messages": [{"role": "function", "content": "{}"}]}, "messages[0].name", "required"),
    (
        {"messages": [{"role": "function", "name": "f", "content": PARTS}]},
        "messages[0].content",
        "text",
    ),
]


@pytest.mark.parametrize(("extra", "param", "words"), BAD)
def test_a_bad_legacy_request_is_refused_by_name(
    cluster: LocalCluster, extra: dict[str, Any], param: str, words: str
) -> None:
    body = {"model": MODEL, "messages": ASK, "max_tokens": 4, **extra}
    response = httpx.post(f"{cluster.http_url}/v1/chat/completions", json=body, timeout=30)
    error = assert_openai_error(response, 400, words)
    assert error["param"] == param, error
    cluster.wait_idle()
    assert not cluster.service.in_flight


def test_modern_keeps_a_request_without_legacy_parts() -> None:
    request = ChatCompletionRequest.model_validate(
        {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": "auto"}
    )
    assert modern(request) is request


def test_each_result_answers_the_call_before_it() -> None:
    """Two rounds of call and result: each function message takes its own call's id; a result
    no call asked for gets its own."""
    call = {"name": "get_time", "arguments": '{"zone": "UTC"}'}
    turns = [
        *ASK,
        {"role": "assistant", "content": None, "function_call": call},
        {"role": "function", "name": "get_time", "content": "12:00"},
        {"role": "assistant", "content": None, "function_call": call},
        {"role": "function", "name": "get_time", "content": "12:01"},
        {"role": "function", "name": "get_time", "content": "late"},
    ]
    request = ChatCompletionRequest.model_validate(
        {"model": MODEL, "messages": turns, "functions": FUNCTIONS}
    )
    served = modern(request)
    ids = [
        (m.role, m.tool_call_id or (m.tool_calls[0].id if m.tool_calls else None))
        for m in served.messages[1:]
    ]
    assert ids == [
        ("assistant", "call_1"),
        ("tool", "call_1"),
        ("assistant", "call_3"),
        ("tool", "call_3"),
        ("tool", "call_5"),
    ]
    assert served.tools is not None and [t.function.name for t in served.tools] == [
        "get_weather",
        "get_time",
    ]
    assert served.parallel_tool_calls is False and served.function_call is None
    assert all(m.function_call is None for m in served.messages)


def test_a_function_call_on_a_turn_with_tool_calls_is_refused() -> None:
    call = {"name": "get_time", "arguments": "{}"}
    tool_call = {"id": "c", "type": "function", "function": call}
    turn = {"role": "assistant", "function_call": call, "tool_calls": [tool_call]}
    request = ChatCompletionRequest.model_validate(
        {"model": MODEL, "messages": [*ASK, turn], "functions": FUNCTIONS}
    )
    with pytest.raises(HttpError, match="not both") as refused:
        modern(request)
    assert refused.value.param == "messages[1].function_call"


def test_the_no_op_values_ask_for_nothing(client: openai.OpenAI, cluster: LocalCluster) -> None:
    """`functions: []` and `function_call: "none"` were accepted when the legacy fields were
    refused, as asking for nothing; they still are, beside tools, which answer as tools do
    (and with no `function_call` field)."""
    body = {
        "model": MODEL,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        "functions": [],
        "function_call": "none",
        **SAMPLED,
    }
    response = httpx.post(f"{cluster.http_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    assert "function_call" not in choice["message"] and choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls"
    cluster.wait_idle()
