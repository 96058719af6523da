"""The Anthropic Messages API on the router, driven by the official `anthropic` SDK over real HTTP
on loopback, against a local cluster of two tiny-model workers with tokens configured (the SDK
sends its key as `x-api-key`): the shape, the usage's cache reads, streaming, refusals by name,
auth, and count_tokens agreeing with a real call."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import httpx2 as httpx
import pytest

from cluster.config import SecuritySection
from tests.cluster.local_cluster import SERVED_NAME, LocalCluster, start_cluster
from worker.loader import LoadedModel

MODEL = SERVED_NAME
KEY = "sk-radixmesh-test"
PROMPT = "the quick brown fox jumps over the lazy dog"
MESSAGES: list[Any] = [{"role": "user", "content": PROMPT}]
SYSTEM = "You answer in one short sentence."
GREEDY = {"temperature": 0}
"""This SDK has no sampling parameters of its own: they go in the body as they are."""


@pytest.fixture(scope="module")
def cluster(tiny: LoadedModel) -> Iterator[LocalCluster]:
    cluster = start_cluster(tiny, http=True, security=SecuritySection(auth_tokens={KEY: "*"}))
    yield cluster
    cluster.close()


@pytest.fixture
def client(cluster: LocalCluster) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=cluster.http_url, api_key=KEY, max_retries=0) as c:
        yield c


def prompt_tokens(cluster: LocalCluster, messages: list[dict[str, str]]) -> int:
    """What the router's tokenizer makes of a conversation (the chat template, encoded)."""
    tokenizer = cluster.links.tokenizer
    assert tokenizer is not None
    text = tokenizer.apply_chat_template(messages)
    return len(tokenizer.encode(text, add_special_tokens=False))


def assert_serving(client: anthropic.Anthropic, cluster: LocalCluster) -> None:
    """The server still answers, and every request ended with every page back."""
    again = client.messages.create(model=MODEL, max_tokens=2, messages=MESSAGES)
    assert again.type == "message"
    cluster.wait_idle()
    assert not cluster.service.in_flight


def test_message_has_anthropic_shape_and_counts_cache_reads(
    client: anthropic.Anthropic, cluster: LocalCluster
) -> None:
    first = client.messages.create(model=MODEL, max_tokens=8, messages=MESSAGES, extra_body=GREEDY)
    assert first.id.startswith("msg_") and first.type == "message" and first.role == "assistant"
    assert first.model == MODEL
    (block,) = first.content
    assert block.type == "text" and block.text
    usage = first.usage
    assert 1 <= usage.output_tokens <= 8
    assert first.stop_reason == ("max_tokens" if usage.output_tokens == 8 else "end_turn")
    assert first.stop_sequence is None
    assert usage.cache_read_input_tokens is not None
    prompt = prompt_tokens(cluster, MESSAGES)
    assert usage.input_tokens + usage.cache_read_input_tokens == prompt
    again = client.messages.create(model=MODEL, max_tokens=8, messages=MESSAGES, extra_body=GREEDY)
    assert again.content[0].text == block.text  # type: ignore[union-attr]  # greedy
    assert again.id != first.id
    assert again.usage.cache_read_input_tokens  # the same prompt read the cache
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == prompt
    one = client.messages.create(model=MODEL, max_tokens=1, messages=MESSAGES, extra_body=GREEDY)
    assert one.stop_reason == "max_tokens" and one.usage.output_tokens == 1
    cluster.wait_idle()


