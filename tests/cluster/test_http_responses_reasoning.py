"""A thinking model's reasoning on OpenAI's Responses API, with the `openai` SDK: a `reasoning`
item before the answer (its text in `content`, as vLLM serves it), the same whole or streamed;
reasoning items sent back in `input` reach the template as the next assistant turn's reasoning;
`reasoning.effort` (and chat completions' `reasoning_effort`) reach the template, "none" turning
the thinking off. The events of a reasoning followed by an answer and a call are checked on a
made-up stream, which the tiny random model cannot be made to write here."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import openai
import pytest
from openai._models import construct_type_unchecked
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from cluster.http import responses_output, responses_stream
from cluster.http.responses_schema import ResponsesRequest
from cluster.http.token_texts import TokenTexts
from protos.radixmesh.v1 import serving_pb2
from tests.cluster.local_cluster import SERVED_NAME, LocalCluster

QUESTION = [{"role": "user", "content": "Which city?"}]


@pytest.fixture(scope="module")
def cluster(thinking_cluster: LocalCluster) -> LocalCluster:
    return thinking_cluster


@pytest.fixture
def client(cluster: LocalCluster) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="x", max_retries=0) as c:
        yield c


def reasoning_of(client: openai.OpenAI, max_tokens: int = 6, **extra: Any) -> tuple[str, str]:
    """The chat API's (reasoning_content, content) for the question."""
    reply = client.chat.completions.create(
        model=SERVED_NAME, messages=QUESTION, temperature=0.0, max_tokens=max_tokens,  # type: ignore[arg-type]
        extra_body=extra,
    )  # fmt: skip
    message = reply.choices[0].message
    return (message.model_extra or {}).get("reasoning_content") or "", message.content or ""


def items(response: Any) -> list[tuple[str, str, str | None]]:
    """(type, text, status) of each output item."""
    out = []
    for item in response.output:
        parts = getattr(item, "content", None) or []
        out.append((item.type, "".join(p.text for p in parts), getattr(item, "status", None)))
    return out


def test_the_reasoning_is_an_item_whole_or_streamed(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    """Cut while thinking: the reasoning item alone, incomplete, as is the response."""
    thought, answer = reasoning_of(client)
    assert thought and answer == ""
    whole = client.responses.create(
        model=SERVED_NAME, input="Which city?", max_output_tokens=6, temperature=0.0
    )
    assert items(whole) == [("reasoning", thought, "incomplete")]
    assert whole.status == "incomplete" and whole.output_text == ""
    assert whole.usage is not None  # every token was the reasoning's
    assert whole.usage.output_tokens_details.reasoning_tokens == whole.usage.output_tokens == 6
    with client.responses.stream(
        model=SERVED_NAME, input="Which city?", max_output_tokens=6, temperature=0.0
    ) as stream:
        seen = list(stream)
    kinds = [event.type for event in seen]
    streamed = getattr(seen[-1], "response")  # the SDK finishes only a completed one  # noqa: B009
    assert items(streamed) == items(whole)
    deltas = kinds.count("response.reasoning_text.delta")
    assert deltas >= 1 and kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        *["response.reasoning_text.delta"] * deltas,
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.incomplete",
    ]  # fmt: skip
    cluster.wait_idle()


def test_reasoning_items_sent_back_are_the_next_turns_reasoning(client: openai.OpenAI) -> None:
    """A reasoning item as a response gave it, then the answer: the prompt is the chat API's
    with the turn's `reasoning_content`, token for token; `encrypted_content` is passed over."""
    reasoning = {
        "type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque",
        "content": [{"type": "reasoning_text", "text": "it rains"}],
    }  # fmt: skip
    answer = {"role": "assistant", "content": [{"type": "output_text", "text": "Paris"}]}
    follow: list[Any] = [*QUESTION, reasoning, answer, {"role": "user", "content": "Why?"}]
    served = client.responses.create(model=SERVED_NAME, input=follow, max_output_tokens=1)
    chat = client.chat.completions.create(
        model=SERVED_NAME, max_tokens=1,
        messages=[
            QUESTION[0],
            {"role": "assistant", "content": "Paris", "reasoning_content": "it rains"},  # type: ignore[list-item, misc]
            {"role": "user", "content": "Why?"},
        ],
    )  # fmt: skip
    without = client.responses.create(
        model=SERVED_NAME, input=[*QUESTION, answer, follow[-1]], max_output_tokens=1
    )
    assert served.usage is not None and chat.usage is not None and without.usage is not None
    assert served.usage.input_tokens == chat.usage.prompt_tokens > without.usage.input_tokens
    summary = [{"type": "summary_text", "text": "it rains"}]
    summary_only = {**reasoning, "content": None, "summary": summary}
    again = client.responses.create(
        model=SERVED_NAME, input=[*QUESTION, summary_only, answer, follow[-1]], max_output_tokens=1
    )
    assert again.usage is not None and again.usage.input_tokens == served.usage.input_tokens


