"""Anthropic's extended thinking (`thinking`) on a thinking model, with the `anthropic` SDK:
the reasoning as a `thinking` block before the answer, streamed or whole (its events, with a
call after it, checked on made-up streams through the SDK's accumulator), closed at
`budget_tokens` (the chat API's `thinking_token_budget` gives the same tokens), left empty
with `display: "omitted"`, left out by default and with `disabled` (which the template reads);
thinking blocks sent back in an assistant turn reach the template as its reasoning. The tiny
model writes random tokens: only the budget closes its reasoning."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anthropic
import openai
import pytest
from anthropic._models import construct_type_unchecked
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import RawMessageStreamEvent

from cluster.http import anthropic_routes
from cluster.http.anthropic_schema import ThinkingConfig
from cluster.http.anthropic_thinking import Thinking, read_thinking, signature
from protos.radixmesh.v1 import serving_pb2
from tests.cluster.local_cluster import SERVED_NAME, LocalCluster
from worker.loader import LoadedModel

QUESTION: list[Any] = [{"role": "user", "content": "Which city?"}]
ENABLED = {"type": "enabled", "budget_tokens": 5}
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def cluster(thinking_cluster: LocalCluster) -> LocalCluster:
    return thinking_cluster


@pytest.fixture
def claude(cluster: LocalCluster) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=cluster.http_url, api_key="x", max_retries=0) as c:
        yield c


@pytest.fixture
def client(cluster: LocalCluster) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="x", max_retries=0) as c:
        yield c


def ask(claude: anthropic.Anthropic, **more: Any) -> anthropic.types.Message:
    settings: dict[str, Any] = {"max_tokens": 16, "messages": QUESTION, "extra_body": GREEDY}
    return claude.messages.create(model=SERVED_NAME, **(settings | more))


def chat(client: openai.OpenAI, max_tokens: int = 16, **extra: Any) -> tuple[str, str]:
    """The chat API's (reasoning_content, content) for the same question."""
    reply = client.chat.completions.create(
        model=SERVED_NAME, messages=QUESTION, temperature=0.0, max_tokens=max_tokens,
        extra_body=extra,
    )  # fmt: skip
    message = reply.choices[0].message
    return (message.model_extra or {}).get("reasoning_content") or "", message.content or ""


def blocks(message: anthropic.types.Message) -> list[tuple[str, str]]:
    return [(b.type, getattr(b, "thinking", getattr(b, "text", ""))) for b in message.content]


def signatures(message: anthropic.types.Message) -> list[str | None]:
    return [getattr(b, "signature", None) for b in message.content]


def test_the_budget_closes_the_thinking_block_and_the_answer_follows(
    claude: anthropic.Anthropic, client: openai.OpenAI
) -> None:
    reply = ask(claude, thinking=ENABLED)
    thought, answer = chat(client, thinking_token_budget=5)
    assert thought and answer  # the chat API with the same budget: closed, then answered
    assert blocks(reply) == [("thinking", thought), ("text", answer)]
    block = reply.content[0]
    assert isinstance(block, anthropic.types.ThinkingBlock)
    assert block.signature == signature(thought)
    assert reply.stop_reason == "max_tokens" and reply.usage.output_tokens == 16


def test_streamed_the_blocks_are_the_same(claude: anthropic.Anthropic) -> None:
    whole = ask(claude, thinking=ENABLED)
    with claude.messages.stream(
        model=SERVED_NAME, max_tokens=16, messages=QUESTION, extra_body=GREEDY, thinking=ENABLED,  # type: ignore[arg-type]
    ) as stream:  # fmt: skip
        kinds = [(e.type, getattr(e, "index", None)) for e in stream]
        streamed = stream.get_final_message()
    assert blocks(streamed) == blocks(whole) and signatures(streamed) == signatures(whole)
    assert streamed.stop_reason == whole.stop_reason
    starts = [index for kind, index in kinds if kind == "content_block_start"]
    stops = [index for kind, index in kinds if kind == "content_block_stop"]
    assert starts == stops == [0, 1]
    assert kinds.index(("content_block_stop", 0)) < kinds.index(("content_block_start", 1))