def test_a_system_prompt_as_a_string_or_as_text_blocks(
    client: anthropic.Anthropic, cluster: LocalCluster
) -> None:
    def ask(system: Any) -> anthropic.types.Message:
        return client.messages.create(
            model=MODEL, max_tokens=6, messages=MESSAGES, system=system, extra_body=GREEDY
        )

    plain = ask(SYSTEM)
    half = len(SYSTEM) // 2
    blocks = ask(
        [
            {"type": "text", "text": SYSTEM[:half]},
            {"type": "text", "text": SYSTEM[half:], "cache_control": {"type": "ephemeral"}},
        ]
    )
    used = [{"role": "system", "content": SYSTEM}, *MESSAGES]
    assert plain.usage.input_tokens + (plain.usage.cache_read_input_tokens or 0) == prompt_tokens(
        cluster, used
    )
    joined = [{"role": "system", "content": f"{SYSTEM[:half]}\n{SYSTEM[half:]}"}, *MESSAGES]
    assert blocks.usage.input_tokens + (blocks.usage.cache_read_input_tokens or 0) == (
        prompt_tokens(cluster, joined)
    )
    assert prompt_tokens(cluster, used) > prompt_tokens(cluster, MESSAGES)  # it was read
    cluster.wait_idle()


def test_stream_matches_the_whole_message(
    client: anthropic.Anthropic, cluster: LocalCluster
) -> None:
    ask: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 12,
        "messages": MESSAGES,
        "extra_body": GREEDY,
    }
    whole = client.messages.create(**ask)
    with client.messages.stream(**ask) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text  # type: ignore[union-attr]
    assert final.content[0].text == text  # type: ignore[union-attr]
    assert final.id.startswith("msg_") and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == (
        prompt_tokens(cluster, MESSAGES)
    )
    cluster.wait_idle()


def test_raw_stream_sends_anthropics_events_in_order(cluster: LocalCluster) -> None:
    body = {"model": MODEL, "max_tokens": 4, "messages": MESSAGES, "stream": True, "temperature": 0}
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    url = f"{cluster.http_url}/v1/messages"
    with httpx.stream("POST", url, json=body, headers=headers) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    datas = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data:")]
    assert [d["type"] for d in datas] == names
    deltas = names.count("content_block_delta")
    assert names == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * deltas,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert 1 <= deltas <= 4
    assert datas[-2]["usage"]["output_tokens"] <= 4 and datas[-2]["delta"]["stop_reason"]