def test_a_reasoning_item_before_calls_is_their_turns_reasoning(client: openai.OpenAI) -> None:
    reasoning = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "look"}]}
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    output = {"type": "function_call_output", "call_id": "c1", "output": "sunny"}
    served = client.responses.create(
        model=SERVED_NAME,
        input=[*QUESTION, reasoning, call, output],
        max_output_tokens=1,  # type: ignore[list-item]
    )
    plain = client.responses.create(
        model=SERVED_NAME,
        input=[*QUESTION, call, output],
        max_output_tokens=1,  # type: ignore[list-item]
    )
    assert served.usage is not None and plain.usage is not None
    assert served.usage.input_tokens > plain.usage.input_tokens


def test_effort_reaches_the_template_and_none_turns_the_thinking_off(
    client: openai.OpenAI,
) -> None:
    """The fixture's template writes `reasoning_effort` into the prompt; "none" also asks it
    not to think (`enable_thinking: false`), on both APIs."""
    variables = {"reasoning_effort": "none", "enable_thinking": False}
    off, answer = reasoning_of(client, chat_template_kwargs=variables)
    assert off == "" and answer
    assert reasoning_of(client, reasoning_effort="none") == (off, answer)
    response = client.responses.create(
        model=SERVED_NAME, input="Which city?", max_output_tokens=6, temperature=0.0,
        reasoning={"effort": "none", "summary": "auto"},
    )  # fmt: skip
    assert items(response) == [("message", answer, "incomplete")]
    assert response.reasoning is not None and response.reasoning.effort == "none"

    def prompt(**extra: Any) -> int:
        reply = client.chat.completions.create(
            model=SERVED_NAME, messages=QUESTION, max_tokens=1, extra_body=extra,  # type: ignore[arg-type]
        )  # fmt: skip
        assert reply.usage is not None
        return reply.usage.prompt_tokens

    high = client.responses.create(
        model=SERVED_NAME,
        input=QUESTION,
        max_output_tokens=1,
        reasoning={"effort": "high"},  # type: ignore[arg-type]
    )
    assert high.usage is not None
    assert prompt(reasoning_effort="high") == high.usage.input_tokens > prompt()
    assert prompt(reasoning_effort="high") == prompt(
        chat_template_kwargs={"reasoning_effort": "high"}
    )


# the events of a reasoning, an answer and a call, on a made-up stream


def made_up(*chunks: tuple[str, str]) -> list[serving_pb2.GenerateResponse]:
    """(reasoning, text) per message, the last finishing."""
    out = [
        serving_pb2.GenerateResponse(index=0, reasoning_text=r, text=t, token_ids=[1], worker="w")
        for r, t in chunks
    ]
    out[-1].finished, out[-1].finish_reason = True, "stop"
    return out


def run_events(
    responses: list[serving_pb2.GenerateResponse],
    tools: frozenset[str],
    texts: TokenTexts | None = None,
) -> list[dict[str, Any]]:
    """The events of a made-up stream, as JSON (`texts`: with the answer's logprobs)."""
    shell = responses_output.shell(ResponsesRequest(model="m", input="q"), "resp_x", "m")

    async def rest() -> AsyncIterator[serving_pb2.GenerateResponse]:
        for each in responses[1:]:
            yield each

    async def collect() -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        generated = responses_stream.events(shell, responses[0], rest(), tools, texts=texts)
        async for raw in generated:
            out += [
                json.loads(line.removeprefix("data: "))
                for line in raw.decode().split("\n")
                if line.startswith("data: ")
            ]
        return out

    return asyncio.run(collect())


CALL = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'


@pytest.mark.parametrize("tools", [frozenset(), frozenset({"f"})], ids=["text", "call"])
def test_reasoning_then_answer_events_add_up_to_the_response(tools: frozenset[str]) -> None:
    chunks = [("it ", ""), ("rains", "\n\nPa"), ("", "ris")]
    if tools:
        chunks.append(("", CALL))
    events = run_events(made_up(*chunks), tools)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    kinds = [item["type"] for item in final["output"]]
    assert kinds == ["reasoning", "message", *(["function_call"] if tools else [])]
    reasoning, message = final["output"][:2]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "it rains"}]
    assert reasoning["status"] == message["status"] == "completed"
    assert message["content"][0]["text"] == "\n\nParis"
    # each item's events name its place; the reasoning is done before the message opens
    added = [
        (e["output_index"], e["item"]["type"])
        for e in events
        if e["type"] == "response.output_item.added"
    ]
    assert added == list(enumerate(kinds))
    names = [e["type"] for e in events]
    assert names.index("response.reasoning_text.done") < names.index("response.output_text.delta")
    text = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert text == "it rains"
    state = ResponseStreamState(input_tools=openai.omit, text_format=openai.omit)
    for event in events:  # the SDK's own accumulation of the events
        state.handle_event(construct_type_unchecked(type_=ResponseStreamEvent, value=event))
    snapshot = state._completed_response
    assert snapshot is not None and items(snapshot)[:2] == [
        ("reasoning", "it rains", "completed"), ("message", "\n\nParis", "completed"),
    ]  # fmt: skip
    if tools:
        call = snapshot.output[2]
        assert call.type == "function_call" and (call.name, call.arguments) == ("f", '{"x": 1}')