def test_adaptive_thinks_as_long_as_the_model_wants(
    claude: anthropic.Anthropic, client: openai.OpenAI
) -> None:
    """Cut by max_tokens while thinking: the thinking block alone, as Anthropic's API answers."""
    reply = ask(claude, max_tokens=6, thinking={"type": "adaptive"})
    thought, answer = chat(client, max_tokens=6)
    assert answer == "" and blocks(reply) == [("thinking", thought)]
    assert reply.stop_reason == "max_tokens"
    with claude.messages.stream(
        model=SERVED_NAME, max_tokens=6, messages=QUESTION, extra_body=GREEDY,
        thinking={"type": "adaptive"},
    ) as stream:  # fmt: skip
        streamed = stream.get_final_message()
    assert blocks(streamed) == blocks(reply) and signatures(streamed) == signatures(reply)


def test_omitted_keeps_the_block_and_its_signature_without_the_text(
    claude: anthropic.Anthropic,
) -> None:
    shown = ask(claude, thinking=ENABLED)
    omitted = ask(claude, thinking=ENABLED | {"display": "omitted"})
    assert [b.type for b in omitted.content] == ["thinking", "text"]
    first, hidden = shown.content[0], omitted.content[0]
    assert isinstance(first, anthropic.types.ThinkingBlock)
    assert isinstance(hidden, anthropic.types.ThinkingBlock)
    assert hidden.thinking == "" and hidden.signature == first.signature
    assert omitted.content[1] == shown.content[1]


def test_disabled_asks_the_template_not_to_think(
    claude: anthropic.Anthropic, client: openai.OpenAI
) -> None:
    reply = ask(claude, thinking={"type": "disabled"})
    thought, answer = chat(client, chat_template_kwargs={"enable_thinking": False})
    assert thought == "" and answer
    assert blocks(reply) == [("text", answer)]
    counted = claude.messages.count_tokens(
        model=SERVED_NAME, messages=QUESTION, thinking={"type": "disabled"}
    )
    plain = claude.messages.count_tokens(model=SERVED_NAME, messages=QUESTION)
    assert counted.input_tokens == reply.usage.input_tokens + (
        reply.usage.cache_read_input_tokens or 0
    )
    assert counted.input_tokens > plain.input_tokens  # the template wrote the closed thinking


def test_thinking_blocks_sent_back_are_the_turns_reasoning(
    claude: anthropic.Anthropic, client: openai.OpenAI
) -> None:
    """An assistant turn's thinking block reaches the template as the chat API's
    `reasoning_content`: the same prompt, token for token."""
    thought = {"type": "thinking", "thinking": "it rains", "signature": "anything"}
    redacted = {"type": "redacted_thinking", "data": "opaque"}
    turns: list[Any] = [
        *QUESTION,
        {"role": "assistant", "content": [thought, redacted, {"type": "text", "text": "Paris"}]},
        {"role": "user", "content": "Why?"},
    ]
    counted = claude.messages.count_tokens(model=SERVED_NAME, messages=turns)
    reply = client.chat.completions.create(
        model=SERVED_NAME, max_tokens=1,
        messages=[
            turns[0],
            {"role": "assistant", "content": "Paris", "reasoning_content": "it rains"},  # type: ignore[list-item, misc]
            turns[2],
        ],
    )  # fmt: skip
    without = client.chat.completions.create(
        model=SERVED_NAME, max_tokens=1,
        messages=[turns[0], {"role": "assistant", "content": "Paris"}, turns[2]],
    )  # fmt: skip
    assert reply.usage is not None and without.usage is not None
    assert counted.input_tokens == reply.usage.prompt_tokens > without.usage.prompt_tokens
    served = claude.messages.create(model=SERVED_NAME, max_tokens=1, messages=turns)
    assert served.usage.input_tokens + (served.usage.cache_read_input_tokens or 0) == (
        counted.input_tokens
    )