def test_the_async_client_serves_concurrent_messages(cluster: LocalCluster) -> None:
    async def main() -> list[str]:
        async with anthropic.AsyncAnthropic(
            base_url=cluster.http_url, api_key=KEY, max_retries=0
        ) as client:
            answers = await asyncio.gather(
                *(
                    client.messages.create(
                        model=MODEL,
                        max_tokens=6,
                        messages=[{"role": "user", "content": f"{PROMPT} {i % 2}"}],
                        extra_body=GREEDY,
                    )
                    for i in range(6)
                )
            )
            async with client.messages.stream(
                model=MODEL, max_tokens=6, messages=MESSAGES, extra_body=GREEDY
            ) as stream:
                streamed = "".join([t async for t in stream.text_stream])
        texts = [a.content[0].text for a in answers]  # type: ignore[union-attr]
        return [*texts, streamed]

    *texts, streamed = asyncio.run(main())
    assert texts[0::2] == [texts[0]] * 3 and texts[1::2] == [texts[1]] * 3
    assert streamed
    cluster.wait_idle()


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}}
REFUSED: list[tuple[dict[str, Any], type[anthropic.APIStatusError], str]] = [
    (  # a server tool: radixmesh runs no web search
        {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
        anthropic.BadRequestError,
        "tools[0]",
    ),
    (
        {
            "tools": [{"name": "f", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "tool"},
        },
        anthropic.BadRequestError,
        'tool_choice.name: is required with type "tool"',
    ),
    (
        {
            "tools": [{"name": "f", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "tool", "name": "g"},
        },
        anthropic.BadRequestError,
        "tool_choice.name: 'g' is not one of the tools: ['f']",
    ),
    (
        {"tool_choice": {"type": "auto", "disable_parallel_tool_use": True}},
        anthropic.BadRequestError,
        "tool_choice.disable_parallel_tool_use: needs tools, and none are given",
    ),
    (
        {"tools": [{"name": "f", "input_schema": {"type": "string"}}]},
        anthropic.BadRequestError,
        "tools[0].input_schema: a call's arguments are an object",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, IMAGE]}]},
        anthropic.BadRequestError,
        "messages[0].content[1]",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        anthropic.BadRequestError,
        "messages[0].content[0].text:",
    ),
    ({"system": [{"type": "text"}]}, anthropic.BadRequestError, "system[0].text:"),
    ({"model": "not-a-model"}, anthropic.NotFoundError, "not-a-model"),
    ({"extra_body": {"frequency_penalty": 1.0}}, anthropic.BadRequestError, "frequency_penalty"),
    (
        {"thinking": {"type": "enabled", "budget_tokens": 4}},
        anthropic.BadRequestError,
        "max_tokens: `max_tokens` must be greater than `thinking.budget_tokens`: 4 <= 4",
    ),
    (
        {"thinking": {"type": "enabled"}},
        anthropic.BadRequestError,
        'thinking.budget_tokens: is required with type "enabled"',
    ),
    (
        {"thinking": {"type": "adaptive", "budget_tokens": 2}},
        anthropic.BadRequestError,
        'thinking.budget_tokens: is only for type "enabled"',
    ),
    (
        {"thinking": {"type": "enabled", "budget_tokens": 0}},
        anthropic.BadRequestError,
        "thinking.budget_tokens: must be >= 1, got 0",
    ),
    ({"thinking": {"type": "sometimes"}}, anthropic.BadRequestError, "thinking.type"),
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "thinking", "thinking": "hm", "signature": ""}],
                }
            ]
        },
        anthropic.BadRequestError,
        "messages[0].content[0]: thinking blocks come in an assistant turn",
    ),
    (  # blocks are named where they are, whatever other helpers take out
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t", "content": "x"},
                        {"type": "thinking", "thinking": "hm", "signature": ""},
                    ],
                }
            ]
        },
        anthropic.BadRequestError,
        "messages[0].content[1]: thinking blocks come in an assistant turn",
    ),
    (
        {
            "messages": [
                *MESSAGES,
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hm", "signature": ""},
                        {"type": "text", "text": "a"},
                        {"type": "document", "source": {"type": "text", "data": "d"}},
                    ],
                },
                *MESSAGES,
            ]
        },
        anthropic.BadRequestError,
        "messages[1].content[2]: only text and image blocks are served, got type 'document'",
    ),
    ({"max_tokens": 0}, anthropic.BadRequestError, "max_tokens"),
    ({"messages": []}, anthropic.BadRequestError, "messages"),
    ({"extra_body": {"top_k": -2}}, anthropic.BadRequestError, "top_k"),
    (  # over the context: Anthropic's own words, which its clients parse (a pattern, whole)
        {"messages": [{"role": "user", "content": "word " * 600}]},
        anthropic.BadRequestError,
        r"prompt is too long: \d+ tokens > 511 maximum",
    ),
    (
        {"max_tokens": 600},
        anthropic.BadRequestError,
        r"input length and `max_tokens` exceed context limit: \d+ \+ 600 > 512, decrease input "
        r"length or `max_tokens` and try again",
    ),
]


@pytest.mark.parametrize(
    ("change", "error", "named"), REFUSED, ids=[named[:40] for _, _, named in REFUSED]
)
def test_refusals_name_what_was_refused(
    client: anthropic.Anthropic,
    cluster: LocalCluster,
    change: dict[str, Any],
    error: type[anthropic.APIStatusError],
    named: str,
) -> None:
    ask: dict[str, Any] = {"model": MODEL, "max_tokens": 4, "messages": MESSAGES} | change
    with pytest.raises(error) as err:
        client.messages.create(**ask)
    body = err.value.body
    assert isinstance(body, dict) and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"}
    message = body["error"]["message"]
    if named.startswith(("prompt is", "input length")):
        assert re.fullmatch(named, message), message
    else:
        assert named in message
    kind = "not_found_error" if error is anthropic.NotFoundError else "invalid_request_error"
    assert body["error"]["type"] == kind
    assert_serving(client, cluster)