def test_a_stream_that_fails_keeps_the_reasoning_it_sent() -> None:
    failing = [
        serving_pb2.GenerateResponse(index=0, reasoning_text="it rains", token_ids=[1], worker="w"),
        serving_pb2.GenerateResponse(index=0, finished=True, finish_reason="error", worker="w"),
    ]
    events = run_events(failing, frozenset())
    assert events[-1]["type"] == "response.failed"
    output = events[-1]["response"]["output"]
    assert [(i["type"], i["content"][0]["text"], i["status"]) for i in output] == [
        ("reasoning", "it rains", "incomplete")
    ]
    state = ResponseStreamState(input_tools=openai.omit, text_format=openai.omit)
    for event in events:
        state.handle_event(construct_type_unchecked(type_=ResponseStreamEvent, value=event))


def test_a_stored_conversations_reasoning_reaches_the_follow_up(client: openai.OpenAI) -> None:
    """Reasoning items in a stored response's input are its assistant turn's reasoning in a
    follow-up naming it, token for token as when the whole conversation is sent again."""
    reasoning = {
        "type": "reasoning", "summary": [],
        "content": [{"type": "reasoning_text", "text": "it rains"}],
    }  # fmt: skip
    answer = {"role": "assistant", "content": "Paris"}
    first_input: list[Any] = [*QUESTION, reasoning, answer, {"role": "user", "content": "Why?"}]
    first = client.responses.create(model=SERVED_NAME, input=first_input, max_output_tokens=2)
    follow = client.responses.create(
        model=SERVED_NAME, input="And?", previous_response_id=first.id, max_output_tokens=1
    )
    sent_back = [item.model_dump(exclude_none=True) for item in first.output]
    and_then = {"role": "user", "content": "And?"}
    whole, without = (
        client.responses.create(
            model=SERVED_NAME,
            input=[*turns, *sent_back, and_then],
            max_output_tokens=1,
            store=False,
        )
        for turns in (first_input, [*QUESTION, answer, first_input[-1]])
    )
    assert follow.usage is not None and whole.usage is not None and without.usage is not None
    assert follow.usage.input_tokens == whole.usage.input_tokens > without.usage.input_tokens


def test_encrypted_content_carries_the_reasoning_to_the_next_turn(client: openai.OpenAI) -> None:
    """`include: ["reasoning.encrypted_content"]`, as Codex sends it with `store: false`: the
    reasoning item holds its text encoded, and the item sent back with nothing else (as a
    client that drops `content` does) is the turn's reasoning, token for token."""
    first = client.responses.create(
        model=SERVED_NAME, input="Which city?", max_output_tokens=6, temperature=0.0,
        include=["reasoning.encrypted_content"], store=False, prompt_cache_key="conversation-1",
    )  # fmt: skip
    item = first.output[0]
    assert item.type == "reasoning" and item.encrypted_content and item.content
    assert responses_output.unsealed(item.encrypted_content) == item.content[0].text
    with client.responses.stream(
        model=SERVED_NAME, input="Which city?", max_output_tokens=6, temperature=0.0,
        include=["reasoning.encrypted_content"],
    ) as stream:  # fmt: skip
        done = [e for e in stream if e.type == "response.output_item.done"]
    assert getattr(done[0].item, "encrypted_content", None) == item.encrypted_content
    plain = client.responses.create(model=SERVED_NAME, input="Which city?", max_output_tokens=1)
    assert all(getattr(i, "encrypted_content", None) is None for i in plain.output)
    sent_back = {"type": "reasoning", "summary": [], "encrypted_content": item.encrypted_content}
    answer = {"role": "assistant", "content": "Paris"}
    again = client.responses.create(
        model=SERVED_NAME, max_output_tokens=1,
        input=[*QUESTION, sent_back, answer, {"role": "user", "content": "Why?"}],  # type: ignore[list-item]
    )  # fmt: skip
    chat = client.chat.completions.create(
        model=SERVED_NAME, max_tokens=1, prompt_cache_key="conversation-1",
        messages=[
            QUESTION[0],
            {"role": "assistant", "content": "Paris", "reasoning_content": item.content[0].text},  # type: ignore[list-item, misc]
            {"role": "user", "content": "Why?"},
        ],
    )  # fmt: skip
    assert again.usage is not None and chat.usage is not None
    assert again.usage.input_tokens == chat.usage.prompt_tokens


def test_other_includes_are_refused_by_name(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(
            model=SERVED_NAME, input="Which city?", max_output_tokens=1,
            include=["reasoning.encrypted_content", "file_search_call.results"],
        )  # fmt: skip
    body = err.value.body
    assert isinstance(body, dict) and body["param"] == "include[1]"
    assert responses_output.unsealed("gAAAAAB-openai-ciphertext") is None