def test_the_chat_usage_counts_the_reasoning_tokens(
    client: openai.OpenAI, thinking: LoadedModel
) -> None:
    """With a budget of 5, the reasoning is those 5 tokens and the forced `</think>`'s."""
    assert thinking.tokenizer is not None
    close = thinking.tokenizer.encode("</think>", add_special_tokens=False)
    reply = client.chat.completions.create(
        model=SERVED_NAME, messages=QUESTION, temperature=0.0, max_tokens=16,
        extra_body={"thinking_token_budget": 5},
    )  # fmt: skip
    assert reply.usage is not None and reply.usage.completion_tokens_details is not None
    assert reply.usage.completion_tokens_details.reasoning_tokens == 5 + len(close)
    whole = client.chat.completions.create(
        model=SERVED_NAME, messages=QUESTION, temperature=0.0, max_tokens=16,
        extra_body={"thinking_token_budget": 5, "separate_reasoning": False},
    )  # fmt: skip
    assert whole.usage is not None and whole.usage.completion_tokens_details is not None
    assert whole.usage.completion_tokens_details.reasoning_tokens == 0  # not told apart


def test_the_chat_apis_budget_is_refused_below_zero(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, thinking_token_budget=-1)
    assert "thinking_token_budget" in str(err.value)


# the events of thinking, text and a call, on made-up streams, through the SDK's accumulator

CALL = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'


def streamed(
    chunks: list[tuple[str, str]], tools: frozenset[str], thinking: Thinking
) -> tuple[list[dict[str, Any]], Any]:
    """(reasoning, text) per worker message, the last finishing: the events, and the message
    anthropic's SDK accumulates from them."""
    responses = [
        serving_pb2.GenerateResponse(index=0, reasoning_text=r, text=t, token_ids=[1], worker="w")
        for r, t in chunks
    ]
    responses[-1].finished, responses[-1].finish_reason = True, "stop"

    async def rest() -> AsyncIterator[serving_pb2.GenerateResponse]:
        for each in responses[1:]:
            yield each

    async def collect() -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        stream = anthropic_routes.events("msg_x", "m", responses[0], rest(), tools, thinking)
        async for raw in stream:
            out += [
                json.loads(line.removeprefix("data: "))
                for line in raw.decode().split("\n")
                if line.startswith("data: ")
            ]
        return out

    events = asyncio.run(collect())
    snapshot = None
    for event in events:
        parsed = construct_type_unchecked(type_=RawMessageStreamEvent, value=event)  # type: ignore[arg-type]
        snapshot = accumulate_event(event=parsed, current_snapshot=snapshot, json_bufs={})  # type: ignore[arg-type]
    return events, snapshot


SHOWN = read_thinking(ThinkingConfig(type="adaptive"))


@pytest.mark.parametrize(
    ("chunks", "tools", "thinking", "expected"),
    [
        (
            [("it ", ""), ("rains", "\n\nok"), ("", CALL)],
            frozenset({"f"}),
            SHOWN,
            [("thinking", "it rains"), ("text", "\n\nok"), ("tool_use", "f")],
        ),
        (
            [("it rains", ""), ("", CALL)],
            frozenset({"f"}),
            SHOWN,
            [("thinking", "it rains"), ("tool_use", "f")],
        ),
        ([("it ", ""), ("rains", "")], frozenset(), SHOWN, [("thinking", "it rains")]),
        (
            [("it rains", "ok")],
            frozenset(),
            read_thinking(ThinkingConfig(type="adaptive", display="omitted")),
            [("thinking", ""), ("text", "ok")],
        ),
        ([("it rains", ""), ("", "ok")], frozenset(), read_thinking(None), [("text", "ok")]),
    ],
    ids=["thinking-text-call", "thinking-call", "cut-thinking", "omitted", "not-asked"],
)
def test_the_blocks_are_numbered_in_order_and_the_sdk_accumulates_them(
    chunks: list[tuple[str, str]],
    tools: frozenset[str],
    thinking: Thinking,
    expected: list[tuple[str, str]],
) -> None:
    events, message = streamed(chunks, tools, thinking)
    said = {"thinking": "thinking", "text": "text", "tool_use": "name"}
    got = [(b.type, getattr(b, said[b.type])) for b in message.content]
    assert got == expected
    starts = [e["index"] for e in events if e["type"] == "content_block_start"]
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert starts == stops == list(range(len(expected)))
    for block in message.content:
        if block.type == "thinking":
            assert block.signature == signature("it rains")
    deltas = [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"]
    assert ("thinking_delta" in deltas) == (thinking.shown and not thinking.omitted)