@pytest.mark.parametrize("key", ["wrong", KEY.upper(), KEY + "x", KEY[:-1]])
def test_a_wrong_key_is_refused_with_anthropics_error(cluster: LocalCluster, key: str) -> None:
    with anthropic.Anthropic(base_url=cluster.http_url, api_key=key, max_retries=0) as client:
        with pytest.raises(anthropic.AuthenticationError) as err:
            client.messages.create(model=MODEL, max_tokens=2, messages=MESSAGES)
        with pytest.raises(anthropic.AuthenticationError):
            client.messages.count_tokens(model=MODEL, messages=MESSAGES)
    assert err.value.status_code == 401
    body = err.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert (
        body["error"]["type"] == "authentication_error" and "x-api-key" in body["error"]["message"]
    )
    plain = httpx.post(f"{cluster.http_url}/v1/messages", json={"model": MODEL})  # no key at all
    assert plain.status_code == 401 and plain.json()["error"]["type"] == "authentication_error"


def test_count_tokens_equals_the_prompt_of_a_real_call(
    client: anthropic.Anthropic, cluster: LocalCluster
) -> None:
    conversation: list[Any] = [
        {"role": "user", "content": PROMPT},
        {"role": "assistant", "content": [{"type": "text", "text": "a fox"}]},
        {"role": "user", "content": "and then?"},
    ]
    for system in (None, SYSTEM):
        extra: dict[str, Any] = {"system": system} if system else {}
        counted = client.messages.count_tokens(model=MODEL, messages=conversation, **extra)
        real = client.messages.create(model=MODEL, max_tokens=2, messages=conversation, **extra)
        assert counted.input_tokens == real.usage.input_tokens + (
            real.usage.cache_read_input_tokens or 0
        )
    bare = client.messages.count_tokens(model=MODEL, messages=MESSAGES)
    with_tools = client.messages.count_tokens(
        model=MODEL, messages=MESSAGES, tools=[{"name": "f", "input_schema": {"type": "object"}}]
    )
    assert with_tools.input_tokens > bare.input_tokens + 50  # the tools are described
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="other", messages=MESSAGES)
    cluster.wait_idle()


def test_a_stop_sequence_is_named_as_what_stopped_the_message(
    client: anthropic.Anthropic, cluster: LocalCluster
) -> None:
    whole = client.messages.create(model=MODEL, max_tokens=24, messages=MESSAGES, extra_body=GREEDY)
    text = whole.content[0].text  # type: ignore[union-attr]
    assert len(text) > 6, text
    stop = text[3:6]
    ask: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 24,
        "messages": MESSAGES,
        "stop_sequences": [stop, "never-appears"],
        "cache_control": {"type": "ephemeral"},
        "extra_body": GREEDY,
    }
    cut = client.messages.create(**ask)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]  # type: ignore[union-attr]
    with client.messages.stream(**ask) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == cut.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    assert_serving(client, cluster)


def test_the_sdks_models_api_lists_and_retrieves_in_anthropic_shape(
    client: anthropic.Anthropic, cluster: LocalCluster
) -> None:
    """The Anthropic SDK's `models` calls reach the same endpoints as OpenAI's, and get
    Anthropic's shapes back: it sends `anthropic-version`, which OpenAI's SDK never does."""
    listed = client.models.list()
    assert [m.id for m in listed.data] == [MODEL]
    assert listed.data[0].type == "model" and listed.data[0].display_name == MODEL
    assert listed.first_id == listed.last_id == MODEL and not listed.has_more
    assert client.models.retrieve(MODEL) == listed.data[0]
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.models.retrieve("claude-3-5-haiku-latest")
    body = missing.value.response.json()
    assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
    assert "'claude-3-5-haiku-latest' does not exist" in body["error"]["message"]
    raw = httpx.get(f"{cluster.http_url}/v1/models", headers={"x-api-key": KEY}).json()
    assert raw["object"] == "list", "OpenAI's shape without anthropic-version"


@pytest.mark.parametrize(
    "thinking",
    [{"type": "enabled", "budget_tokens": 2}, {"type": "adaptive"}, {"type": "disabled"}],
    ids=["enabled", "adaptive", "disabled"],
)
def test_a_model_that_does_not_think_answers_as_always_when_asked_to(
    client: anthropic.Anthropic, thinking: dict[str, Any]
) -> None:
    """Claude Code and other clients send `thinking`: a model with no `</think>` in its
    template answers them exactly as without it, with no thinking block."""
    ask: dict[str, Any] = {"model": MODEL, "max_tokens": 6, "messages": MESSAGES}
    greedy = {"temperature": 0.0}
    plain = client.messages.create(**ask, extra_body=greedy)
    asked = client.messages.create(**ask, extra_body=greedy, thinking=thinking)  # type: ignore[arg-type]
    assert [b.type for b in asked.content] == ["text"]
    assert asked.content == plain.content and asked.usage == plain.usage


@pytest.mark.parametrize("stream", [False, True])
def test_an_aborted_message_is_an_error_not_a_stop_reason_of_its_own(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    """Anthropic has no stop reason for an abort (SGLang's /abort_request of its id here):
    answered whole, a 499 in Anthropic's error shape; streamed, an `error` event and no
    message_delta or message_stop after it."""
    rid = f"to-abort-{int(stream)}"
    body = {"model": MODEL, "max_tokens": 200, "messages": MESSAGES, "stream": stream}
    headers = {"x-request-id": rid, "anthropic-version": "2023-06-01", "x-api-key": KEY}
    release = cluster.hold_engines_after(4, monkeypatch)
    try:
        with ThreadPoolExecutor(2) as pool:
            url = f"{cluster.http_url}/v1/messages"
            answer = pool.submit(httpx.post, url, json=body, headers=headers, timeout=60)
            deadline = time.monotonic() + 10
            while rid not in cluster.service.in_flight:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            aborted = pool.submit(  # answered once the held engine takes the Abort
                httpx.post,
                f"{cluster.http_url}/abort_request",
                json={"rid": rid},
                headers={"authorization": f"Bearer {KEY}"},
                timeout=60,
            )
            time.sleep(0.3)
            release.set()
            assert aborted.result(timeout=60).json() == {"aborted": [rid]}
            response = answer.result(timeout=60)
    finally:
        release.set()
    cluster.wait_idle()
    if not stream:
        assert response.status_code == 499, response.text
        assert response.json()["type"] == "error"
        assert "aborted" in response.json()["error"]["message"]
        return
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line[:6] == "data: "]
    assert events[-1]["type"] == "error" and "aborted" in events[-1]["error"]["message"]
    assert all(e["type"] not in ("message_delta", "message_stop") for e in events)


def test_count_tokens_takes_what_a_message_takes(client: anthropic.Anthropic) -> None:
    """The request's `cache_control` (the SDK's count_tokens declares it) as create does; and a
    refused stop sequence is named as the body names it."""
    ask: dict[str, Any] = {"model": MODEL, "messages": MESSAGES}
    cached = {"cache_control": {"type": "ephemeral"}}
    real = client.messages.create(max_tokens=1, **ask, extra_body=cached)
    counted = client.messages.count_tokens(**ask, extra_body=cached)
    assert counted.input_tokens == real.usage.input_tokens + (
        real.usage.cache_read_input_tokens or 0
    )
    for stops, named in (
        ([""], "stop_sequences[0]"),
        ([str(i) for i in range(17)], "stop_sequences"),
    ):
        with pytest.raises(anthropic.BadRequestError) as refused:
            client.messages.create(max_tokens=2, stop_sequences=stops, **ask)
        assert refused.value.body["error"]["message"].startswith(named + ":")  # type: ignore[index]
